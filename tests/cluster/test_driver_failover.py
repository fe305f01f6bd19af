"""A driver that dies on a running Ray cluster (a real `ray start --head`, jobs through `ray job submit`):
its ranks outlive it; the next submission of the run adopts them (same processes, no step recomputed,
final weights bitwise equal to a fault-free run); never resubmitted, they stop by themselves within
`failures.orphan_timeout_s` and free their placement group.

    pytest tests/cluster/test_driver_failover.py -m cluster
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from cluster.inspect import read_events
from cluster.run.checkpoint import CheckpointStore
from cluster.run.goodput import run_goodput
from cluster.run.lease import generations, read_holder
from cluster.run.storage import Storage
from cluster.worker_group.pulse import run_key
from tests.cluster.rayproc import RAY, REPO, Head, owned_pids, run
from tests.cluster.test_job_submit import small, status, submit, workers_alive

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ORPHAN_S = 30
PYTHON = sys.executable


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A real head of its own (temp dir, HOME, ports); every process of it is killed by PID at the end,
    the detached ranks and placement groups with it."""
    temp = tempfile.mkdtemp(prefix="hf", dir="/tmp")
    home = tempfile.mkdtemp(prefix="hfhome", dir="/tmp")
    h = Head(temp, home)
    try:
        h.start()
        yield h
    finally:
        try:
            h.stop()
            assert owned_pids([temp]) == [], "processes of the test's Ray head are still alive"
        finally:
            shutil.rmtree(temp, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)
            assert not os.path.exists(temp)


@pytest.fixture(scope="module")
def storage_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="hfruns", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job(storage: str, name: str, *extra: str) -> list[str]:
    """Two epochs long enough (about 195 steps each) to kill the driver in the middle of one."""
    return small(
        storage,
        name,
        "task_args.max_chars=200000",
        "training.epochs=2",
        "checkpoint.every_steps=50",
        f"failures.orphan_timeout_s={ORPHAN_S}",
        "failures.hot_spare=auto",  # the default (small() turns it off): adopted with the ranks
        *extra,
    )


