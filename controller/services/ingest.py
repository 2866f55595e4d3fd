"""Report ingest: validate, dedupe, update the in-memory state, group-commit, acknowledge.

Path of one report (all on the event loop except the commit)::

    bytes --validate--> Report --dedupe--> apply to ClusterState --> Contribution
       --> GroupCommitWriter (one transaction for many reports, on the writer thread)
       --> on commit: cursor advances, counters, NodeReported (detectors) --> ReportReply

Dedupe is per ``(node, agent_instance)``: a ``seq`` at or below the committed high-water mark
is a duplicate (200, ``duplicate: true``, nothing counted); a retry of a report still being
committed waits for that commit and gets the same answer. A new ``agent_instance`` starts a
new cursor. If the commit fails the report's pending mark is removed, so the agent's retry is
accepted, and the request gets 503.

Peer groups: current job-side code names a rank's peer group by id in its step summaries
and declares the membership (``wire.PeerGroup``) once per registration. Ingest keeps the
memberships (in memory, per job and id) and fills ``StepSummary.group_ranks`` back in before
anything else sees the report, so the detectors read summaries as older agents sent them
(those carry the list and are taken as they are). An id this controller does not know (it
restarted since the declaration) leaves the list empty and goes back in the reply
(``peer_groups_unknown``); the agent then sends the membership again.

History is downsampled here: the samples of one report become one ``gpu_history`` row per
GPU (count, averages and maxima over the report window), so the database grows with
reports, not samples.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import ValidationError

from controller.db.keys import CommandKey, CursorKey, GpuKey, JobKey, NodeKey, RankKey, RowKey
from controller.db.models import Base, Checkpoint, GpuHistory
from controller.errors import ControllerError, InvalidInput, MalformedBody, StoreUnavailable
from controller.logic.world_size import WorldSize, outside_world
from controller.services.commands import to_wire
from controller.services.events import EventBus, JobRecordsReported, NodeReported
from controller.services.metrics import ControllerMetrics
from controller.state import (
    ClusterState,
    CommandState,
    Cursor,
    GpuState,
    JobState,
    NodeState,
    RankState,
)
from controller.validation import from_pydantic, unstorable_field
from controller.writer import Contribution, GroupCommitWriter
from trainguard import wire

log = logging.getLogger(__name__)

#: Peer-group memberships kept (per job and id; a job has one per pipeline stage or role).
MAX_PEER_GROUPS = 100_000


def parse_report(body: bytes) -> wire.Report:
    try:
        report = wire.Report.model_validate_json(body)
    except ValidationError as exc:
        message, errors = from_pydantic(exc)
        if errors and errors[0]["type"] == "json_invalid":
            raise MalformedBody(message, errors=errors) from exc
        raise InvalidInput(message, errors=errors) from exc
    problem = unstorable_field(report, body)
    if problem is not None:
        raise InvalidInput(problem)
    return report


class IngestService:
    def __init__(
        self,
        state: ClusterState,
        writer: GroupCommitWriter,
        metrics: ControllerMetrics,
        events: EventBus,
    ) -> None:
        self._state = state
        self._writer = writer
        self._metrics = metrics
        #: Each durable report is announced here (:class:`NodeReported`, and
        #: :class:`JobRecordsReported` when it carries job records); detectors subscribe.
        self._events = events
        #: (job, peer group id) -> its ranks, shared by every summary that names it.
        self._peer_groups: dict[tuple[str, str], list[int]] = {}
        #: job -> the world size its ranks' recent reports agree on (:mod:`..world_size`)
        self._world: dict[str, WorldSize] = {}
        state.job_forgotten.append(self._forget_job)

    def _forget_job(self, job: str) -> None:
        """A job dropped from memory (``ClusterState.forget_job``): its world-size claims and
        peer groups go too, so a job of the same name later starts from its own claims."""
        self._world.pop(job, None)
        for key in [k for k in self._peer_groups if k[0] == job]:
            del self._peer_groups[key]

    async def ingest(self, report: wire.Report) -> wire.ReportReply:
        started = time.perf_counter()
        key = (report.node.name, report.agent_instance)
        cursor = self._state.cursors.get(key)
        if cursor is not None:
            if report.seq <= cursor.committed_seq:
                return self._duplicate(report)
            in_flight = cursor.pending.get(report.seq)
            if in_flight is not None:
                # The same report is being committed (a retry raced the original).
                try:
                    await asyncio.shield(in_flight)
                except Exception as exc:
                    raise _unavailable(exc) from exc
                return self._duplicate(report)
            highest = cursor.highest()
            if report.seq > highest + 1:
                self._metrics.seq_gaps.inc(report.seq - highest - 1)
        else:
            cursor = self._state.cursors[key] = Cursor()

        # Memory changes now (the batch reads its rows from memory); if the commit fails,
        # this puts it back, so the API never serves what the database does not hold.
        unknown = self._resolve_peer_groups(report.job)
        snapshot = self._state.snapshot(report)
        received = time.time()
        upserts: set[RowKey] = set()
        node = self._apply_node(report, received, upserts)
        inserts: dict[type[Base], list[dict[str, Any]]] = {GpuHistory: _history_rows(report)}
        self._apply_jobs(report, received, upserts, inserts)
        self._apply_acks(report, upserts)
        sent = self._take_commands(node.name, received, upserts)
        upserts.add(CursorKey(*key))
        n_samples = sum(len(s.gpus) for s in report.samples)
        observed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def committed() -> None:
            cursor.pending.pop(report.seq, None)
            cursor.committed_seq = max(cursor.committed_seq, report.seq)
            self._state.reports_total += 1
            self._metrics.reports.inc()
            self._metrics.gpu_samples.inc(n_samples)
            task = asyncio.ensure_future(self._observe(report, received))
            task.add_done_callback(lambda t: observed.set_result(None))

        def failed(exc: BaseException) -> None:
            cursor.pending.pop(report.seq, None)
            self._metrics.failed.inc()
            for command in sent:  # not delivered after all
                command.status, command.sent_unix_s = "pending", None
            self._state.restore(snapshot)

        future = self._writer.submit(
            Contribution(inserts=inserts, upserts=upserts, on_commit=committed, on_failure=failed)
        )
        cursor.pending[report.seq] = future
        try:
            await asyncio.shield(future)
        except Exception as exc:
            raise _unavailable(exc) from exc
        await asyncio.shield(observed)
        self._metrics.latency.observe(time.perf_counter() - started)
        return wire.ReportReply(
            seq=report.seq,
            commands=[to_wire(c) for c in sent],
            server_unix_s=time.time(),
            peer_groups_unknown=unknown,
        )

    def _duplicate(self, report: wire.Report) -> wire.ReportReply:
        self._metrics.duplicates.inc()
        return wire.ReportReply(seq=report.seq, duplicate=True, server_unix_s=time.time())

    async def _observe(self, report: wire.Report, received: float) -> None:
        """Announce the durable report; the reply waits (bounded, see
        :mod:`controller.services.events`) until the consumers keeping up have seen it."""
        deliveries = [self._events.deliver(NodeReported(report, received))]
        if not report.job.is_empty():
            deliveries.append(self._events.deliver(JobRecordsReported(report, received)))
        await asyncio.gather(*deliveries)

    # ------------------------------------------------------------------ state updates

    def _resolve_peer_groups(self, records: wire.JobRecords) -> list[wire.PeerGroupRef]:
        """Learn the declared memberships, fill ``group_ranks`` of the summaries that name
        a known one, and return the ids named but unknown (at most one ref each)."""
        groups = self._peer_groups
        for group in records.peer_groups:
            key = (group.job, group.id)
            groups.pop(key, None)
            groups[key] = sorted(set(group.ranks))
        while len(groups) > MAX_PEER_GROUPS:
            groups.pop(next(iter(groups)))
        unknown: dict[tuple[str, str], wire.PeerGroupRef] = {}
        for step in records.steps:
            gid = step.peer_group
            if gid is None or step.group_ranks:
                continue
            key = (step.job, gid)
            ranks = groups.get(key)
            if ranks is not None:
                step.group_ranks = ranks  # one list per group, however many summaries
            elif key not in unknown:
                unknown[key] = wire.PeerGroupRef(job=step.job, id=gid)
        return list(unknown.values())[:4_096]

    def _apply_node(self, report: wire.Report, received: float, upserts: set[RowKey]) -> NodeState:
        ident = report.node
        node = self._state.nodes.get(ident.name)
        if node is None:
            node = self._state.nodes[ident.name] = NodeState(
                name=ident.name, first_seen_unix_s=received, health="healthy"
            )
            log.info("new node", extra={"fields": {"node": ident.name}})
        elif node.health == "unknown":
            node.health = "healthy"
        node.hostname = ident.hostname
        node.labels = dict(ident.labels)
        node.backend = ident.backend
        node.agent_version = ident.agent_version
        node.driver_version = ident.driver_version
        node.spool_dropped_total = report.spool_dropped_total
        node.last_report_unix_s = received
        node.last_seen_unix_s = received
        upserts.add(NodeKey(node.name))
        for info in ident.gpus:
            gpu = node.gpus.get(info.index)
            if gpu is None:
                gpu = node.gpus[info.index] = GpuState(index=info.index)
            inventory = (info.uuid, info.name, info.pci_bus_id, info.memory_total_bytes)
            if inventory != (gpu.uuid, gpu.name, gpu.pci_bus_id, gpu.memory_total_bytes):
                gpu.uuid, gpu.name, gpu.pci_bus_id, gpu.memory_total_bytes = inventory
                upserts.add(GpuKey(node.name, info.index))
        if report.samples:
            last = max(report.samples, key=lambda s: s.time_unix_s)
            node.power_w = last.node_power_w
            for sample in last.gpus:
                gpu = node.gpus.get(sample.index)
                if gpu is None:
                    gpu = node.gpus[sample.index] = GpuState(index=sample.index, uuid=sample.uuid)
                    upserts.add(GpuKey(node.name, sample.index))
                gpu.latest = sample
            self._first_ecc_baselines(report, node, upserts)
        return node

    @staticmethod
    def _first_ecc_baselines(report: wire.Report, node: NodeState, upserts: set[RowKey]) -> None:
        """A GPU's first uncorrectable-ECC value is its baseline (the health detector judges
        the next value against it, also after a restart). Set with the report's own data, it
        is written in the report's group commit and undone with it if that fails, so the
        baseline shown is always a stored one and many first reports still share one
        transaction; later changes are the detector's (a fault, or a reset: written, then
        shown)."""
        missing = {i: g for i, g in node.gpus.items() if g.ecc_uncorrected_total is None}
        for sample in report.samples:
            if not missing:
                return  # the common case: every baseline known, one pass over the GPUs
            for g in sample.gpus:
                gpu = missing.get(g.index)
                if gpu is not None and g.ecc_uncorrected_total is not None:
                    gpu.ecc_uncorrected_total = g.ecc_uncorrected_total
                    upserts.add(GpuKey(node.name, g.index))
                    del missing[g.index]

    def _apply_jobs(
        self,
        report: wire.Report,
        received: float,
        upserts: set[RowKey],
        inserts: dict[type[Base], list[dict[str, Any]]],
    ) -> None:
        records = report.job
        if records.is_empty():
            return
        node_name = report.node.name
        for step in records.steps:
            job, rank = self._rank(step.job, step.rank, node_name, received, upserts)
            self._world_size(job, step.rank, step.world_size, received)
            rank.last_step = step.step if rank.last_step is None else max(rank.last_step, step.step)
            job.last_step = step.step if job.last_step is None else max(job.last_step, step.step)
            if step.gpu_index is not None:
                rank.gpu_index = step.gpu_index
            if step.local_rank is not None:
                rank.local_rank = step.local_rank
            if rank.state not in ("exited", "failed"):
                rank.state = "running"
        for event in records.rank_events:
            job, rank = self._rank(event.job, event.rank, node_name, received, upserts)
            if event.world_size:
                started = event.kind == "started"
                self._world_size(job, event.rank, event.world_size, received, started=started)
            rank.pid = event.pid if event.pid is not None else rank.pid
            if event.gpu_index is not None:
                rank.gpu_index = event.gpu_index
            if event.local_rank is not None:
                rank.local_rank = event.local_rank
            if event.kind == "exited":
                ok = event.exit_code == 0 and event.signal is None
                rank.state = "exited" if ok else "failed"
                rank.exit_code = event.exit_code
                rank.inflight = []
            else:
                rank.state = "running"
                rank.exit_code = None
        inflight_by_rank: dict[tuple[str, int], list[wire.InflightCollective]] = {}
        for item in records.inflight:
            inflight_by_rank.setdefault((item.job, item.rank), []).append(item)
        for (job_name, rank_no), items in inflight_by_rank.items():
            if self._phantom(job_name, rank_no):
                continue  # not the job's: kept nowhere, as detection ignores it too
            _, rank = self._rank(job_name, rank_no, node_name, received, upserts)
            rank.inflight = items
        rows = inserts.setdefault(Checkpoint, [])
        for ckpt in records.checkpoints:
            if self._phantom(ckpt.job, ckpt.rank):
                # What the agent said stays in the history; the job gains no rank from it.
                self._state.jobs[ckpt.job].last_seen_unix_s = received
                upserts.add(JobKey(ckpt.job))
            else:
                self._rank(ckpt.job, ckpt.rank, node_name, received, upserts)
            rows.append(
                {
                    "job_name": ckpt.job,
                    "rank": ckpt.rank,
                    "node_name": node_name,
                    "step": ckpt.step,
                    "kind": ckpt.kind,
                    "tier": ckpt.tier,
                    "blocking_s": ckpt.blocking_s,
                    "duration_s": ckpt.duration_s,
                    "size_bytes": ckpt.size_bytes,
                    "path": ckpt.path,
                    "error": ckpt.error,
                    "time_unix_s": ckpt.time_unix_s,
                }
            )

    def _world_size(
        self, job: JobState, rank: int, claimed: int, received: float, *, started: bool = False
    ) -> None:
        """One rank's claim; the job's world size is what its ranks' recent claims agree
        on, so a restart can shrink it and one stray report cannot set it."""
        world = self._world.get(job.name)
        if world is None:
            world = self._world[job.name] = WorldSize(value=job.world_size)
        job.world_size = world.observe(rank, claimed, received, started=started)

    def _phantom(self, job_name: str, rank_no: int) -> bool:
        """A rank that only in-flight or checkpoint records name, outside the world its
        job's ranks agree on: those records carry no world size the wire could check the rank
        against, and a row for it would show the job a rank it does not have (the dashboard's
        rank table, ``kubectl trainguard jobs``). Ranks the job had before it shrank keep
        their rows and still take their late records."""
        job = self._state.jobs.get(job_name)
        return (
            job is not None and rank_no not in job.ranks and outside_world(rank_no, job.world_size)
        )

    def _rank(
        self, job_name: str, rank_no: int, node: str, received: float, upserts: set[RowKey]
    ) -> tuple[JobState, RankState]:
        job = self._state.jobs.get(job_name)
        if job is None:
            job = self._state.jobs[job_name] = JobState(
                name=job_name, first_seen_unix_s=received, last_seen_unix_s=received
            )
        job.last_seen_unix_s = received
        rank = job.ranks.get(rank_no)
        if rank is None:
            rank = job.ranks[rank_no] = RankState(
                rank=rank_no, node=node, last_seen_unix_s=received
            )
        rank.node = node
        rank.last_seen_unix_s = received
        upserts.add(JobKey(job_name))
        upserts.add(RankKey(job_name, rank_no))
        return job, rank

    def _apply_acks(self, report: wire.Report, upserts: set[RowKey]) -> None:
        for ack in report.command_acks:
            command = self._state.commands.get(ack.command_id)
            if command is None or command.node != report.node.name:
                continue  # unknown, expired long ago, or not this node's: ignore
            if command.status in ("succeeded", "failed", "relayed", "expired"):
                continue
            command.status = ack.status.value
            command.reason = ack.reason
            command.finished_unix_s = ack.finished_unix_s or time.time()
            upserts.add(CommandKey(command.id))
            log.info(
                "command acknowledged",
                extra={"fields": {"command": command.id, "status": command.status}},
            )

    def _take_commands(
        self, node: str, received: float, upserts: set[RowKey]
    ) -> list[CommandState]:
        sent = list(self._state.pending_commands(node))
        for command in sent:
            command.status = "sent"
            command.sent_unix_s = received
            upserts.add(CommandKey(command.id))
        return sent


def _unavailable(exc: BaseException) -> ControllerError:
    """A report that can never be stored is the agent's error (4xx: it sets the report
    aside); a database that did not commit is 503 (the agent retries the same report)."""
    if isinstance(exc, StoreUnavailable):
        return StoreUnavailable(
            f"report not stored: database commit failed ({exc.message})",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, ControllerError):
        return type(exc)(f"report not stored: {exc.message}")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return StoreUnavailable(
        f"report not stored: database commit failed ({type(exc).__name__}: {detail[:200]}); "
        "retry later"
    )


def _history_rows(report: wire.Report) -> list[dict[str, Any]]:
    """One row per GPU summarizing this report's samples of it.

    Written as list comprehensions over each GPU's samples (not a running accumulator per
    field): it runs for every report, and this shape is ~3x cheaper in CPython.
    """
    by_gpu: dict[int, list[wire.GpuSample]] = {}
    times: dict[int, list[float]] = {}
    for sample in report.samples:
        t = sample.time_unix_s
        for g in sample.gpus:
            found = by_gpu.get(g.index)
            if found is None:
                by_gpu[g.index] = [g]
                times[g.index] = [t]
            else:
                found.append(g)
                times[g.index].append(t)
    node = report.node.name
    rows = []
    for index in sorted(by_gpu):
        gs = by_gpu[index]
        power = [g.power_w for g in gs if g.power_w is not None]
        temperature = [g.temperature_c for g in gs if g.temperature_c is not None]
        clock = [g.sm_clock_mhz for g in gs if g.sm_clock_mhz is not None]
        util = [g.utilization_gpu_pct for g in gs if g.utilization_gpu_pct is not None]
        memory = [g.memory_used_bytes for g in gs if g.memory_used_bytes is not None]
        corrected = [g.ecc_corrected_total for g in gs if g.ecc_corrected_total is not None]
        uncorrected = [g.ecc_uncorrected_total for g in gs if g.ecc_uncorrected_total is not None]
        mask = 0
        for g in gs:
            mask |= g.throttle_reasons_mask
        ts = times[index]
        rows.append(
            {
                "node_name": node,
                "gpu_index": index,
                "start_unix_s": min(ts),
                "end_unix_s": max(ts),
                "samples": len(gs),
                "power_w_avg": sum(power) / len(power) if power else None,
                "power_w_max": max(power) if power else None,
                "temperature_c_max": max(temperature) if temperature else None,
                "sm_clock_mhz_avg": sum(clock) / len(clock) if clock else None,
                "utilization_gpu_pct_avg": sum(util) / len(util) if util else None,
                "memory_used_bytes_max": max(memory) if memory else None,
                "ecc_corrected_total": corrected[-1] if corrected else None,
                "ecc_uncorrected_total": uncorrected[-1] if uncorrected else None,
                "throttle_reasons_mask": mask,
            }
        )
    return rows
