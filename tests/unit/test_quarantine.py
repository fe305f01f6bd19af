"""Lemon nodes kept out (cluster.run.quarantine): the counting of incidents per node, the state a resubmission
reads back, the release, and the driver's seam (the scripted worker group is told which nodes to keep off,
by the run that quarantined them and by its resubmission)."""

from __future__ import annotations

import dataclasses
import io
import json
import uuid
from typing import Any

import pytest

from cluster.core.errors import ConfigError, Failure, FencedError, HangVerdict
from cluster.driver.driver import Driver
from cluster.run.quarantine import QUARANTINE_FILE, Quarantine, read, show_lines, unquarantine
from cluster.run.storage import Storage
from cluster.seam.protocol import SetupInfo
from cluster.spec.load import load_config
from tests.support.fakes import ScriptedGroup, kinds

pytestmark = pytest.mark.timeout(60)


def _quarantine(after: int = 2) -> tuple[Quarantine, list[tuple[str, dict[str, Any]]], list[list[str]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    told: list[list[str]] = []
    storage = Storage(f"memory://q-{uuid.uuid4().hex}/run")
    q = Quarantine(storage, after, lambda kind, **f: events.append((kind, f)), told.append)
    return q, events, told


def test_the_second_incident_on_one_node_quarantines_it_and_a_resubmission_reads_it_back() -> None:
    q, events, told = _quarantine()
    assert not q.incident("nodeA", "worker_died", 3, host="10.0.0.7", rank=1)
    assert not q.incident("nodeB", "hang", 4, rank=0)  # another node's count is its own
    assert q.nodes == [] and events == [] and told == []
    assert q.incident("nodeA", "replica_mismatch", 9, rank=1)
    assert q.nodes == ["nodeA"] and told == [["nodeA"]]
    ((kind, fields),) = events
    assert kind == "node_quarantined" and fields["node"] == "nodeA" and fields["host"] == "10.0.0.7"
    assert [(i["kind"], i["step"]) for i in fields["incidents"]] == [
        ("worker_died", 3),
        ("replica_mismatch", 9),
    ]
    assert not q.incident("nodeA", "worker_died", 12)  # quarantined: no more counting, no second event
    assert len(events) == 1

    again = Quarantine(q.storage, 2)  # the next submission of the run
    again.load()
    assert again.nodes == ["nodeA"]
    assert [i.kind for i in again.records["nodeB"].incidents] == ["hang"]  # counts carry over too
    assert again.incident("nodeB", "slow_rank_move", 20)


def test_zero_never_quarantines_and_unknown_nodes_are_not_counted() -> None:
    q, events, _ = _quarantine(after=0)
    for step in range(5):
        assert not q.incident("nodeA", "worker_died", step)
    assert q.nodes == [] and events == [] and not q.storage.exists(QUARANTINE_FILE)
    q1, _, _ = _quarantine(after=1)
    assert not q1.incident("", "worker_died", 1)  # a scripted group's ranks have no node
    assert q1.incident("nodeA", "worker_died", 1)


def test_which_failures_count_and_several_ranks_on_one_node_are_one_incident() -> None:
    q, _, _ = _quarantine(after=3)
    nodes, hosts = ["n0", "n0", "n1", "n1"], ["h0", "h0", "h1", "h1"]
    q.failure(Failure("user_error", 2, "the task's own bug"), 5, nodes, hosts)
    q.failure(Failure("storage", 2, "s3 down"), 5, nodes, hosts)
    q.failure(Failure("worker_died", None, "unknown rank"), 5, nodes, hosts)
    assert "n1" not in q.records
    q.failure(Failure("node_lost", 3, "gone"), 6, nodes, hosts)
    assert [(i.kind, i.rank) for i in q.records["n1"].incidents] == [("node_lost", 3)]
    assert q.ranks("replica_mismatch", [2, 3, 0], 7, nodes, hosts) == []  # n1 once, n0 once
    assert len(q.records["n1"].incidents) == 2 and len(q.records["n0"].incidents) == 1
    assert q.records["n1"].host == "h1"
    assert q.ranks("hang", [3], 8, nodes) == ["n1"]
    unjudged = Failure("hang", 0, "no rank stands out", hang=HangVerdict(None, "every rank waits"))
    assert not q.failure(unjudged, 9, nodes, hosts) and "n0" in q.records
    assert len(q.records["n0"].incidents) == 1  # a hang with no suspect blames no node
    q.failure(Failure("hang", 0, "rank 0 hangs", hang=HangVerdict(0, "outside a collective")), 9, nodes)
    assert [i.kind for i in q.records["n0"].incidents] == ["replica_mismatch", "hang"]


def test_a_writer_that_was_taken_over_writes_nothing() -> None:
    q, _, _ = _quarantine()

    def fenced() -> None:
        raise FencedError("taken over")

    q.fence = fenced
    with pytest.raises(FencedError):
        q.incident("nodeA", "worker_died", 1)
    assert not q.storage.exists(QUARANTINE_FILE)


def test_match_by_id_prefix_or_host_with_one_clear_error_for_none_or_several() -> None:
    q, _, _ = _quarantine(after=1)
    q.incident("abc123", "worker_died", 1, host="10.0.0.1")
    q.incident("abd456", "worker_died", 1, host="10.0.0.2")
    q.incident("zzz", "hang", 1)
    assert q.match("abc123").node == "abc123"
    assert q.match("abd").node == "abd456"
    assert q.match("10.0.0.1").node == "abc123"
    with pytest.raises(ConfigError, match="matches 2 quarantined nodes"):
        q.match("ab")
    with pytest.raises(ConfigError, match=r"no quarantined node .* matches 'nope'.*quarantined: abc123"):
        q.match("nope")


def test_unquarantine_releases_the_node_with_an_event_and_show_lists_it(tmp_path: Any) -> None:
    run = Storage(f"{tmp_path}/run")
    q = Quarantine(run, 2)
    q.incident("f00dfeed" * 7, "worker_died", 3, host="10.1.1.1", rank=1)
    q.incident("f00dfeed" * 7, "worker_died", 8, host="10.1.1.1", rank=1)
    shown = "\n".join(show_lines(run))
    assert "QUARANTINED" in shown and "worker_died at step 3, worker_died at step 8" in shown
    assert "unquarantine" in shown

    rec = unquarantine(run.root, "10.1.1.1")
    assert rec.node == "f00dfeed" * 7 and not rec.quarantined
    assert read(run)[rec.node].incidents == []  # the count starts anew
    events = [
        json.loads(line)
        for name in run.listdir("events")
        for line in run.read_bytes(f"events/{name}").splitlines()
    ]
    (released,) = [e for e in events if e["event"] == "node_released"]
    assert released["node"] == rec.node and [i["step"] for i in released["cleared"]] == [3, 8]
    assert "released by" in "\n".join(show_lines(run))
    with pytest.raises(ConfigError, match="no quarantined node"):
        unquarantine(run.root, "10.1.1.1")  # released already


def test_quarantine_after_below_zero_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"failures\.quarantine_after=-1"):
        load_config(data={"storage": {"url": "memory://x"}}, overrides=["failures.quarantine_after=-1"])


class OnNodes(ScriptedGroup):
    """Rank r of attempt a runs on node ``node-r`` (one node per rank, the same across attempts); records
    the nodes it was told to keep off."""

    kept_off: list[tuple[int, list[str]]] = []

    def start(self, world_size: int, *args: Any, **kwargs: Any) -> list[SetupInfo]:
        infos = super().start(world_size, *args, **kwargs)
        return [dataclasses.replace(i, node_id=f"node-{i.rank}", hostname=f"host{i.rank}") for i in infos]

    def keep_off(self, nodes: list[str]) -> None:
        OnNodes.kept_off.append((self.attempt, list(nodes)))


def _driver(cfg: Any, script: dict[int, list[Any]]) -> Driver:
    return Driver(
        cfg,
        group_factory=lambda c, u, a: OnNodes(c, u, a, script, [2], {}),
        out=io.StringIO(),
        poll_s=0.0,
    )


def test_the_driver_keeps_the_group_off_a_node_after_two_deaths_there_and_so_does_a_resubmission() -> None:
    cfg = load_config(
        data={"storage": {"url": f"memory://drv-{uuid.uuid4().hex}"}},
        overrides=["training.epochs=2", "failures.backoff_s=0"],
    )
    OnNodes.kept_off = []
    died = Failure("worker_died", 1, "worker_died: rank 1's process died")
    driver = _driver(cfg, {0: [died], 1: [died]})
    result = driver.run()
    assert result.status == "finished"
    # told at the second death (the failed group: its salvage re-places rank 1), then every later group
    assert OnNodes.kept_off[0] == (1, ["node-1"]) and (2, ["node-1"]) in OnNodes.kept_off
    (q,) = [e for e in driver.events.records() if e["event"] == "node_quarantined"]
    assert (
        q["node"] == "node-1"
        and q["host"] == "host1"
        and [i["kind"] for i in q["incidents"]]
        == [
            "worker_died",
            "worker_died",
        ]
    )
    assert "quarantined after" in driver.out.getvalue() and "unquarantine" in driver.out.getvalue()
    assert kinds(driver).count("node_quarantined") == 1

    OnNodes.kept_off = []
    resubmitted = _driver(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, epochs=3)), {})
    assert resubmitted.run().status == "finished"
    assert OnNodes.kept_off == [(0, ["node-1"])]  # its first group already keeps off the node