def driver_at(storage: str, name: str, step: int, timeout: float = 150) -> int:
    """The driver's pid (its `driver.json`) once a checkpoint at ``step`` or later is committed."""
    store = CheckpointStore(Storage(os.path.join(storage, name)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.step >= step for c in store.list()):
            with open(os.path.join(storage, name, "driver.json")) as fh:
                return int(json.load(fh)["pid"])
        time.sleep(0.05)
    raise AssertionError(f"the job never reached step {step}")


def events(storage: str, name: str) -> list[dict]:  # type: ignore[type-arg]
    return read_events(Storage(os.path.join(storage, name)))


def final_weights(storage: str, name: str) -> dict[str, torch.Tensor]:
    latest = CheckpointStore(Storage(os.path.join(storage, name))).load_latest()
    assert latest is not None
    weights: dict[str, torch.Tensor] = latest.files["model.pt"]
    return weights


def placement_groups(h: Head) -> list[dict]:  # type: ignore[type-arg]
    proc = run([RAY, "list", "placement-groups", "--address", h.address, "--format", "json"], h.env, 60)
    assert proc.returncode == 0, proc.stdout[-2000:]
    text = proc.stdout[proc.stdout.index("[") :]
    return [pg for pg in json.loads(text) if pg.get("state") != "REMOVED"]


@pytest.fixture(scope="module")
def reference(head: Head, storage_dir: str) -> dict[str, torch.Tensor]:
    """The final weights of the same job, undisturbed."""
    ref = submit(head, *job(storage_dir, "reference"))
    assert ref.returncode == 0, ref.stdout[-6000:]
    return final_weights(storage_dir, "reference")


def assert_bitwise(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.timeout(600)
def test_a_killed_driver_s_ranks_are_adopted_by_the_next_submission(
    head: Head, storage_dir: str, reference: dict[str, torch.Tensor]
) -> None:
    """SIGKILL the driver mid-epoch and resubmit: the same rank processes go on from the step they reached
    (no step recomputed, no group started anew) and the final weights equal a fault-free run's, bit for
    bit. The goodput ledger charges the gap to ``driver_down`` and keeps the steps the ranks trained in it;
    ``show`` says where they were adopted."""
    spare = "failures.hot_spare=true"  # a spare beside them: set aside by the adoption, and a new one made
    first = submit(head, *job(storage_dir, "adopted", spare), options=("--no-wait",), timeout=120)
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, "adopted", 50)
    os.kill(pid, signal.SIGKILL)
    ranks = workers_alive(head)
    assert len(ranks) in (2, 3), "the ranks (and the spare, once its process is up) died with their driver"

    second = submit(head, *job(storage_dir, "adopted", spare))
    assert second.returncode == 0, second.stdout[-6000:]
    assert "adopted 2 ranks at step" in second.stdout, second.stdout[-6000:]
    ev = events(storage_dir, "adopted")
    starts = [e for e in ev if e["event"] == "group_started"]
    (adopted,) = [e for e in ev if e["event"] == "adopted"]
    assert sorted(adopted["pids"]) == sorted(starts[0]["pids"])  # the same processes
    assert [e["resume_source"] for e in starts] == ["fresh", "adopted"]  # nothing started anew
    assert [e["hot_spare"] for e in starts] == ["preparing", "preparing"]  # the adopted group has its own
    assert [e for e in ev if e["event"] == "finished"]
    (adopted_start,) = [e for e in starts if e["resume_source"] == "adopted"]
    assert adopted_start["resume_step"] == adopted["step"] > 50  # they trained on with no driver
    # the account: the gap is the driver's, the steps the ranks trained in it are kept, none is redone
    final_step = [e for e in ev if e["event"] == "finished"][-1]["global_step"]
    ledger = run_goodput(os.path.join(storage_dir, "adopted"))
    assert ledger is not None and ledger.steps["recomputed"] == 0, ledger
    assert ledger.seconds["driver_down"] > 0, ledger
    # every step counted once (the first group's first step may count to its start, as in any run)
    assert final_step - 1 <= ledger.steps["productive"] <= final_step, (ledger, final_step)
    shown = run([PYTHON, "-m", "cluster", "show", storage_dir, "adopted"], head.env, 120)
    assert shown.returncode == 0, shown.stdout[-4000:]
    assert f"adopted 2 ranks at step {adopted['step']} from the previous driver" in shown.stdout, shown.stdout
    assert "driver_down" in shown.stdout, shown.stdout
    assert_bitwise(final_weights(storage_dir, "adopted"), reference)
    assert workers_alive(head) == [] and placement_groups(head) == []


@pytest.mark.timeout(300)
def test_ranks_no_driver_comes_back_for_stop_within_the_orphan_timeout(head: Head, storage_dir: str) -> None:
    """SIGKILL the driver and never resubmit: its ranks stop and their placement group is freed within
    `failures.orphan_timeout_s`, and they commit nothing meanwhile."""
    first = submit(
        head, *job(storage_dir, "orphan", "training.epochs=50"), options=("--no-wait",), timeout=120
    )
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, "orphan", 50)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert workers_alive(head), "the ranks died with their driver"
    assert placement_groups(head)
    store = CheckpointStore(Storage(os.path.join(storage_dir, "orphan")))
    deadline = killed + ORPHAN_S + 30
    while workers_alive(head) or placement_groups(head):
        assert time.monotonic() < deadline, (workers_alive(head), placement_groups(head))
        time.sleep(1)
    gone_s = time.monotonic() - killed
    assert gone_s >= ORPHAN_S - 5, gone_s
    late = [c.step for c in store.list() if c.manifest.get("committed_at", 0) > time.time() - gone_s + 16]
    assert late == [], f"checkpoints committed after the driver died: {late}"


