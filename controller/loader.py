"""Rebuild the in-memory state from the database when the controller starts."""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import AgentCursor, Command, Gpu, Incident, Job, Node, Rank
from controller.state import (
    ClusterState,
    CommandState,
    Cursor,
    GpuState,
    IncidentState,
    JobState,
    NodeState,
    RankState,
)


def load_state(session: Session, state: ClusterState) -> None:
    now = time.time()
    for n in session.execute(select(Node)).scalars():
        state.nodes[n.name] = NodeState(
            name=n.name,
            first_seen_unix_s=n.first_seen_unix_s,
            hostname=n.hostname,
            labels=dict(n.labels),
            backend=n.backend,
            agent_version=n.agent_version,
            driver_version=n.driver_version,
            health=n.health,
            health_reason=n.health_reason,
            isolated_reason=n.isolated_reason,
            isolated_unix_s=n.isolated_unix_s,
            power_w=n.power_w,
            spool_dropped_total=n.spool_dropped_total,
            last_report_unix_s=n.last_report_unix_s,
            # Silence is counted from our own start: the controller being down is not the
            # agents' fault, and their spools are about to resend.
            last_seen_unix_s=now if n.health != "lost" else (n.last_report_unix_s or 0.0),
        )
    for g in session.execute(select(Gpu)).scalars():
        node = state.nodes.get(g.node_name)
        if node is not None:
            node.gpus[g.index] = GpuState(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                pci_bus_id=g.pci_bus_id,
                memory_total_bytes=g.memory_total_bytes,
                health=g.health,
                health_reason=g.health_reason,
                ecc_uncorrected_total=g.ecc_uncorrected_total,
            )
    for c in session.execute(select(AgentCursor)).scalars():
        state.cursors[(c.node_name, c.agent_instance)] = Cursor(committed_seq=c.last_seq)
    for j in session.execute(select(Job)).scalars():
        state.jobs[j.name] = JobState(
            name=j.name,
            first_seen_unix_s=j.first_seen_unix_s,
            last_seen_unix_s=j.last_seen_unix_s,
            world_size=j.world_size,
            last_step=j.last_step,
        )
    for r in session.execute(select(Rank)).scalars():
        job = state.jobs.get(r.job_name)
        if job is not None:
            job.ranks[r.rank] = RankState(
                rank=r.rank,
                node=r.node_name,
                last_seen_unix_s=r.last_seen_unix_s,
                gpu_index=r.gpu_index,
                local_rank=r.local_rank,
                pid=r.pid,
                state=r.state,
                exit_code=r.exit_code,
                last_step=r.last_step,
            )
    for i in session.execute(select(Incident).where(Incident.state == "open")).scalars():
        state.add_incident(
            IncidentState(
                id=i.id,
                kind=i.kind,
                severity=i.severity,
                state=i.state,
                summary=i.summary,
                dedupe_key=i.dedupe_key,
                opened_unix_s=i.opened_unix_s,
                updated_unix_s=i.updated_unix_s,
                node=i.node_name,
                gpu_index=i.gpu_index,
                job=i.job_name,
                ranks=list(i.ranks),
                evidence=dict(i.evidence),
                count=i.count,
            )
        )
    query = select(Command).where(Command.status.in_(("pending", "sent")))
    for cmd in session.execute(query).scalars():
        state.commands[cmd.id] = CommandState(
            id=cmd.id,
            node=cmd.node_name,
            kind=cmd.kind,
            params=dict(cmd.params),
            created_unix_s=cmd.created_unix_s,
            status=cmd.status,
            reason=cmd.reason,
            sent_unix_s=cmd.sent_unix_s,
            finished_unix_s=cmd.finished_unix_s,
        )
