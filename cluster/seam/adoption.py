"""Adopting the ranks a previous driver left running (docs/failures.md, "driver dies"): what each rank
reports of itself, the rule that decides whether they can be adopted, and what the driver is handed.

The rule (:func:`refusal`) is plain data in, a reason out: the Ray side (``cluster.worker_group.adoption``)
asks the ranks, the driver (``cluster.driver.driver``) records the outcome."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from cluster.seam.protocol import ResumePoint, SetupInfo, WorkerGroup
from cluster.spec.schedule import Window, merge_windows


@dataclass(frozen=True)
class RankReport:
    """What one rank a driver left behind says of itself (``_WorkerActor.report``)."""

    run: str
    """The run it trains (``cluster.worker_group.pulse.run_key``)."""
    generation: int
    """The lease generation it serves."""
    world_size: int
    rank: int
    global_step: int
    epoch: int
    in_epoch: bool
    """Still training the epoch it was given."""
    dispatched: tuple[int, int, int] | None
    """(epoch, start step, dispatch number) of the last epoch it was given; None: none yet."""
    failed: str | None
    """That epoch's error, when it raised."""
    digest: str | None
    """Its parameters' digest (``cluster.rank.replica``) when idle, else None."""
    pid: int
    info: SetupInfo | None
    """Its setup's report (None: never set up)."""
    slot: tuple[Any, int] | None = None
    """(placement group, bundle index) it runs in."""
    skipped_steps: tuple[Window, ...] = ()
    """Every window of steps it skips (the driver's, a checkpoint's and its own NaN rollbacks'): the next
    driver takes them over, else a later recovery would drop them."""


def unused(reports: list[RankReport | None], spares: Collection[int] = ()) -> list[int]:
    """The indices of ``reports`` that are processes the previous driver had prepared and not begun: the
    replacements of a drain notice's move still in progress when it died, an idle hot spare (it reports its
    placeholder rank 0). Each was never set up nor given an epoch, and its rank number is held by a rank of
    the group that was, or it is one of ``spares`` (the indices of the processes named as hot spares). They
    are no part of the group: the next driver ends them (and makes its own spare and move, seeing the same
    drain notice). A process named as a hot spare that did not answer (still starting on a loaded machine)
    is ended too: were it a rank by now, the group then lacks that rank and ``refusal`` says so."""
    held = {r.rank for r in reports if r is not None and r.info is not None}
    return [
        i
        for i, r in enumerate(reports)
        if (r is None and i in spares)
        or (r is not None and r.info is None and r.dispatched is None and (r.rank in held or i in spares))
    ]


def spare_slots(
    slots: dict[int, tuple[Any, int]], spare_rank: int | None, bundles: dict[Any, int]
) -> dict[int, tuple[Any, int]]:
    """The ranks' slots as the previous driver kept them: a hot spare that became rank ``spare_rank`` runs in
    the bundle it was started in (a live rank's, with no CPU of its own), while its driver counted it in the
    dead rank's bundle; that is the one bundle of its placement group (``bundles``: placement group -> its
    number of bundles) no other rank holds. Without a spare, or with no such single bundle, ``slots`` as
    they are."""
    if spare_rank is None or spare_rank not in slots:
        return slots
    pg, index = slots[spare_rank]
    others = {i for r, (p, i) in slots.items() if r != spare_rank and p == pg}
    if index not in others:
        return slots
    free = [i for i in range(bundles.get(pg, 0)) if i not in others]
    if len(free) != 1:
        return slots
    return {**slots, spare_rank: (pg, free[0])}


def refusal(reports: list[RankReport | None], run: str, generation: int) -> str | None:
    """Why the ranks of ``generation`` cannot be adopted (None: they can). Every rank must answer, serve
    that generation of this run, be set up, agree on the world size (each rank once), have been given the
    same epoch, have trained it without an error, and, once idle, stand at the same step with the same
    parameters."""
    if not reports:
        return "no rank answered"
    missing = sum(1 for r in reports if r is None)
    if missing:
        return f"{missing} of {len(reports)} ranks did not answer (gone or stuck)"
    live = [r for r in reports if r is not None]
    for r in live:
        if r.run != run or r.generation != generation:
            return (
                f"rank {r.rank} serves run {r.run} generation {r.generation}, not {run} generation "
                f"{generation}"
            )
        if r.info is None:
            return f"rank {r.rank} was never set up"
    sizes = {r.world_size for r in live}
    if len(sizes) != 1:
        return f"the ranks disagree on the world size: {sorted(sizes)}"
    size = sizes.pop()
    ranks = sorted(r.rank for r in live)
    if ranks != list(range(size)):
        return f"ranks {ranks} answered, not each of 0..{size - 1} once"
    given = {r.dispatched for r in live}
    if len(given) != 1 or None in given:
        return "the ranks were not all given the same epoch"
    failed = [r for r in live if r.failed is not None]
    if failed:
        return f"rank {failed[0].rank}'s epoch failed: {failed[0].failed}"
    if any(r.in_epoch for r in live):
        return None  # still training it together: the steps and parameters agree once it ends
    steps = {r.global_step for r in live}
    if len(steps) != 1:
        return f"the ranks stand at different steps: {sorted(steps)}"
    digests = {r.digest for r in live}
    if len(digests) != 1 or None in digests:
        return "the replicas' parameters disagree"
    return _skips_disagree(live)


def _skips_disagree(live: list[RankReport]) -> str | None:
    skips = {tuple(map(tuple, r.skipped_steps)) for r in live}
    if len(skips) != 1:
        return f"the ranks disagree on the steps they skip: {sorted(skips)}"
    return None


def adopted_infos(reports: list[RankReport]) -> list[SetupInfo]:
    """The adopted ranks' setup reports (``reports`` by rank, each set up, :func:`refusal` passed), each
    saying where the group is now, not where it began: the furthest step reached, in the epoch given, and
    every step window the ranks skip (the next driver's own list starts from them)."""
    infos = [r.info for r in reports if r.info is not None]
    head = reports[0]
    assert head.dispatched is not None  # refusal() checked it
    epoch = head.dispatched[0]
    step = max(r.global_step for r in reports)
    spe = infos[0].steps_per_epoch
    skips = merge_windows([(a, b) for r in reports for a, b in r.skipped_steps])
    here = ResumePoint(
        step, epoch, max(0, step - epoch * spe), None, len(infos), "adopted", skipped_steps=skips
    )
    return [dataclasses.replace(i, resume=here) for i in infos]


@dataclass
class Adoption:
    """The outcome of looking for a previous driver's ranks: a group already training (``group``), or why
    they were not adopted (``refused``; they were stopped, the run resumes from storage)."""

    from_generation: int
    group: WorkerGroup | None = None
    infos: list[SetupInfo] = field(default_factory=list)
    epoch: int = 0
    """The epoch the ranks were given; the group's ``poll`` returns its result."""
    start_step: int = 0
    step: int = 0
    """The furthest step the ranks reached when adopted."""
    probe_token: str | None = None
    """The storage probe the adopted ranks were told (``cluster.run.storage.write_probe``)."""
    refused: str | None = None