PROBE = """
import sys, time, ray
from cluster.rank.watchdog import StaleDriverError
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)


def ranks():
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]  # a rank's, not a hot spare's (named like the ranks)
        mine = name.startswith(sys.argv[2] + ":") and not name.endswith(":spare")
        if entry["namespace"] == "cluster-ranks" and mine:
            try:
                out.append((name, ray.get_actor(name, namespace="cluster-ranks")))
            except ValueError:
                pass
    return sorted(out)


def answer(rank, generation):
    try:
        ray.get(rank.call.remote(generation, "touch"), timeout=60)
        return "obeyed"
    except StaleDriverError as exc:
        return f"refused serves {exc.served}"
    except Exception as exc:
        return f"error {type(exc).__name__}"


print("PROBE connected", flush=True)
deadline = time.monotonic() + 300
while time.monotonic() < deadline:  # until generation 2 adopted both ranks, then ask with either
    found = ranks()
    if len(found) == 2 and all(answer(rank, 2) == "obeyed" for _, rank in found):
        for name, rank in found:
            for generation in (1, 2):
                print("PROBE", name, generation, answer(rank, generation), flush=True)
        break
    time.sleep(0.5)
"""


def segments(storage: str, name: str) -> dict[str, bytes]:
    folder = os.path.join(storage, name, "events")
    out = {}
    for n in sorted(os.listdir(folder)):
        with open(os.path.join(folder, n), "rb") as fh:
            out[n] = fh.read()
    return out


