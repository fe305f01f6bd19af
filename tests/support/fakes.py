"""Stand-ins for what surrounds the driver, for tests that run it without workers: a scripted worker group
(the seam ``cluster/seam/protocol.py`` describes), ``make`` to build a driver on it, and a webhook on
loopback."""

from __future__ import annotations

import dataclasses
import http.server
import io
import json
import threading
import time
import uuid
from collections.abc import Collection
from typing import Any

import pytest

from cluster.core.errors import Failure, ResourcesUnavailableError, WorkerError
from cluster.driver.driver import Driver
from cluster.run.checkpoint import CommitRecord
from cluster.seam.peers import PeerPlan, PeerState
from cluster.seam.preemption import DrainNotice
from cluster.seam.protocol import EpochResult, Heartbeat, ResumePoint, Salvage, SetupInfo, StartCancelled
from cluster.spec.config import JobConfig
from cluster.spec.load import load_config

STEPS = 4


class ScriptedGroup:
    """Plays back a script: per attempt, a list of outcomes for successive polls ('ok', a Failure, 'hang'
    for ever, 'busy' once)."""

    instances: list[ScriptedGroup] = []
    niceness = "0"  # what every rank reports from scaling.worker_niceness
    survivors: dict[int, PeerState] | None = None  # what salvage keeps (None: nothing)
    rows: list[dict[str, Any]] = []  # rank 0's step rows salvage hands over
    drains: list[DrainNotice] = []  # what draining() reports (preemption)
    move_script: list[str] = []  # successive move_status() answers; the last one repeats
    max_wait_s = 0.5  # the longest reserve() waits for room that is not there

    def __init__(
        self,
        cfg: JobConfig,
        run_url: str,
        attempt: int,
        script: dict[int, list[Any]],
        capacity: list[int],
        resume: dict[int, int],
    ) -> None:
        self.cfg, self.attempt, self.script = cfg, attempt, script.get(attempt, [])
        self.capacity, self.resume = capacity, resume
        self.world_size = 0
        self.spare_note = "off"
        self.calls: list[str] = []
        self.polls: list[float] = []
        self.epoch = self.start_step = 0
        self.shut: bool | None = None
        ScriptedGroup.instances.append(self)

    def reserve(self, sizes: list[int], wait_s: float, cancelled: Any = None) -> int:
        adopted = getattr(self, "adopted", None)
        if adopted is not None and isinstance(adopted.resources, tuple):  # a salvage after a stop's resources
            return int(adopted.resources[1])
        for n in sizes:
            if n <= self.capacity[0]:
                return n
        deadline = time.monotonic() + min(wait_s, self.max_wait_s)  # no room: wait, asking to give up, as Ray
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise StartCancelled("asked to stop while waiting for resources")
            time.sleep(0.01)
        raise ResourcesUnavailableError(f"no room for {sizes[-1]} workers")

    def start(
        self,
        world_size: int,
        peers: PeerPlan | None = None,
        skips: list[tuple[int, int]] | None = None,
        rollback: tuple[int, int] | None = None,
    ) -> list[SetupInfo]:
        self.world_size = world_size
        self.peers = peers
        self.skips, self.rollback = skips, rollback
        step = self.resume.get(self.attempt, 0)
        rp = ResumePoint(step, step // STEPS, step % STEPS, None)
        if peers is not None:
            rp = ResumePoint(peers.global_step, peers.epoch, peers.step_in_epoch, None, source="peers")
        return [
            SetupInfo(
                r,
                world_size,
                "h",
                1,
                "gloo",
                STEPS,
                rp,
                [],
                {
                    "start": 0.0,
                    "process_group": 0.0,
                    "task": 0.0,
                    "ddp": 0.0,
                    "checkpoint_load": 0.0,
                    "ready": 0.0,
                },
                niceness=self.niceness,
            )
            for r in range(world_size)
        ]

    def run_epoch(self, epoch: int, start_step: int, evaluate_first: bool = False, seq: int = 0) -> None:
        self.calls.append(f"epoch{epoch}@{start_step}")
        if evaluate_first:
            self.evaluate_first = [*getattr(self, "evaluate_first", []), epoch * STEPS + start_step]
        self.epoch, self.start_step = epoch, start_step
        self.stop_step: int | None = None

    def stop(self, checkpoint: bool) -> int:
        self.calls.append(f"stop(checkpoint={checkpoint})")
        self.stop_step = self.epoch * STEPS + self.start_step + 1  # one step into the epoch
        return self.stop_step

    def draining(self) -> list[DrainNotice]:
        self.drain_reads = getattr(self, "drain_reads", 0) + 1
        return list(ScriptedGroup.drains)

    def prepare_move(self, ranks: list[int], avoid: list[str] | None = None) -> None:
        self.calls.append(f"prepare_move{ranks}" + (f" avoid={avoid}" if avoid else ""))

    def move_status(self) -> str:
        script = ScriptedGroup.move_script
        return script.pop(0) if len(script) > 1 else script[0]

    def move_nodes(self) -> list[str]:
        return ["n-new"]

    def cancel_move(self) -> None:
        self.calls.append("cancel_move")

    def salvage(
        self,
        failure: Failure | None,
        attempt: int,
        *,
        leaving: Collection[int] = (),
        keep_state: bool | None = None,
    ) -> Salvage | None:
        if failure is not None:
            return self._salvage_after(failure)
        retire = list(leaving)
        self.calls.append(f"salvage leaving {retire} keep_state={keep_state}")
        step = self.stop_step or 0
        keep = self.world_size if ScriptedGroup.move_script[-1] == "ready" else self.world_size - len(retire)
        peers = {
            r: PeerState(r, step, step // STEPS, step % STEPS, "d", 10, "") for r in range(keep) if keep_state
        }
        return Salvage(
            resources=("slots", keep), actors=dict.fromkeys(range(keep), "actor"), peers=peers or None
        )

    def poll(self, timeout: float) -> list[EpochResult] | None:
        self.polls.append(timeout)
        outcome = self.script.pop(0) if self.script else "ok"
        if isinstance(outcome, Failure):
            raise RuntimeError(outcome.message)
        if outcome == "hang":
            self.script.insert(0, "hang")
            return None
        if outcome == "busy":  # one poll that finds the epoch still running (waits a little, as ray.wait)
            time.sleep(min(timeout, 0.01))
            return None
        if getattr(self, "stop_step", None) is not None:  # stopped one step into the epoch
            return [
                EpochResult(r, self.epoch, self.stop_step, 1, 8, 1.0, 0.01, 1.0, stopped=True)  # type: ignore[arg-type]
                for r in range(self.world_size)
            ]
        steps = STEPS - self.start_step
        gs = (self.epoch + 1) * STEPS
        return [
            EpochResult(r, self.epoch, gs, steps, steps * 8, 1.0 / (self.epoch + 1), 0.01, 1.0)
            for r in range(self.world_size)
        ]

    def heartbeats(self, timeout: float = 2.0) -> list[Heartbeat | None]:
        return [Heartbeat(r, self.epoch * STEPS + 1, 0.0, 0.01, True) for r in range(self.world_size)]

    def finish(self) -> list[CommitRecord]:
        self.calls.append("finish")
        return []

    def profile(self, req_id: str, steps: int, ranks: list[int], folder: str) -> None:
        self.calls.append(f"profile({req_id}, {steps}, {ranks})")

    def stacks(self, timeout: float = 5.0) -> list[list[dict[str, Any]] | None]:
        """Rank 1 stands in user code, the others in an all-reduce waiting for it; rank 2 gives no answer."""
        waiting = [
            ["/r/cluster/rank/worker.py", 9, "_train_step", ""],
            ["/v/site-packages/torch/d.py", 5, "all_reduce", ""],
        ]
        user = [["/r/cluster/rank/worker.py", 9, "_train_step", ""], ["/r/mytask.py", 7, "compute_loss", ""]]
        out: list[list[dict[str, Any]] | None] = []
        for r in range(self.world_size):
            frames = user if r == 1 else waiting
            out.append(None if r == 2 else [{"name": "MainThread", "training": True, "frames": frames}])
        return out

    def spare_ready(self) -> float | None:
        return None

    def classify(self, exc: BaseException, starting: bool = False) -> Failure:
        if starting:  # a scripted group's start raises no Ray error: what the real group calls start_failed
            return Failure("start_failed", None, f"{type(exc).__name__}: {exc}")
        kind, _, rest = str(exc).partition(":")
        err = WorkerError(1, 3, "RuntimeError", rest, "Traceback: boom") if kind == "user_error" else None
        return Failure(kind, 1, str(exc), err)

    def available_for(self, n: int) -> bool:
        return self.world_size + n <= self.capacity[0]

    room_elsewhere = True  # what room_without() answers: whether a node could be quarantined

    def room_without(self, nodes: list[str], n: int) -> bool:
        self.calls.append(f"room_without({sorted(nodes)}, {n})")
        return ScriptedGroup.room_elsewhere

    def _salvage_after(self, failure: Failure) -> Salvage | None:
        if ScriptedGroup.survivors is None:
            return None
        peers = {r: dataclasses.replace(p, rank=r) for r, p in ScriptedGroup.survivors.items()}
        return Salvage(resources="pg", actors=dict.fromkeys(peers, "actor"), peers=peers, rows=self.rows)

    def adopt(self, salvage: Salvage) -> None:
        self.adopted = salvage

    def shutdown(self, graceful: bool) -> None:
        self.shut = graceful


def make(
    script: dict[int, list[Any]],
    overrides: list[str] = (),
    capacity: int = 2,
    resume: dict[int, int] | None = None,
    group_cls: type[ScriptedGroup] | None = None,
) -> tuple[Driver, list[int]]:
    ScriptedGroup.instances = []
    ScriptedGroup.survivors = None
    ScriptedGroup.rows = []
    ScriptedGroup.drains = []
    ScriptedGroup.move_script = ["ready"]
    cap = [capacity]
    cfg = load_config(
        data={"storage": {"url": f"memory://drv-{uuid.uuid4().hex}"}},
        overrides=["training.epochs=3", "failures.backoff_s=0", *overrides],
    )
    driver = Driver(
        cfg,
        group_factory=lambda c, u, a: (group_cls or ScriptedGroup)(c, u, a, script, cap, resume or {}),
        out=io.StringIO(),
        poll_s=0.0,
    )
    return driver, cap


def kinds(driver: Driver) -> list[str]:
    return [e["event"] for e in driver.events.records()]


class RowsGroup(ScriptedGroup):
    """The scripted group, plus rank 0's step rows in each epoch result (as real workers send them)."""

    def poll(self, timeout: float) -> list[EpochResult] | None:
        results = super().poll(timeout)
        if results:
            first = results[0].global_step - (STEPS - self.start_step)
            rows = [
                {
                    "time": time.time(),
                    "global_step": g,
                    "epoch": self.epoch,
                    "loss": 10 / g + self.attempt,
                    "lr": 0.01,
                }
                for g in range(first + 1, results[0].global_step + 1)
            ]
            results[0].step_rows = rows
        return results


class Hook:
    """A webhook on 127.0.0.1: records each POST's JSON body; answers 500 to the event named ``refuse``."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.refuse: str | None = None
        self.refused = 0
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body["event"]["event"] == hook.refuse:
                    hook.refused += 1
                    self.send_response(500)
                else:
                    hook.got.append(body)
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T000/SECRET"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The driver's state changes as its debug log says them (``caplog`` at DEBUG for
    cluster.driver.driver)."""
    return [
        r.getMessage().split(" (")[0].removeprefix("state ")
        for r in caplog.records
        if r.name == "cluster.driver.driver" and r.getMessage().startswith("state ")
    ]


def peer(step: int, digest: str = "d1") -> PeerState:
    """What a survivor kept in memory, at ``step``."""
    return PeerState(0, step, step // STEPS, step % STEPS, digest, 1000)
