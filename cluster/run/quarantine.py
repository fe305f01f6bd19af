"""Lemon nodes kept out: a node involved in ``failures.quarantine_after`` incidents of one run gets no
more of its ranks, for the rest of the run and for its resubmissions.

Incidents, each attributed to the one Ray node where it happened: a rank's process died there
(``worker_died``), the node was lost (``node_lost``), the rank a hang was blamed on ran there (``hang``), a
rank whose replicas disagreed ran there (``replica_mismatch``), a slow rank was moved off it
(``slow_rank_move``). Failures while a group starts are not counted (the ranks' nodes are known once it is
set up), nor errors of the task's own code (``user_error``: the code's fault, not the node's).

The state lives in ``<run>/quarantine.json`` (written whole, atomically, after the run's lease fence), so a
resubmission reads it at its start. A quarantined node is kept off through the placement groups' label
selector on Ray's built-in ``ray.io/node-id`` label (``cluster.worker_group.placement``): new groups and
moves are never placed there, and a warm restart re-places any rank still on it. With no other room the job
shrinks when ``scaling.min_workers`` allows, else waits for room as for any resources, naming the nodes.
``python -m cluster unquarantine RUN NODE`` (:func:`unquarantine`) releases one.

Ray gives a node a new id each time its raylet starts: a machine that rejoins is a new node to Ray, and is
not kept out by this. Nodes are not matched by address: several Ray nodes may share one.
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.core.errors import ConfigError, Failure, LeaseHeldError
from cluster.run.folder import RunFolder
from cluster.run.storage import Storage

logger = logging.getLogger(__name__)

QUARANTINE_FILE = "quarantine.json"

INCIDENT_KINDS = ("worker_died", "node_lost", "hang", "replica_mismatch", "slow_rank_move")
"""What counts against a node (module doc)."""

_FAILURE_KINDS = ("worker_died", "node_lost", "hang")
"""The failures (``Failure.kind``) that are incidents of the node their rank ran on."""


@dataclass(frozen=True)
class Incident:
    kind: str
    step: int
    time: float
    rank: int | None = None


@dataclass
class NodeRecord:
    """One node's incidents in this run, and whether it is quarantined."""

    node: str
    """Ray's node id."""
    host: str = ""
    """Its host name or address, where known."""
    incidents: list[Incident] = field(default_factory=list)
    """Since it was last released (or since the run began)."""
    quarantined_at: float | None = None
    released: list[dict[str, Any]] = field(default_factory=list)
    """Each release: ``time``, ``by``, the ``incidents`` it cleared."""

    @property
    def quarantined(self) -> bool:
        return self.quarantined_at is not None

    def describe(self) -> str:
        return f"{self.node[:12]}" + (f" ({self.host})" if self.host else "")


