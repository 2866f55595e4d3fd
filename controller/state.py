"""The cluster as the controller sees it right now, held in memory.

Every report updates this state on the event loop (one thread, so no locks); the database is
written behind it by the group-commit writer, and API reads of "latest" things (nodes, GPUs,
jobs, status) answer from here without touching the database. At start the state is loaded
back from the database, so a restarted controller keeps inventory, health, dedupe cursors,
open incidents and undelivered commands.

``row_for`` turns a typed dirty key (:mod:`controller.db.keys`, e.g. ``NodeKey(name)``) into
the full row to upsert, read at flush time so a batch always writes the newest values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, assert_never

from controller.db.keys import CommandKey, CursorKey, GpuKey, JobKey, NodeKey, RankKey, RowKey
from controller.db.repositories import commands as repo_commands
from controller.db.repositories import jobs as repo_jobs
from controller.db.repositories import nodes as repo_nodes
from controller.logic.detection.incident_evidence import IncidentEvidence
from trainguard import wire

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
    def gpu_count(self) -> int:
        return len(self.gpus)

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
    #: Typed by kind, parsed once where it enters memory (the loader, the incident
    #: service: ``evidence_kinds.parse_evidence``); an untyped kind or a row that does not
    #: fit its model is an ``UntypedEvidence``. The row stores ``evidence.as_json()``.
    evidence: IncidentEvidence = field(default_factory=IncidentEvidence)
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


#: Node fields a report's undo leaves alone: isolation has a write path of its own (written
#: before it is shown), and ``last_seen_unix_s`` is liveness, not stored state (a node whose
#: reports reach us while the database is away is not lost).
KEPT_ON_UNDO = frozenset({"isolated_reason", "isolated_unix_s", "last_seen_unix_s"})


#: Saved field values of one object, in the order :func:`_fields_of` lists them.
_Saved = tuple[Any, ...]


_FIELDS: dict[tuple[type, frozenset[str]], tuple[tuple[str, ...], attrgetter[Any]]] = {}


def _fields_of(cls: type, skip: frozenset[str]) -> tuple[tuple[str, ...], attrgetter[Any]]:
    found = _FIELDS.get((cls, skip))
    if found is None:
        names = tuple(f.name for f in fields(cls) if f.name not in skip)
        found = _FIELDS[(cls, skip)] = (names, attrgetter(*names))
    return found


def _save(obj: Any, skip: frozenset[str] = frozenset()) -> _Saved:
    saved: _Saved = _fields_of(type(obj), skip)[1](obj)
    return saved


def _put_back(obj: Any, saved: _Saved, skip: frozenset[str] = frozenset()) -> None:
    for name, value in zip(_fields_of(type(obj), skip)[0], saved, strict=True):
        setattr(obj, name, value)


_NODE_SKIP = KEPT_ON_UNDO | {"gpus"}
_JOB_SKIP = frozenset({"ranks"})


#: A node as :meth:`ClusterState.save_node` saw it: the node, its fields, its GPU dict and
#: each GPU's fields.
SavedNode = tuple[NodeState, _Saved, dict[int, GpuState], dict[int, _Saved]]


@dataclass(slots=True)
class ReportSnapshot:
    """What one report may change, as it was before: put back if the report is not stored.

    Ingest applies a report to memory before its group commit (the batch reads the newest
    rows from memory); if the commit fails, :meth:`ClusterState.restore` undoes it, so the
    API never serves a report the database does not have. Values are saved as tuples
    (about 1 us per object), since every report takes one.
    """

    node_name: str
    #: ``None``: a new node.
    node: SavedNode | None
    cursor_key: tuple[str, str]
    #: Per job: (the job, its fields, its rank dict, each rank's fields); ``None``: new.
    jobs: dict[str, tuple[JobState, _Saved, dict[int, RankState], dict[int, _Saved]] | None]
    commands: dict[str, tuple[CommandState, _Saved]]


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
        #: Called with a job's name when :meth:`forget_job` drops it: each service that keeps
        #: something per job (detector windows, world-size claims, remediation books)
        #: registers its own ``forget`` here, so a finished job leaves every one of them.
        self.job_forgotten: list[Callable[[str], None]] = []

    # ------------------------------------------------------------------ jobs

    def forget_job(self, name: str) -> None:
        """Drop a job from memory (it stays in the database): ``JobRetention`` calls this
        for jobs quiet longer than ``job_retention_s``, so months of short jobs do not pile
        up. A report naming the job again starts it afresh, as a new job."""
        self.jobs.pop(name, None)
        for forget in self.job_forgotten:
            forget(name)

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

    # ------------------------------------------------------------------ undo

    def save_node(self, name: str | None) -> SavedNode | None:
        """The node's fields and its GPUs' as they are, for :meth:`restore_node`."""
        node = None if name is None else self.nodes.get(name)
        if node is None:
            return None
        gpus = dict(node.gpus)
        return (node, _save(node, _NODE_SKIP), gpus, {i: _save(g) for i, g in gpus.items()})

    def restore_node(self, saved: SavedNode | None) -> None:
        """Put a node (and its GPUs) back as :meth:`save_node` saw it; isolation and
        liveness are left as they are now (see :data:`KEPT_ON_UNDO`)."""
        if saved is None:
            return
        node, fields_, gpus, saved_gpus = saved
        _put_back(node, fields_, _NODE_SKIP)
        node.gpus = gpus
        for index, gpu in gpus.items():
            _put_back(gpu, saved_gpus[index])

    def snapshot(self, report: wire.Report) -> ReportSnapshot:
        """What ``report`` can change, saved (see :class:`ReportSnapshot`)."""
        name = report.node.name
        saved_node = self.save_node(name)
        records = report.job
        jobs: dict[
            str, tuple[JobState, _Saved, dict[int, RankState], dict[int, _Saved]] | None
        ] = {}
        for group in (records.steps, records.rank_events, records.inflight, records.checkpoints):
            for item in group:
                if item.job in jobs:
                    continue
                job = self.jobs.get(item.job)
                if job is None:
                    jobs[item.job] = None
                else:
                    ranks = dict(job.ranks)
                    saved_ranks = {r: _save(rank) for r, rank in ranks.items()}
                    jobs[item.job] = (job, _save(job, _JOB_SKIP), ranks, saved_ranks)
        ids = {ack.command_id for ack in report.command_acks}
        ids |= {c.id for c in self.pending_commands(name)}
        commands = {i: (c, _save(c)) for i in ids if (c := self.commands.get(i)) is not None}
        return ReportSnapshot(
            node_name=name,
            node=saved_node,
            cursor_key=(name, report.agent_instance),
            jobs=jobs,
            commands=commands,
        )

    def restore(self, snap: ReportSnapshot) -> None:
        """Undo a report that was not stored: memory is again what the database holds."""
        if snap.node is None:
            self.nodes.pop(snap.node_name, None)
        else:
            self.restore_node(snap.node)
        cursor = self.cursors.get(snap.cursor_key)
        if cursor is not None and not cursor.pending and cursor.committed_seq < 0:
            del self.cursors[snap.cursor_key]  # nothing of this agent instance is stored
        for job_name, saved_job in snap.jobs.items():
            if saved_job is None:
                self.jobs.pop(job_name, None)
                continue
            job, saved, ranks, saved_ranks = saved_job
            _put_back(job, saved, _JOB_SKIP)
            job.ranks = ranks
            for rank_no, rank in ranks.items():
                _put_back(rank, saved_ranks[rank_no])
        for command, saved in snap.commands.values():
            _put_back(command, saved)

    # ------------------------------------------------------------------ summaries

    def nodes_by_health(self) -> dict[str, int]:
        counts = dict.fromkeys(NODE_HEALTH, 0)
        for node in self.nodes.values():
            counts[node.health] = counts.get(node.health, 0) + 1
        return counts

    # ------------------------------------------------------------------ rows

    def row_for(self, key: RowKey) -> dict[str, Any] | None:
        """The full row for a dirty key, or ``None`` if the entity no longer exists.

        The columns come from the entity's attributes of the same name (the repositories
        map them), so a new column needs only the model and the dataclass field.
        """
        match key:
            case NodeKey(name):
                node = self.nodes.get(name)
                return None if node is None else repo_nodes.node_row(node)
            case GpuKey(node_name, index):
                owner = self.nodes.get(node_name)
                gpu = None if owner is None else owner.gpus.get(index)
                return None if gpu is None else repo_nodes.gpu_row(node_name, gpu)
            case CursorKey(node_name, instance):
                cursor = self.cursors.get((node_name, instance))
                if cursor is None:
                    return None
                return repo_nodes.cursor_row(node_name, instance, cursor.highest(), time.time())
            case JobKey(name):
                job = self.jobs.get(name)
                return None if job is None else repo_jobs.job_row(job)
            case RankKey(job_name, rank_no):
                owner_job = self.jobs.get(job_name)
                rank = None if owner_job is None else owner_job.ranks.get(rank_no)
                return None if rank is None else repo_jobs.rank_row(job_name, rank)
            case CommandKey(command_id):
                command = self.commands.get(command_id)
                return None if command is None else repo_commands.command_row(command)
            case _:  # an untyped key (the old ``("nodes", (name,))``) must not vanish silently
                assert_never(key)


__all__ = [
    "NODE_HEALTH",
    "ClusterState",
    "CommandState",
    "Cursor",
    "GpuState",
    "IncidentState",
    "JobState",
    "NodeState",
    "RankState",
    "ReportSnapshot",
    "RowKey",
]
