"""The rules behind ranks that outlive their driver, without Ray: a rank's watch of its driver (the
generation it serves, commits only for a live driver, the orphan timeout) and whether found ranks can be
adopted (docs/failures.md, "driver dies")."""

from __future__ import annotations

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest
import ray

from cluster.core.errors import ConfigError, Failure
from cluster.rank.watchdog import DriverWatch, OrphanedError, StaleDriverError, pulse_every
from cluster.seam.adoption import Adoption, RankReport, adopted_infos, refusal, spare_slots, unused
from cluster.seam.protocol import ResumePoint, SetupInfo
from cluster.spec.load import from_dict
from cluster.worker_group.orphan import report
from cluster.worker_group.pulse import Lineage, stale_placement_groups
from tests.support.fakes import ScriptedGroup, make

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_rank_obeys_only_the_generation_it_serves_and_moves_only_forward() -> None:
    clock, fired = Clock(), []
    watch = DriverWatch(3, 30.0, fired.append, clock)
    watch.contact(3)
    with pytest.raises(StaleDriverError, match="did not adopt it"):
        watch.contact(4)  # a newer driver must adopt the rank first
    watch.serve(4)
    with pytest.raises(StaleDriverError, match="taken over"):
        watch.contact(3)  # the old driver, woken up: refused
    with pytest.raises(StaleDriverError):
        watch.serve(3)
    err = pickle.loads(pickle.dumps(StaleDriverError(3, 4)))  # crosses Ray as it is
    assert (err.called, err.served) == (3, 4)


def test_commits_need_a_driver_heard_within_three_pulses() -> None:
    clock = Clock()
    watch = DriverWatch(1, 30.0, lambda s: None, clock)
    assert pulse_every(30.0) == 5.0 and pulse_every(600.0) == 5.0
    clock.t += 15.0
    watch.check_live()
    clock.t += 0.5
    with pytest.raises(OrphanedError, match="no live driver"):
        watch.check_live()
    watch.contact(1)
    watch.check_live()
    assert "no live driver" in str(pickle.loads(pickle.dumps(OrphanedError(16, 1))))


def test_the_orphan_timeout_fires_once_and_a_refused_call_does_not_hold_it_off() -> None:
    clock, fired = Clock(), []
    watch = DriverWatch(2, 30.0, fired.append, clock)
    clock.t += 29.0
    with pytest.raises(StaleDriverError):
        watch.contact(1)  # an old driver's pulse is no contact
    assert not watch.poll()
    clock.t += 2.0
    assert watch.poll() and fired == [31.0]
    clock.t += 10.0
    assert not watch.poll() and len(fired) == 1


