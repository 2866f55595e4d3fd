"""The cluster as the controller sees it right now, held in memory.

Every report updates this state on the event loop (one thread, so no locks); the database is
written behind it by the group-commit writer, and API reads of "latest" things (nodes, GPUs,
jobs, status) answer from here without touching the database. At start the state is loaded
back from the database, so a restarted controller keeps inventory, health, dedupe cursors,
open incidents and undelivered commands.

``row_for`` turns a dirty key (``("nodes", (name,))``) into the full row to upsert, read at
flush time so a batch always writes the newest values.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainguard import wire

RowKey = tuple[str, tuple[Any, ...]]

NODE_HEALTH = ("healthy", "unhealthy", "lost", "unknown")


@dataclass(slots=True)
class GpuState:
    index: int
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    memory_total_bytes: int = 0
    health: str = "healthy"
    health_reason: str = ""
    latest: wire.GpuSample | None = None
    ecc_uncorrected_total: int | None = None


@dataclass(slots=True)
class NodeState:
    name: str
    first_seen_unix_s: float
    hostname: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    backend: str = ""
    agent_version: str = ""
    driver_version: str = ""
    health: str = "unknown"
    health_reason: str = ""
    power_w: float | None = None
    spool_dropped_total: int = 0
    last_report_unix_s: float | None = None
    #: Controller clock of the last report; silence is measured on our clock, never the
    #: agent's, so a skewed node clock cannot make a node look lost.
    last_seen_unix_s: float = 0.0
    gpus: dict[int, GpuState] = field(default_factory=dict)
    #: Why the remediation engine keeps work off this node (``None``: not isolated).
    isolated_reason: str | None = None
    isolated_unix_s: float | None = None

    @property
    def gpus_unhealthy(self) -> int:
        return sum(1 for g in self.gpus.values() if g.health != "healthy")


@dataclass(slots=True)
class RankState:
    rank: int
    node: str
    last_seen_unix_s: float
    gpu_index: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    state: str = "running"
    exit_code: int | None = None
    last_step: int | None = None
    inflight: list[wire.InflightCollective] = field(default_factory=list)


@dataclass(slots=True)
class JobState:
    name: str
    first_seen_unix_s: float
    last_seen_unix_s: float
    world_size: int = 0
    last_step: int | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)


@dataclass(slots=True)
class IncidentState:
    id: int
    kind: str
    severity: str
    state: str
    summary: str
    dedupe_key: str
    opened_unix_s: float
    updated_unix_s: float
    node: str | None = None
    gpu_index: int | None = None
    job: str | None = None
    ranks: list[int] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    count: int = 1
    resolved_unix_s: float | None = None


@dataclass(slots=True)
class CommandState:
    id: str
    node: str
    kind: str
    params: dict[str, Any]
    created_unix_s: float
    status: str = "pending"
    reason: str = ""
    sent_unix_s: float | None = None
    finished_unix_s: float | None = None


@dataclass(slots=True)
class Cursor:
    """Dedupe high-water mark of one agent instance."""

    committed_seq: int = -1
    #: seq -> future of the group commit that will make it durable.
    pending: dict[int, Any] = field(default_factory=dict)

    def highest(self) -> int:
        return max([self.committed_seq, *self.pending])


class ClusterState:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[str, JobState] = {}
        self.cursors: dict[tuple[str, str], Cursor] = {}
        #: Open incidents only; resolved ones live in the database.
        self.incidents: dict[int, IncidentState] = {}
        self.incidents_by_key: dict[str, IncidentState] = {}
        #: Commands not yet finished (pending / sent), by id.
        self.commands: dict[str, CommandState] = {}
        self.started_unix_s = time.time()
        self.reports_total = 0

    # ------------------------------------------------------------------ incidents

    def add_incident(self, incident: IncidentState) -> None:
        self.incidents[incident.id] = incident
        self.incidents_by_key[incident.dedupe_key] = incident

    def drop_incident(self, incident: IncidentState) -> None:
        self.incidents.pop(incident.id, None)
        if self.incidents_by_key.get(incident.dedupe_key) is incident:
            del self.incidents_by_key[incident.dedupe_key]

    def open_incidents_for_node(self, node: str) -> int:
        return sum(1 for i in self.incidents.values() if i.node == node)

    def open_incidents_for_job(self, job: str) -> int:
        return sum(1 for i in self.incidents.values() if i.job == job)

    def incidents_open_by_kind(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for incident in self.incidents.values():
            counts[incident.kind] = counts.get(incident.kind, 0) + 1
        return counts

    # ------------------------------------------------------------------ commands

    def pending_commands(self, node: str) -> Iterator[CommandState]:
        return (c for c in self.commands.values() if c.node == node and c.status == "pending")

    # ------------------------------------------------------------------ summaries

    def nodes_by_health(self) -> dict[str, int]:
        counts = dict.fromkeys(NODE_HEALTH, 0)
        for node in self.nodes.values():
            counts[node.health] = counts.get(node.health, 0) + 1
        return counts

    # ------------------------------------------------------------------ rows

    def row_for(self, key: RowKey) -> dict[str, Any] | None:
        """The full row for a dirty key, or ``None`` if the entity no longer exists."""
        table, pk = key
        if table == "nodes":
            return self._node_row(pk[0])
        if table == "gpus":
            return self._gpu_row(pk[0], pk[1])
        if table == "agent_cursors":
            return self._cursor_row(pk[0], pk[1])
        if table == "jobs":
            return self._job_row(pk[0])
        if table == "ranks":
            return self._rank_row(pk[0], pk[1])
        if table == "commands":
            return self._command_row(pk[0])
        raise KeyError(f"no row builder for table {table!r}")

    def _node_row(self, name: str) -> dict[str, Any] | None:
        n = self.nodes.get(name)
        if n is None:
            return None
        return {
            "name": n.name,
            "hostname": n.hostname,
            "labels": n.labels,
            "backend": n.backend,
            "agent_version": n.agent_version,
            "driver_version": n.driver_version,
            "health": n.health,
            "health_reason": n.health_reason,
            "gpu_count": len(n.gpus),
            "power_w": n.power_w,
            "spool_dropped_total": n.spool_dropped_total,
            "first_seen_unix_s": n.first_seen_unix_s,
            "last_report_unix_s": n.last_report_unix_s,
            "isolated_reason": n.isolated_reason,
            "isolated_unix_s": n.isolated_unix_s,
        }

    def _gpu_row(self, node: str, index: int) -> dict[str, Any] | None:
        n = self.nodes.get(node)
        g = None if n is None else n.gpus.get(index)
        if g is None:
            return None
        return {
            "node_name": node,
            "index": g.index,
            "uuid": g.uuid,
            "name": g.name,
            "pci_bus_id": g.pci_bus_id,
            "memory_total_bytes": g.memory_total_bytes,
            "health": g.health,
            "health_reason": g.health_reason,
            "ecc_uncorrected_total": g.ecc_uncorrected_total,
        }

    def _cursor_row(self, node: str, instance: str) -> dict[str, Any] | None:
        cursor = self.cursors.get((node, instance))
        if cursor is None:
            return None
        return {
            "node_name": node,
            "agent_instance": instance,
            "last_seq": cursor.highest(),
            "updated_unix_s": time.time(),
        }

    def _job_row(self, name: str) -> dict[str, Any] | None:
        j = self.jobs.get(name)
        if j is None:
            return None
        return {
            "name": j.name,
            "world_size": j.world_size,
            "last_step": j.last_step,
            "first_seen_unix_s": j.first_seen_unix_s,
            "last_seen_unix_s": j.last_seen_unix_s,
        }

    def _rank_row(self, job: str, rank: int) -> dict[str, Any] | None:
        j = self.jobs.get(job)
        r = None if j is None else j.ranks.get(rank)
        if r is None:
            return None
        return {
            "job_name": job,
            "rank": r.rank,
            "node_name": r.node,
            "gpu_index": r.gpu_index,
            "local_rank": r.local_rank,
            "pid": r.pid,
            "state": r.state,
            "exit_code": r.exit_code,
            "last_step": r.last_step,
            "last_seen_unix_s": r.last_seen_unix_s,
        }

    def _command_row(self, command_id: str) -> dict[str, Any] | None:
        c = self.commands.get(command_id)
        if c is None:
            return None
        return {
            "id": c.id,
            "node_name": c.node,
            "kind": c.kind,
            "params": c.params,
            "status": c.status,
            "reason": c.reason,
            "created_unix_s": c.created_unix_s,
            "sent_unix_s": c.sent_unix_s,
            "finished_unix_s": c.finished_unix_s,
        }