def test_a_node_the_run_cannot_be_placed_without_is_never_quarantined_and_the_run_finishes() -> None:
    """One machine: the only node. Two (three) deaths there are said, never acted on: no node kept out, the
    survivors' state kept, the run finished as it would with the guard off."""
    cfg = load_config(
        data={"storage": {"url": f"memory://drv-{uuid.uuid4().hex}"}},
        overrides=["training.epochs=2", "failures.backoff_s=0"],
    )
    OnNodes.kept_off = []
    ScriptedGroup.room_elsewhere = False
    died = Failure("worker_died", 1, "worker_died: rank 1's process died")
    try:
        driver = _driver(cfg, {0: [died], 1: [died], 2: [died]})
        result = driver.run()
    finally:
        ScriptedGroup.room_elsewhere = True
    assert result.status == "finished" and result.attempts == 4
    assert OnNodes.kept_off == []  # no group was ever told to keep off a node
    assert kinds(driver).count("node_quarantined") == 0
    kept = [e for e in driver.events.records() if e["event"] == "node_kept_in"]
    assert [len(e["incidents"]) for e in kept] == [2, 3] and kept[0]["node"] == "node-1"
    assert "kept in after 2 incidents" in driver.out.getvalue()
    # the run with the guard off ends the same way
    off = dataclasses.replace(cfg, failures=dataclasses.replace(cfg.failures, quarantine_after=0))
    off = dataclasses.replace(off, name=cfg.name + "-off")
    base = _driver(off, {0: [died], 1: [died], 2: [died]}).run()
    assert (base.status, base.attempts) == (result.status, result.attempts)


def test_the_cli_releases_a_node_or_says_which_nodes_it_could_mean(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.__main__ import main

    run = Storage(f"{tmp_path}/run")
    run.write_bytes("run.json", b"{}")
    q = Quarantine(run, 1)
    q.incident("beef01" + "0" * 50, "node_lost", 4, host="10.2.0.1")
    q.incident("beef02" + "0" * 50, "hang", 5, host="10.2.0.2")
    assert main(["unquarantine", run.root, "beef"]) == 2
    assert "matches 2 quarantined nodes" in capsys.readouterr().err
    assert main(["unquarantine", run.root, "10.2.0.9"]) == 2
    assert "quarantined: beef01000000 (10.2.0.1), beef02000000 (10.2.0.2)" in capsys.readouterr().err
    assert main(["unquarantine", run.root, "beef02"]) == 0
    assert "released node beef02000000 (10.2.0.2)" in capsys.readouterr().out
    assert read(run)["beef01" + "0" * 50].quarantined and not read(run)["beef02" + "0" * 50].quarantined