class Quarantine:
    """The run's incidents per node and its quarantined nodes (module doc). ``load`` reads them at the
    driver's start; each incident is written through at once."""

    def __init__(
        self,
        storage: Storage,
        after: int,
        event: Callable[..., None] | None = None,
        on_quarantine: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.storage = storage
        self.after = after
        """``failures.quarantine_after``: incidents that quarantine a node; 0: never."""
        self.event = event
        """Writes an event (``RunRecord.event``: its console line too)."""
        self.on_quarantine = on_quarantine
        """Called with every quarantined node once one more is: the driver keeps its group off them."""
        self.room: Callable[[str], bool] | None = None
        """Whether the run can still be placed without a node (and those already out): asked before it is
        quarantined, so the guard never takes the last room (None: nothing to ask, always room)."""
        self.held_back: dict[str, int] = {}
        """node -> its incident count when it was last kept in for want of room (said once per count)."""
        self.fence: Callable[[], None] | None = None
        """Called before each write: raises when this writer may no longer write (``cluster.run.lease``)."""
        self.records: dict[str, NodeRecord] = {}

    # ------------------------------------------------------------------ state
    def load(self) -> None:
        """Read ``quarantine.json`` (none: nothing yet). A read that fails past its retries raises."""
        self.records = read(self.storage)

    @property
    def nodes(self) -> list[str]:
        """The quarantined node ids, in the order they were quarantined."""
        held = [r for r in self.records.values() if r.quarantined]
        return [r.node for r in sorted(held, key=lambda r: r.quarantined_at or 0.0)]

    def describe(self, nodes: Sequence[str] | None = None) -> str:
        """``id (host), ...`` of ``nodes`` (default: every quarantined node)."""
        ids = self.nodes if nodes is None else nodes
        return ", ".join(self.records[n].describe() if n in self.records else n[:12] for n in ids)

    # ------------------------------------------------------------------ incidents
    def incident(self, node: str, kind: str, step: int, host: str = "", rank: int | None = None) -> bool:
        """Count one incident of ``kind`` (:data:`INCIDENT_KINDS`) on ``node`` (a Ray node id; "" for an
        unknown node is ignored) at ``step``; True when this quarantines the node. Written through to
        storage; a node already quarantined gets no ranks, so no more incidents."""
        if self.after <= 0 or not node:
            return False
        rec = self.records.setdefault(node, NodeRecord(node))
        if rec.quarantined:
            return False
        rec.host = rec.host or host
        rec.incidents.append(Incident(kind, step, time.time(), rank))
        now = len(rec.incidents) >= self.after and self._room_without(rec)
        if now:
            rec.quarantined_at = time.time()
        self._save()
        if now:
            logger.warning("node %s quarantined after %d incidents", rec.describe(), len(rec.incidents))
            if self.event is not None:
                self.event(
                    "node_quarantined",
                    node=rec.node,
                    host=rec.host,
                    incidents=[_incident_dict(i) for i in rec.incidents],
                    after=self.after,
                    run=self.storage.root,
                )
            if self.on_quarantine is not None:
                self.on_quarantine(self.nodes)
        return now

    def _room_without(self, rec: NodeRecord) -> bool:
        """Whether ``rec``'s node may be quarantined: the run can be placed without it. Otherwise said once
        per incident count (a warning and a ``node_kept_in`` event) and the run goes on there."""
        if self.room is None or self.room(rec.node):
            return True
        count = len(rec.incidents)
        if self.held_back.get(rec.node) != count:
            self.held_back[rec.node] = count
            logger.warning(
                "node %s has %d incidents (%s): it would be quarantined (failures.quarantine_after=%d) if "
                "the run could be placed without it, but no other node has room for it; the run goes on",
                rec.describe(),
                count,
                ", ".join(f"{i.kind} at step {i.step}" for i in rec.incidents),
                self.after,
            )
            if self.event is not None:
                incidents = [_incident_dict(i) for i in rec.incidents]
                self.event(
                    "node_kept_in", node=rec.node, host=rec.host, incidents=incidents, after=self.after
                )
        return False

    def ranks(
        self, kind: str, ranks: Sequence[int], step: int, nodes: Sequence[str], hosts: Sequence[str] = ()
    ) -> list[str]:
        """One incident of ``kind`` per node among ``ranks`` (``nodes``/``hosts``: the group's, by rank;
        several ranks on one node are one incident there); the nodes this quarantined. For the replica
        guard: ``quarantine.ranks("replica_mismatch", suspects, step, nodes, hosts)``."""
        seen: dict[str, tuple[str, int]] = {}
        for r in ranks:
            if 0 <= r < len(nodes) and nodes[r] and nodes[r] not in seen:
                seen[nodes[r]] = (hosts[r] if r < len(hosts) else "", r)
        return [n for n, (host, r) in seen.items() if self.incident(n, kind, step, host, r)]

    def failure(self, failure: Failure, step: int, nodes: Sequence[str], hosts: Sequence[str] = ()) -> bool:
        """A failure of a running group (``nodes``/``hosts``: its ranks'): an incident of its rank's node
        when it is a death, a lost node or a hang whose suspect is known (:data:`_FAILURE_KINDS`); True
        when that quarantines it. A replica mismatch is counted by the replica guard (:meth:`ranks`)."""
        if failure.kind not in _FAILURE_KINDS or failure.rank is None:
            return False
        if failure.hang is not None and failure.hang.suspect is None:
            return False  # no rank was told apart as the one that hangs: no node to blame
        return bool(self.ranks(failure.kind, [failure.rank], step, nodes, hosts))

    # ------------------------------------------------------------------ release
    def match(self, text: str) -> NodeRecord:
        """The quarantined node ``text`` names: its id, a prefix of it, or its host/address. ConfigError
        naming the quarantined nodes when it names none or several."""
        held = [r for r in self.records.values() if r.quarantined]
        found = [r for r in held if r.node == text] or [
            r for r in held if r.node.startswith(text) or (r.host and r.host == text)
        ]
        listed = ", ".join(r.describe() for r in held) or "none"
        if not found:
            raise ConfigError(
                f"no quarantined node of {self.storage.root} matches {text!r} (a node id, a prefix of one, "
                f"or a host); quarantined: {listed}"
            )
        if len(found) > 1:
            raise ConfigError(
                f"{text!r} matches {len(found)} quarantined nodes of {self.storage.root} "
                f"({', '.join(r.describe() for r in found)}): give more of the node id"
            )
        return found[0]

    def release(self, node: str, by: str) -> NodeRecord:
        """Release quarantined ``node``: ranks may go there again, its count starts anew."""
        rec = self.records[node]
        rec.released.append(
            {"time": time.time(), "by": by, "incidents": [_incident_dict(i) for i in rec.incidents]}
        )
        rec.incidents, rec.quarantined_at = [], None
        self._save()
        return rec

    def _save(self) -> None:
        if self.fence is not None:
            self.fence()
        body = {"nodes": {n: _record_dict(r) for n, r in self.records.items()}}
        self.storage.write_atomic(QUARANTINE_FILE, json.dumps(body, indent=1).encode())

    # ------------------------------------------------------------------ saying why
    def wait_note(self) -> str:
        """Said where the job waits for room or shrinks: the nodes it may not use ("" for none)."""
        if not self.nodes:
            return ""
        return (
            f"quarantined node(s) {self.describe()} are kept out (failures.quarantine_after="
            f"{self.after}); python -m cluster unquarantine {self.storage.root} NODE releases one"
        )


def read(storage: Storage) -> dict[str, NodeRecord]:
    """The records of ``<run>/quarantine.json``; empty when there is none."""
    try:
        raw: Any = json.loads(storage.read_bytes(QUARANTINE_FILE))
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # written atomically: only a hand edit breaks it
        raise ConfigError(
            f"{storage.url(QUARANTINE_FILE)} does not parse ({exc}); fix or delete it (deleting releases "
            "every node)"
        ) from None
    out = {}
    for node, r in (raw.get("nodes") or {}).items():
        out[node] = NodeRecord(
            node=node,
            host=str(r.get("host") or ""),
            incidents=[Incident(**i) for i in r.get("incidents") or []],
            quarantined_at=r.get("quarantined_at"),
            released=list(r.get("released") or []),
        )
    return out


def _incident_dict(i: Incident) -> dict[str, Any]:
    return asdict(i)


def _record_dict(r: NodeRecord) -> dict[str, Any]:
    return {
        "host": r.host,
        "incidents": [_incident_dict(i) for i in r.incidents],
        "quarantined_at": r.quarantined_at,
        "released": r.released,
    }


# ---------------------------------------------------------------------------------------- show, CLI
def show_lines(storage: Storage) -> list[str]:
    """``show``'s section: each node with incidents in this run, quarantined or not; [] when none."""
    records = [r for r in read(storage).values() if r.incidents or r.released]
    if not records:
        return []
    held = sum(r.quarantined for r in records)
    out = ["", f"nodes with incidents ({len(records)}, {held} quarantined: they get no ranks of this run)"]
    for r in sorted(records, key=lambda r: (not r.quarantined, r.node)):
        what = ", ".join(f"{i.kind} at step {i.step}" for i in r.incidents) or "none since released"
        state = "QUARANTINED" if r.quarantined else "counted"
        out.append(f"  {r.node[:12]}  {r.host or '-'}  {state}  {what}")
        out += [f"    released by {x.get('by')} at {_when(x.get('time'))}" for x in r.released]
    if held:
        out.append(f"  (python -m cluster unquarantine {storage.root} NODE releases one)")
    return out


def _when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "-"


def unquarantine(
    run_url: str,
    node: str,
    storage_options: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
) -> NodeRecord:
    """Release the quarantined node ``node`` names (id, id prefix or host) of the run at ``run_url``, holding
    the run's lease meanwhile, with a ``node_released`` event. ConfigError while a job trains the run, or
    when ``node`` names no quarantined node or several."""
    from cluster.run.lease import Lease
    from cluster.run.logs import EventLog

    storage = RunFolder.at(run_url, storage_options).storage
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    try:
        lease = Lease.take(storage, f"unquarantine by {by}", say=say)
    except LeaseHeldError as exc:
        raise ConfigError(
            f"{exc}. Stop it first (python -m cluster stop {storage.root} --wait 600), then unquarantine; "
            "the next submission places ranks there again"
        ) from None
    try:
        q = Quarantine(storage, 0)
        q.fence = lease.check
        q.load()
        rec = q.release(q.match(node).node, by)
        events = EventLog(storage)
        events.fence = lease.check
        events.append(
            "node_released", node=rec.node, host=rec.host, by=by, cleared=rec.released[-1]["incidents"]
        )
        return rec
    finally:
        lease.release()