def _report(rank: int, **kw: object) -> RankReport:
    info = SetupInfo(rank, 2, "h", 100 + rank, "gloo", 10, ResumePoint(0, 0, 0, None), [], {})
    base = RankReport(
        run="k",
        generation=1,
        world_size=2,
        rank=rank,
        global_step=30,
        epoch=1,
        in_epoch=False,
        dispatched=(1, 0, 2),
        failed=None,
        digest="d",
        pid=100 + rank,
        info=info,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_found_ranks_are_adopted_only_when_all_answer_and_agree() -> None:
    ok = [_report(0), _report(1)]
    assert refusal(ok, "k", 1) is None
    assert refusal([_report(0, in_epoch=True, global_step=12), _report(1, in_epoch=True)], "k", 1) is None
    assert "did not answer" in str(refusal([_report(0), None], "k", 1))
    assert "world size" in str(refusal([_report(0), _report(1, world_size=3)], "k", 1))
    assert "each of 0..1" in str(refusal([_report(0), _report(0)], "k", 1))
    assert "different steps" in str(refusal([_report(0), _report(1, global_step=29)], "k", 1))
    assert "disagree" in str(refusal([_report(0), _report(1, digest="e")], "k", 1))
    assert "same epoch" in str(refusal([_report(0), _report(1, dispatched=(1, 0, 3))], "k", 1))
    assert "failed" in str(refusal([_report(0), _report(1, failed="RuntimeError: x")], "k", 1))
    assert "never set up" in str(refusal([_report(0), _report(1, info=None)], "k", 1))
    assert "generation" in str(refusal(ok, "k", 2))


def test_orphan_timeout_is_validated_with_the_fix_named() -> None:
    with pytest.raises(ConfigError, match=r"failures.orphan_timeout_s=5 is too short.*at least 10"):
        from_dict({"task": "jobs.tasks.charlm:CharLMTask", "failures": {"orphan_timeout_s": 5}})


def test_the_next_driver_frees_only_older_generations_placement_groups_nobody_holds() -> None:
    """Placement groups whose ranks all died (killed before their orphan timeout) have no rank left to free
    them: the next driver removes those of this run's older generations that it did not adopt."""
    mine, other = Lineage("k", 1), Lineage("j", 1)
    table = {
        "a": {"name": mine.pg_name(0, 0), "state": "CREATED"},  # generation 1, ranks gone: freed
        "b": {"name": Lineage("k", 2).pg_name(1, 1), "state": "CREATED"},  # generation 2, adopted: kept
        "c": {"name": Lineage("k", 2).pg_name(1, 2), "state": "PENDING"},  # generation 2, a move's: freed
        "d": {"name": mine.pg_name(0, 1), "state": "REMOVED"},  # removed already
        "e": {"name": Lineage("k", 3).pg_name(0, 0), "state": "CREATED"},  # this driver's own
        "f": {"name": Lineage("k", 4).pg_name(0, 0), "state": "CREATED"},  # a newer driver's: never
        "g": {"name": other.pg_name(0, 0), "state": "CREATED"},  # another run's
        "h": {"name": "", "state": "CREATED"},  # not the product's
        "i": {"name": "cluster:tiny:rank0:attempt0", "state": "CREATED"},
    }
    assert stale_placement_groups(table, "k", 3, keep=["b"]) == ["a", "c"]
    assert stale_placement_groups(table, "k", 3) == ["a", "b", "c"]
    assert stale_placement_groups(table, "k", 1) == []


def test_a_move_s_unbegun_replacements_are_set_aside_and_the_group_is_still_adopted() -> None:
    """A drain notice's move in progress when the driver died: its replacements (never set up, never
    given an epoch) stand beside the ranks they were to replace; they are no part of the group."""
    group = [_report(0), _report(1)]
    moving = [_report(1, info=None, dispatched=None), _report(0, info=None, dispatched=None)]
    reports = [group[0], moving[0], group[1], moving[1]]
    assert "never set up" in str(refusal(reports, "k", 1))  # as the rule alone sees them
    extra = unused(reports)
    assert extra == [1, 3]
    assert refusal([r for i, r in enumerate(reports) if i not in extra], "k", 1) is None
    # a rank whose only process was never set up is no replacement: the group is refused
    lone = [_report(0), _report(1, info=None, dispatched=None)]
    assert unused(lone) == [] and "never set up" in str(refusal(lone, "k", 1))


def test_a_hot_spare_that_became_a_rank_is_counted_in_the_dead_rank_s_bundle() -> None:
    """The spare runs in a live rank's bundle (no CPU of its own); its driver counted it in the bundle of
    the rank it replaced: the adopted group's slots say the same, so no bundle is held twice."""
    slots = {0: ("pg", 0), 1: ("pg", 1), 2: ("pg", 1), 3: ("pg", 3)}  # the spare (now rank 2) runs in 1
    assert spare_slots(slots, 2, {"pg": 4}) == {0: ("pg", 0), 1: ("pg", 1), 2: ("pg", 2), 3: ("pg", 3)}
    assert spare_slots(slots, None, {"pg": 4}) == slots  # no spare among them: as they are
    whole = {0: ("pg", 0), 1: ("pg", 1)}
    assert spare_slots(whole, 1, {"pg": 2}) == whole  # its own bundle already: as it is
    # an unpromoted spare (rank 0's placeholder, never set up) beside the group is set aside
    idle_spare = _report(0, info=None, dispatched=None)
    assert unused([_report(0), _report(1), idle_spare]) == [2]
    # the ranks all died and only the idle spare is left: it is set aside too (nothing to adopt, no refusal)
    assert unused([idle_spare], spares=[0]) == [0]
    assert unused([idle_spare]) == []  # the same report not named as a spare: a rank never set up
    # a spare that did not answer (still starting, on a loaded machine) is set aside; the ranks are adopted
    assert unused([_report(0), _report(1), None], spares=[2]) == [2]
    assert refusal([_report(0), _report(1)], "k", 1) is None
    # had it become rank 1, the group lacks rank 1 once it is set aside: refused, as any missing rank
    assert unused([_report(0), None], spares=[1]) == [1]
    assert "not each of 0..1 once" in str(refusal([_report(0)], "k", 1))
    assert unused([_report(0), None]) == []  # a rank that did not answer, not a spare: refused, not dropped


def test_the_steps_the_adopted_ranks_skip_are_the_next_driver_s_and_must_agree() -> None:
    """A NaN rollback's skip window lives in the ranks (and in the driver that saw it): the driver that adopts
    them takes the windows over. Without them its next recovery's set-up would drop the window on every
    rank: their state would no longer match what they reported (the peer copy refused, the run back to its
    checkpoint: chaos 2026-12-07, 220 steps), and a later restore would train the skipped batches."""
    skipped = ((12, 14), (20, 20))
    reports = [_report(0, skipped_steps=skipped, global_step=31), _report(1, skipped_steps=skipped)]
    assert refusal(reports, "k", 1) is not None  # different steps; once idle they stand together:
    reports = [_report(0, skipped_steps=skipped), _report(1, skipped_steps=skipped)]
    assert refusal(reports, "k", 1) is None
    infos = adopted_infos(reports)
    assert [i.rank for i in infos] == [0, 1] and [i.pid for i in infos] == [100, 101]
    here = infos[0].resume
    assert (here.global_step, here.epoch, here.step_in_epoch, here.source) == (30, 1, 20, "adopted")
    assert here.skipped_steps == [(12, 14), (20, 20)]
    assert all(i.resume == here for i in infos)
    odd = [_report(0, skipped_steps=skipped), _report(1, skipped_steps=skipped[:1])]
    assert "skip" in str(refusal(odd, "k", 1))


def test_a_rank_reports_every_window_it_skips() -> None:
    """What the next driver reads (``orphan.report``): the rank's own windows, a NaN rollback's included."""
    worker = SimpleNamespace(
        session=None, world_size=2, rank=1, pos=SimpleNamespace(skips=[(5, 6)], global_step=9, epoch=0)
    )
    epochs = SimpleNamespace(in_epoch=False, dispatched=(0, 0, 1), error=None)
    got = report(worker, Lineage("k", 3), 3, epochs)  # type: ignore[arg-type]
    assert got.skipped_steps == ((5, 6),) and got.global_step == 9 and got.generation == 3
    assert not ray.is_initialized()  # the report started no Ray in this process


def test_a_driver_that_adopted_ranks_hands_their_skip_windows_to_its_next_group() -> None:
    died = Failure("worker_died", 1, "worker_died: rank 1's process died")
    driver, _ = make({})
    adopted = ScriptedGroup(driver.cfg, driver.run_url, 0, {0: [died]}, [2], {})
    here = ResumePoint(5, 1, 1, None, 2, "adopted", skipped_steps=[(2, 3)])
    infos = [replace(i, resume=here) for i in adopted.start(2)]
    adopted.run_epoch(1, 1)
    driver.adoption = Adoption(from_generation=1, group=adopted, infos=infos, epoch=1, start_step=1, step=5)
    result = driver.run()
    assert result.status == "finished" and ScriptedGroup.instances[-1] is not adopted
    assert ScriptedGroup.instances[-1].skips == [(2, 3)]  # the recovery's group skips what the ranks skipped
    assert result.skipped_steps == [(2, 3)]
