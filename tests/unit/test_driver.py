"""The driver's state machine and failure policy through one seam: a scripted worker group, no workers."""

from __future__ import annotations

import io
import uuid
from typing import Any

import pytest

from cluster.config import FailureConfig, JobConfig, load_config
from cluster.driver import Driver, FailurePolicy, State
from cluster.errors import Failure, ResourcesUnavailableError, TrainingFailedError, WorkerError
from cluster.worker import EpochResult, Progress, ResumePoint, SetupInfo

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

STEPS = 4


class ScriptedGroup:
    """Plays back a script: per attempt, a list of outcomes for successive polls ('ok', a Failure, 'hang'
    for ever, 'busy' once)."""

    instances: list[ScriptedGroup] = []
    niceness = "0"  # what every rank reports from scaling.worker_niceness

    def __init__(self, cfg: JobConfig, run_url: str, attempt: int, script: dict[int, list[Any]],
                 capacity: list[int], resume: dict[int, int]) -> None:
        self.cfg, self.attempt, self.script = cfg, attempt, script.get(attempt, [])
        self.capacity, self.resume = capacity, resume
        self.world_size = 0
        self.spare_note = "off"
        self.calls: list[str] = []
        self.polls: list[float] = []
        self.epoch = self.start_step = 0
        self.shut: bool | None = None
        ScriptedGroup.instances.append(self)

    def reserve(self, sizes: list[int], wait_s: float) -> int:
        for n in sizes:
            if n <= self.capacity[0]:
                return n
        raise ResourcesUnavailableError(f"no room for {sizes[-1]} workers")

    def start(self, world_size: int) -> list[SetupInfo]:
        self.world_size = world_size
        step = self.resume.get(self.attempt, 0)
        rp = ResumePoint(step, step // STEPS, step % STEPS, None)
        return [SetupInfo(r, world_size, "h", 1, "gloo", STEPS, rp, [], {"start": 0.0, "process_group": 0.0, "task": 0.0, "ddp": 0.0, "checkpoint_load": 0.0, "ready": 0.0},
                          niceness=self.niceness)
                for r in range(world_size)]

    def run_epoch(self, epoch: int, start_step: int) -> None:
        self.calls.append(f"epoch{epoch}@{start_step}")
        self.epoch, self.start_step = epoch, start_step

    def poll(self, timeout: float) -> list[EpochResult] | None:
        self.polls.append(timeout)
        outcome = self.script.pop(0) if self.script else "ok"
        if isinstance(outcome, Failure):
            raise RuntimeError(outcome.message)
        if outcome == "hang":
            self.script.insert(0, "hang")
            return None
        if outcome == "busy":  # one poll that finds the epoch still running
            return None
        steps = STEPS - self.start_step
        gs = (self.epoch + 1) * STEPS
        return [EpochResult(r, self.epoch, gs, steps, steps * 8, 1.0 / (self.epoch + 1), 0.01, 1.0)
                for r in range(self.world_size)]

    def progress(self, timeout: float = 2.0) -> list[Any]:
        return [Progress(r, self.epoch * STEPS + 1, 0.0, 0.01, True) for r in range(self.world_size)]

    def finish(self) -> list[Any]:
        self.calls.append("finish")
        return []

    def spare_ready(self) -> float | None:
        return None

    def classify(self, exc: BaseException) -> Failure:
        kind, _, rest = str(exc).partition(":")
        err = WorkerError(1, 3, "RuntimeError", rest, "Traceback: boom") if kind == "user_error" else None
        return Failure(kind, 1, str(exc), err)

    def available_for(self, n: int) -> bool:
        return self.world_size + n <= self.capacity[0]

    def salvage(self, failure: Failure, attempt: int) -> Any:
        return None

    def adopt(self, token: Any) -> None:
        raise AssertionError("nothing was salvaged")

    def shutdown(self, graceful: bool) -> None:
        self.shut = graceful


def make(script: dict[int, list[Any]], overrides: list[str] = (), capacity: int = 2,
         resume: dict[int, int] | None = None) -> tuple[Driver, list[int]]:
    ScriptedGroup.instances = []
    cap = [capacity]
    cfg = load_config(data={"storage": {"url": f"memory://drv-{uuid.uuid4().hex}"}},
                      overrides=["training.epochs=3", "failures.backoff_s=0", *overrides])
    driver = Driver(cfg, group_factory=lambda c, u, a: ScriptedGroup(c, u, a, script, cap, resume or {}),
                    out=io.StringIO(), poll_s=0.0)
    return driver, cap


def kinds(driver: Driver) -> list[str]:
    return [e["event"] for e in driver.events.records()]


def test_clean_run_walks_the_states_and_finishes() -> None:
    driver, _ = make({})
    assert driver.state is State.STARTING
    driver._prepare_storage()
    driver._step()
    assert driver.state is State.RUNNING
    driver, _ = make({})
    result = driver.run()
    assert result.status == "finished" and result.global_step == 3 * STEPS and result.attempts == 1
    assert ScriptedGroup.instances[0].calls == ["epoch0@0", "epoch1@0", "epoch2@0", "finish"]
    assert ScriptedGroup.instances[0].shut is True  # graceful at the end
    assert kinds(driver).count("epoch_end") == 3 and "finished" in kinds(driver)


def test_failure_kills_restarts_and_resumes_from_checkpoint() -> None:
    driver, _ = make({0: ["ok", Failure("worker_died", 1, "worker_died:rank 1 died")]}, resume={1: 6})
    result = driver.run()
    assert result.status == "finished" and result.attempts == 2
    first, second = ScriptedGroup.instances
    assert first.shut is False  # killed at once, not gracefully
    assert second.calls[0] == "epoch1@2"  # resumed mid-epoch from the checkpoint at step 6
    ev = driver.events.records()
    fail = next(e for e in ev if e["event"] == "failure")
    assert fail["kind"] == "worker_died"
    assert next(e for e in ev if e["event"] == "decision")["restart"] is True
    assert any(e["event"] == "recovered" for e in ev)


def test_same_user_error_at_same_step_twice_fails_fast() -> None:
    err = Failure("user_error", 1, "user_error:boom")
    driver, _ = make({0: [err], 1: [err], 2: [err]}, ["failures.max_failures=10"])
    with pytest.raises(TrainingFailedError, match="happened twice at step 3"):
        driver.run()
    assert driver.state is State.FAILED
    assert len(ScriptedGroup.instances) == 2


def test_budget_exhausted_and_unlimited() -> None:
    crash = Failure("worker_died", 0, "worker_died:x")
    driver, _ = make({0: [crash], 1: [crash]}, ["failures.max_failures=1"])
    with pytest.raises(TrainingFailedError, match="max_failures=1 exhausted"):
        driver.run()
    driver, _ = make({a: [crash] for a in range(6)}, ["failures.max_failures=-1"])
    assert driver.run().attempts == 7


def test_hang_detected_by_heartbeat() -> None:
    driver, _ = make({0: ["hang"]}, ["failures.hang_timeout_s=0.2"])
    result = driver.run()
    assert result.failures[0]["kind"] == "hang"
    assert "no progress" in result.failures[0]["message"]


def test_shrinks_to_min_workers_then_grows_back_at_epoch_boundary() -> None:
    driver, cap = make({0: [Failure("node_lost", 1, "node_lost:gone")]}, ["scaling.min_workers=1"], resume={1: 0})
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        if attempt == 1:
            cap[0] = 1  # the lost node did not come back
        if attempt == 2:
            cap[0] = 2
        group = original_factory(cfg, url, attempt)
        if attempt == 1:
            group.available_for = lambda n: True  # type: ignore[method-assign]  # resources return
        return group

    driver.group_factory = factory
    result = driver.run()
    assert result.status == "finished"
    sizes = [g.world_size for g in ScriptedGroup.instances]
    assert sizes == [2, 1, 2]
    resizes = [e for e in driver.events.records() if e["event"] == "resize"]
    assert [(e["old"], e["new"]) for e in resizes] == [(2, 1), (1, 2)]
    assert all(e["reason"] for e in resizes)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("overrides", "terminal", "expected"),
    [
        ([], False, 3.0),  # a twentieth of the default 60 s hang timeout: fewer calls into training workers
        (["failures.hang_timeout_s=600"], False, 5.0),  # capped at 5 * poll_s
        (["failures.hang_timeout_s=4"], False, 1.0),  # never below poll_s
        ([], True, 1.0),  # a terminal's live bar refreshes every poll_s
    ],
)
def test_heartbeat_interval(overrides: list[str], terminal: bool, expected: float) -> None:
    driver, _ = make({0: ["busy", "busy", "busy"]}, overrides)
    driver.poll_s = 1.0
    if terminal:
        driver.out = _Terminal()
    assert driver.run().status == "finished"
    assert ScriptedGroup.instances[0].polls[:4] == [expected] * 4


