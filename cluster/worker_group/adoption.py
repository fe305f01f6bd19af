"""The next driver's side of ranks that outlived their driver (docs/failures.md, "driver dies"): find the
run's detached ranks (``cluster.worker_group.pulse``), ask each what it holds, and adopt them when they agree
(``cluster.seam.adoption.refusal``): they are told the new lease generation before anything else, and the
new driver collects the epoch they were given. Ranks that cannot be adopted are ended and their placement
groups freed; the run resumes from storage as it would have."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray._raylet import PlacementGroupID
from ray.util import placement_group_table
from ray.util.placement_group import PlacementGroup, remove_placement_group

from cluster.run.lease import GENERATION_ENV
from cluster.run.storage import PROBE_ENV, write_probe
from cluster.seam.adoption import Adoption, RankReport, adopted_infos, refusal, spare_slots, unused
from cluster.spec.config import JobConfig
from cluster.worker_group.calls import Stamped, kill, short
from cluster.worker_group.placement import Resources
from cluster.worker_group.pulse import NAMESPACE, SPARE_ROLE, parse_name, run_key, stale_placement_groups
from cluster.worker_group.ray_group import RayWorkerGroup

logger = logging.getLogger(__name__)

ANSWER_S = 15.0
"""Seconds the ranks get to answer a report or an adoption."""


def adopt(
    cfg: JobConfig, run_url: str, generation: int, task_cls: Any = None, storage: Any = None
) -> Adoption | None:
    """Adopt the ranks an earlier generation of this run left running, or stop them (saying why). None when
    there are none. ``cfg``: the new driver's (its group's generation is ``generation``); ``storage``: the
    run's, where the new storage probe is written. Either way, the placement groups older generations of the
    run left behind and that the adopted group does not hold are removed (:func:`free_leftovers`)."""
    adoption = _adopt(cfg, run_url, generation, task_cls, storage)
    keep: list[str] = []
    if adoption is not None and isinstance(adoption.group, RayWorkerGroup):
        keep = [pg.id.hex() for pg in adoption.group.placement.groups()]
    free_leftovers(run_key(run_url), generation, keep)
    return adoption


def free_leftovers(key: str, generation: int, keep: list[str]) -> list[str]:
    """Remove the placement groups of run ``key`` that drivers of generations before ``generation`` made and
    nobody holds (``pulse.stale_placement_groups``): every rank in them died (killed, a lost node) before
    its orphan timeout could free them. Returns their ids."""
    try:
        table = placement_group_table()
    except Exception as exc:  # the listing failed: the orphans' own timeouts still free the rest
        logger.warning("could not list the placement groups left by earlier drivers: %s", short(exc))
        return []
    stale = stale_placement_groups(table, key, generation, keep)
    for pg_id in stale:
        logger.warning(
            "removing placement group %s (%s): an earlier driver of this run left it with no rank in it",
            table[pg_id].get("name"),
            pg_id,
        )
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        except Exception as exc:  # removed meanwhile (an orphan's timeout)
            logger.info("removing placement group %s: %s", pg_id, short(exc))
    return stale


def _adopt(
    cfg: JobConfig, run_url: str, generation: int, task_cls: Any = None, storage: Any = None
) -> Adoption | None:
    key = run_key(run_url)
    found, spares = _find(key)
    if not found:
        return None
    previous = max((g for g in found if g < generation), default=None)
    for gen, handles in found.items():
        if gen != previous:
            _end(handles, [], f"ranks of lease generation {gen}")
    if previous is None:
        return None
    handles = found[previous]
    reports = _reports(handles)
    extra = unused(reports, [i for i, h in enumerate(handles) if id(h) in spares])
    if extra:
        logger.warning(
            "ending %d process(es) the previous driver had prepared and not begun: a move's replacements, "
            "an idle hot spare",
            len(extra),
        )
        # their own placement groups (a move's) go with the leftovers; a spare's is the group's
        for i in extra:
            kill(handles[i], "an unused replacement or spare")
        handles = [h for i, h in enumerate(handles) if i not in extra]
        reports = [r for i, r in enumerate(reports) if i not in extra]
        if not handles:
            return None  # nothing but those: nothing to adopt
    why = refusal(reports, key, previous)
    if why is not None:
        _end(handles, reports, "ranks that cannot be adopted")
        return Adoption(from_generation=previous, refused=why)
    by_rank = sorted(((r.rank, h, r) for h, r in zip(handles, reports) if r is not None), key=lambda t: t[0])
    token = write_probe(storage) if storage is not None else None
    env = {GENERATION_ENV: str(generation), **({PROBE_ENV: token} if token else {})}
    try:
        ray.get([h.serve.remote(generation, env) for _, h, _ in by_rank], timeout=ANSWER_S)
    except Exception as exc:
        _end(handles, reports, "ranks that did not take the new generation")
        return Adoption(
            from_generation=previous, refused=f"a rank did not take the new generation: {short(exc)}"
        )
    group_cfg = cfg
    group = RayWorkerGroup(group_cfg, run_url, 0, task_cls, detached=True)
    actors = [Stamped(h, generation) for _, h, _ in by_rank]
    nodes = ray.get([a.node.remote() for a in actors], timeout=ANSWER_S)
    infos = adopted_infos([r for _, _, r in by_rank])
    slots = {r.rank: r.slot for _, _, r in by_rank if r.slot is not None}
    spare = next((r.rank for _, h, r in by_rank if id(h) in spares), None)
    if spare is not None:
        bundles = {pg: len(pg.bundle_specs) for pg, _ in slots.values()}
        slots = spare_slots(slots, spare, bundles)
    pgs = list({pg.id: pg for pg, _ in slots.values()}.values())
    head = by_rank[0][2]
    assert head.dispatched is not None  # refusal() checked it
    epoch, start, dispatch = head.dispatched
    step = infos[0].resume.global_step
    group.take_over(actors, nodes, infos, Resources(None, slots, pgs), dispatch)
    return Adoption(
        from_generation=previous,
        group=group,
        infos=infos,
        epoch=epoch,
        start_step=start,
        step=step,
        probe_token=token,
    )


def _find(key: str) -> tuple[dict[int, list[Any]], set[int]]:
    """Run ``key``'s detached actors by lease generation, and the id() of those named as hot spares."""
    found: dict[int, list[Any]] = {}
    spares: set[int] = set()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parsed = parse_name(entry["name"]) if entry.get("namespace") == NAMESPACE else None
        if parsed is None or parsed[0] != key:
            continue
        try:
            handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
        except ValueError:  # gone since the listing
            continue
        found.setdefault(parsed[1], []).append(handle)
        if entry["name"].endswith(f":{SPARE_ROLE}"):
            spares.add(id(handle))
    return found, spares


def _reports(handles: list[Any]) -> list[RankReport | None]:
    refs = [h.report.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ANSWER_S)
    out: list[RankReport | None] = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0) if ref in ready else None)
        except Exception as exc:
            logger.warning("a rank left by the previous driver did not report: %s", short(exc))
            out.append(None)
    return out


def _end(handles: list[Any], reports: list[RankReport | None], what: str) -> None:
    """Kill ``handles`` and free the placement groups their reports name."""
    pgs = {r.slot[0].id: r.slot[0] for r in reports if r is not None and r.slot is not None}
    for h in handles:
        kill(h, what)
    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception as exc:  # removed already, by an orphan's own timeout
            logger.info("removing a placement group of %s: %s", what, short(exc))
