"""Rebuild the in-memory state from the database when the controller starts.

Each row becomes its dataclass by column name (``controller.db.repositories._rows``), so a
new column that the dataclass also has is loaded without a line here.
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from controller.db.repositories import commands, incidents, jobs, nodes
from controller.logic.detection.evidence_kinds import parse_evidence
from controller.logic.remediation.preflight import PREFLIGHT_KIND
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
    for n in nodes.load_nodes(session):
        state.nodes[n.name] = NodeState(
            **nodes.NODE.fields(n, NodeState),
            # Silence is counted from our own start: the controller being down is not the
            # agents' fault, and their spools are about to resend.
            last_seen_unix_s=now if n.health != "lost" else (n.last_report_unix_s or 0.0),
        )
    for g in nodes.load_gpus(session):
        node = state.nodes.get(g.node_name)
        if node is not None:
            node.gpus[g.index] = GpuState(**nodes.GPU.fields(g, GpuState))
    for c in nodes.load_cursors(session):
        state.cursors[(c.node_name, c.agent_instance)] = Cursor(committed_seq=c.last_seq)
    for j in jobs.load_jobs(session):
        state.jobs[j.name] = JobState(**jobs.JOB.fields(j, JobState))
    for r in jobs.load_ranks(session):
        job = state.jobs.get(r.job_name)
        if job is not None:
            job.ranks[r.rank] = RankState(**jobs.RANK.fields(r, RankState))
    for i in incidents.load_open(session):
        found = incidents.INCIDENT.fields(i, IncidentState)
        # Typed once, here (an untyped kind or an odd row is kept as stored, never dropped).
        found["evidence"] = parse_evidence(i.kind, i.evidence)
        state.add_incident(IncidentState(**found))
    for cmd in commands.load_unfinished(session):
        state.commands[cmd.id] = CommandState(**commands.COMMAND.fields(cmd, CommandState))
    # The last preflight verdict of each node (placement and quarantine read them from the
    # commands in memory; finished ones leave memory, their rows stay).
    for cmd in commands.load_last_finished(session, PREFLIGHT_KIND):
        state.commands[cmd.id] = CommandState(**commands.COMMAND.fields(cmd, CommandState))