def test_resources_never_appear_is_a_clear_error() -> None:
    driver, _ = make({}, capacity=0)
    with pytest.raises(ResourcesUnavailableError, match="no room"):
        driver.run()
    assert "failed" in kinds(driver)


def test_policy_backoff_doubles_and_is_capped() -> None:
    policy = FailurePolicy(FailureConfig(max_failures=-1, backoff_s=1.0, backoff_max_s=5.0))
    hist: list[Failure] = []
    delays = []
    for _ in range(5):
        hist.append(Failure("worker_died", 0, "x"))
        delays.append(policy.decide(hist[-1], hist).delay_s)
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0]
    # progress in between (an epoch completed) makes the next restart immediate again
    assert policy.decide(hist[-1], hist, streak=1).delay_s == 0.0


def test_spare_ready_is_reported_once_per_group() -> None:
    driver, _ = make({0: ["busy", "busy", "busy"]})
    answers = iter([None, 1.25])
    original_factory = driver.group_factory

    def factory(cfg: JobConfig, url: str, attempt: int) -> Any:
        group = original_factory(cfg, url, attempt)
        group.spare_ready = lambda: next(answers, 9.0)  # type: ignore[method-assign]
        return group

    driver.group_factory = factory
    assert driver.run().status == "finished"
    ready = [e for e in driver.events.records() if e["event"] == "spare_ready"]
    # not while preparing, then once with its time; never again for the same group
    assert [(e["attempt"], e["prepare_s"]) for e in ready] == [(0, 1.25)]


def test_workers_left_at_rays_niceness_are_warned_about_once(monkeypatch: pytest.MonkeyPatch) -> None:
    note = "15 (not permitted to set scaling.worker_niceness=0: start Ray with RAY_worker_niceness=0, or give the workers CAP_SYS_NICE)"
    monkeypatch.setattr(ScriptedGroup, "niceness", note)
    driver, _ = make({})
    assert driver.run().status == "finished"
    out = driver.out.getvalue()  # type: ignore[attr-defined]
    assert out.count("warning: workers run at niceness 15") == 1  # one line for the group, not one per rank
    assert "RAY_worker_niceness=0" in out
    started = [e for e in driver.events.records() if e["event"] == "group_started"]
    assert started[0]["niceness"] == [note]


def test_no_niceness_warning_at_normal_priority() -> None:
    driver, _ = make({})
    assert driver.run().status == "finished"
    assert "niceness" not in driver.out.getvalue()  # type: ignore[attr-defined]