def wait_for(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_a_paused_driver_taken_over_writes_nothing_and_its_ranks_obey_only_the_new_one(
    head: Head, storage_dir: str, reference: dict[str, torch.Tensor]
) -> None:
    """SIGSTOP the driver mid-epoch and resubmit: the new job takes the lease once the old one's beat stood
    still and adopts the ranks. SIGCONT the old driver: it writes nothing more to the run (no event, no
    commit: fenced by the lease), its ranks refuse its generation (StaleDriverError) and obey the new
    driver's, it leaves them to it and ends; the run finishes bitwise equal to an undisturbed one."""
    name, old_id, new_id = "paused", f"paused-{secrets.token_hex(3)}", f"taker-{secrets.token_hex(3)}"
    args = job(storage_dir, name, "failures.orphan_timeout_s=120")
    fast_lease = {"CLUSTER_LEASE_BEAT_S": "1"}  # the new job sees the old lease stand still in 2.5 s
    first = submit(head, *args, options=("--no-wait", "--submission-id", old_id), env_vars=fast_lease)
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, name, 50)
    run_dir = Storage(os.path.join(storage_dir, name))
    probe: subprocess.Popen[str] | None = None
    try:
        os.kill(pid, signal.SIGSTOP)
        ranks = sorted(workers_alive(head))
        assert len(ranks) == 2
        old_segments = segments(storage_dir, name)  # everything the paused driver wrote to the event log
        # asks the ranks, from the moment the new driver adopted them, who they obey (before they end)
        probe = subprocess.Popen(
            [PYTHON, "-c", PROBE, f"127.0.0.1:{head.port}", run_key(run_dir.root)],
            cwd=REPO,
            env=head.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        second = submit(head, *args, options=("--no-wait", "--submission-id", new_id), env_vars=fast_lease)
        assert second.returncode == 0, second.stdout[-4000:]
        wait_for(lambda: any(e["event"] == "adopted" for e in events(storage_dir, name)), 240, "the adoption")
        took = read_holder(run_dir, 2)
        assert generations(run_dir) == [1, 2] and took is not None
    except BaseException:
        if probe is not None:
            probe.kill()  # (by its pid: it is ours)
            probe.wait(10)
        raise
    finally:
        os.kill(pid, signal.SIGCONT)  # woken while the new driver trains with the ranks
    assert probe is not None
    try:
        try:
            said, _ = probe.communicate(timeout=240)
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait(10)
        lines = [ln.split(" ", 4) for ln in said.splitlines() if ln.startswith("PROBE ") and ":g" in ln]
        assert len(lines) == 4, said[-4000:]  # two ranks, two generations each
        assert sorted((g, what) for _, _, g, what, *_ in lines) == [
            ("1", "refused"),
            ("1", "refused"),
            ("2", "obeyed"),
            ("2", "obeyed"),
        ], said[-4000:]
        assert all(ln[4] == "serves 2" for ln in lines if ln[3] == "refused"), lines
        wait_for(lambda: status(head, old_id) not in ("PENDING", "RUNNING"), 180, "the woken driver's end")
        old_logs = head.job("logs", old_id, timeout=60).stdout
        assert status(head, old_id) == "FAILED", old_logs[-6000:]
        assert "was taken over by" in old_logs, old_logs[-6000:]
        assert "its ranks are left to the driver that holds it now" in old_logs, old_logs[-6000:]
        wait_for(lambda: status(head, new_id) not in ("PENDING", "RUNNING"), 400, "the new driver's end")
        new_logs = head.job("logs", new_id, timeout=60).stdout
        assert status(head, new_id) == "SUCCEEDED", new_logs[-6000:]
        assert "adopted 2 ranks at step" in new_logs, new_logs[-6000:]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # (ended already, unless it hung)
        except ProcessLookupError:
            pass

    # the paused driver's segments are as it left them; every later event is the new driver's
    now = segments(storage_dir, name)
    assert {k: now[k] for k in old_segments} == old_segments
    later = [json.loads(ln) for k in sorted(set(now) - set(old_segments)) for ln in now[k].splitlines()]
    assert later[0]["event"] == "run_start" and later[0]["lease"] == 2, later[:2]
    ev = events(storage_dir, name)
    assert [e["lease"] for e in ev if e["event"] == "run_start"] == [1, 2]
    assert [e["event"] for e in ev if e["event"] in ("run_failed", "finished")] == ["finished"]
    starts = [e for e in ev if e["event"] == "group_started"]
    assert [e["resume_source"] for e in starts] == ["fresh", "adopted"]
    (adopted,) = [e for e in ev if e["event"] == "adopted"]
    assert sorted(adopted["pids"]) == sorted(starts[0]["pids"]) == ranks
    assert [e for e in ev if e["event"] == "failure"] == []  # the woken driver killed none of them
    # every checkpoint committed since the takeover was the new driver's (its ranks, its events)
    recorded = {e["step"] for e in later if e["event"] == "checkpoint"}
    store = CheckpointStore(run_dir)
    since = [c.step for c in store.list() if c.manifest.get("committed_at", 0) > took.since]
    assert since and set(since) <= recorded, (since, recorded)
    ledger = run_goodput(run_dir.root)
    assert ledger is not None and ledger.steps["recomputed"] == 0, ledger
    assert_bitwise(final_weights(storage_dir, name), reference)
    assert workers_alive(head) == [] and placement_groups(head) == []


@pytest.mark.timeout(420)
def test_a_group_whose_ranks_all_died_leaves_no_placement_group_behind(head: Head, storage_dir: str) -> None:
    """SIGKILL the driver, then both ranks: no rank is left to free their (detached) placement group. The
    next submission removes it, resumes from storage, and leaves nothing behind."""
    name = "bare"
    first = submit(head, *job(storage_dir, name), options=("--no-wait",), timeout=120)
    assert first.returncode == 0, first.stdout[-4000:]
    pid = driver_at(storage_dir, name, 50)
    os.kill(pid, signal.SIGKILL)
    ranks = workers_alive(head)
    assert len(ranks) == 2, "the ranks died with their driver"
    for rank in ranks:
        os.kill(rank, signal.SIGKILL)
    wait_for(lambda: not workers_alive(head), 60, "the ranks' end")
    left = placement_groups(head)
    assert [pg["name"].split(":")[1] for pg in left] == ["g1"], left  # nobody frees it: the leak

    second = submit(head, *job(storage_dir, name))
    assert second.returncode == 0, second.stdout[-6000:]
    ev = events(storage_dir, name)
    starts = [e for e in ev if e["event"] == "group_started"]
    assert [e["resume_source"] for e in starts] == ["fresh", "checkpoint"], starts
    assert starts[-1]["resume_step"] >= 50
    assert not [e for e in ev if e["event"] in ("adopted", "adoption_refused")]  # nothing to adopt
    assert [e for e in ev if e["event"] == "finished"]
    assert workers_alive(head) == [] and placement_groups(head) == []
