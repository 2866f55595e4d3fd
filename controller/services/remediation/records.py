"""What the remediation engine keeps per remediation and per job, and what it reads from an
incident's evidence (its culprit node, when its fault began)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.logic.detection.c4d.job_evidence import (
    HangEvidence,
    JobEvidence,
    LegacyStragglerEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.incident_evidence import DegradedEvidence, NodeLostEvidence
from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.params import RestartParams
from controller.state import ClusterState, IncidentState, JobState

#: Incident kinds that are hardware evidence against the node they name.
HARDWARE_KINDS = frozenset({"gpu_fault", "node_lost"})


@dataclass(slots=True)
class Remediation:
    id: str
    #: ``None`` for a grow-back restart, which no incident triggers.
    incident_id: int | None
    incident_kind: str
    job: str | None
    node: str | None
    steps: list[str]
    started_unix_s: float
    dry_run: bool
    #: The trigger of its action rows: ``incident:<id>``, or ``grow:<job>`` for a grow-back.
    trigger: str = ""
    #: A grow-back restart (capacity returned), not a response to an incident.
    grow: bool = False
    state: str = "running"  # running | done | failed
    outcome: str = ""
    finished_unix_s: float | None = None
    #: After a restart: the generation started and when its first step arrived.
    generation: int | None = None
    restarted_unix_s: float | None = None
    resumed_unix_s: float | None = None
    resume_step: int | None = None
    #: The restart's action row and its parameters (updated when the job resumes).
    restart_action: int | None = None
    restart_params: RestartParams | None = None
    #: The job's own policy asked for a dry run: its plan waits for a human (``approve``).
    awaiting_approval: bool = False
    #: Who approved the plan this remediation carries out (``None``: no approval needed).
    approved_by: str | None = None
    #: The job's other slow nodes its ``isolate`` step took on too (or would, in a dry
    #: run), so that the job restarts once without all of them (``steps.batch``).
    batch: list[str] = field(default_factory=list)
    #: Nodes its dry-run ``isolate`` step would have isolated: its would-be restart plans
    #: without them, as the real one would (nothing is isolated in a dry run).
    would_isolate: list[str] = field(default_factory=list)

    @property
    def ledger_id(self) -> str:
        """The goodput ledger's name for what this remediation costs the job."""
        return str(self.incident_id) if self.incident_id is not None else f"grow:{self.id}"

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "trigger": self.trigger,
            "incident": self.incident_id,
            "incident_kind": self.incident_kind,
            "job": self.job,
            "node": self.node,
            "steps": self.steps,
            "dry_run": self.dry_run,
            "state": self.state,
            "outcome": self.outcome,
            "started_unix_s": self.started_unix_s,
            "finished_unix_s": self.finished_unix_s,
            "generation": self.generation,
            "resume_step": self.resume_step,
            "restarted_unix_s": self.restarted_unix_s,
            "resumed_unix_s": self.resumed_unix_s,
            "awaiting_approval": self.awaiting_approval,
            "approved_by": self.approved_by,
        }


@dataclass(slots=True)
class JobBook:
    """What the engine tracks per job between reports."""

    ledger: GoodputLedger
    #: Newest committed checkpoint: (step, controller time it was reported).
    checkpoint: tuple[int, float] | None = None
    running: Remediation | None = None
    #: Set by a restart; cleared when the first step of the new generation arrives.
    awaiting_resume: Remediation | None = None
    last_restart_unix_s: float | None = None
    #: When the newest remediation of the job began: incidents opened after it are its
    #: consequences (ranks stopped, peers timing out) until the job has settled.
    last_remediation_unix_s: float | None = None
    resumed_unix_s: float | None = None
    culprits: dict[str, list[float]] = field(default_factory=dict)
    #: When the newest committed checkpoint was committed (any step: after a rollback the
    #: steps start lower again), for the "checkpoints not durable" alert.
    committed_unix_s: float | None = None
    #: Seconds between the two newest commits: the job's checkpoint interval as observed.
    checkpoint_interval_s: float | None = None
    #: End of the newest step rank 0 reported: a job is running while this keeps moving.
    last_step_unix_s: float | None = None
    #: The newest restart trainguard made of the job (kept after its resume wait ends, in
    #: success or timeout): where the actuator last put the job.
    last_restart: Remediation | None = None

    @property
    def in_flight(self) -> bool:
        """A remediation of the job runs, or its restart waits for the first step: the job
        must stay in memory until that is over (``job_retention``)."""
        return self.running is not None or self.awaiting_resume is not None

    def restarted_since(self, t: float | None) -> bool:
        """Whether a restart of this job began at or after ``t`` (``None``: no such time).

        The one reading of "a restart already covered this": the engine absorbs a job's
        incident opened after a remediation began only if that remediation went on to
        restart the job (``t`` = when it began), and the restart step skips an incident the
        job was restarted after anyway (``t`` = when the incident opened). Both ask it of
        this book so that they cannot drift apart (a ``>`` in one and ``>=`` in the other).
        """
        return (
            t is not None and self.last_restart_unix_s is not None and self.last_restart_unix_s >= t
        )

    def placement_in_flight(self) -> list[str] | None:
        """The nodes the restart awaiting resume placed the job on (``None``: no restart in
        flight, or one whose placement is not known). Until the new generation reports, its
        ranks still name the old nodes: this is where the job runs."""
        waiting = self.awaiting_resume
        params = waiting.restart_params if waiting is not None else None
        return params.nodes if params is not None else None

    def left(self, node: str) -> Remediation | None:
        """The newest restart if its placement left out ``node`` (``None``: no restart, its
        placement unknown, or it kept ``node``). Ranks on ``node`` last heard of before that
        restart are the old generation's, not where the job runs (:func:`jobs_of`)."""
        rem = self.last_restart
        params = rem.restart_params if rem is not None else None
        if rem is None or params is None or params.nodes is None or node in params.nodes:
            return None
        return rem

    def superseded_by(self, incident: IncidentState) -> Remediation | None:
        """The restart in flight that a hardware fault on one of its new nodes dooms: the job
        cannot resume there, so the incident is remediated now rather than after the resume
        timeout (``None``: nothing to supersede, or a remediation is still running)."""
        nodes = self.placement_in_flight()
        if (
            self.running is None
            and nodes is not None
            and incident.kind in HARDWARE_KINDS
            and incident.node in nodes
        ):
            return self.awaiting_resume
        return None

    def covered(self, incident: IncidentState) -> Remediation | None:
        """The newest restart if it already answered ``incident``: begun after the incident
        opened, on a placement without the incident's node (``None``: no such restart).

        A slow 8-GPU node opens eight straggler incidents within seconds, one per rank; the
        first one's restart moves the job off the node, and the other seven are about a
        node the job has left. Without this each of them, once the job resumed, ran its own
        checkpoint, isolate and (skipped) restart, one after another."""
        rem = self.last_restart
        params = rem.restart_params if rem is not None else None
        node = incident.node
        if rem is None or params is None or params.nodes is None or node is None:
            return None
        started = rem.restarted_unix_s
        if node in params.nodes or started is None or started < incident.opened_unix_s:
            return None
        return rem

    def committed(self, t: float) -> None:
        """Record a commit at job time ``t`` (events may arrive late or out of order)."""
        if self.committed_unix_s is not None:
            if t <= self.committed_unix_s:
                return
            self.checkpoint_interval_s = t - self.committed_unix_s
        self.committed_unix_s = t

    def deleted(self, step: int) -> None:
        """Retention removed ``step``. When it is :attr:`checkpoint` (possible only after a
        rollback, when steps start lower again), no step is named as the newest any more
        rather than one that is gone; the job's next commit names one again."""
        if self.checkpoint is not None and self.checkpoint[0] == step:
            self.checkpoint = None


def absorb_note(incident: IncidentState, by: Remediation | None, *, covered: bool) -> str:
    """Why an incident is resolved as part of a remediation it did not start (``covered``:
    that remediation's restart already moved the job off its node, :meth:`JobBook.covered`)."""
    if by is None:
        return "absorbed: raised while the job settled after a restart trainguard made"
    if covered:
        return (
            f"absorbed: covered by remediation {by.id} of job {by.job} (incident "
            f"{by.incident_id}), whose restart moved the job off {incident.node}"
        )
    return f"absorbed: a consequence of remediation {by.id} of job {by.job}"


def culprit_node(incident: IncidentState) -> str | None:
    """The one node an incident names (itself, or a single node in its evidence)."""
    if incident.node is not None:
        return incident.node
    evidence = incident.evidence
    if isinstance(evidence, JobEvidence) and evidence.nodes and len(evidence.nodes) == 1:
        return evidence.nodes[0]
    return None


def straggler_cost(incident: IncidentState) -> float | None:
    """How much a straggler incident slows its job, in percent (``None``: not a straggler):
    the number a rule's ``min_cost_pct`` is compared with."""
    evidence = incident.evidence
    if isinstance(evidence, StragglerIncidentEvidence | LegacyStragglerEvidence):
        return evidence.slowdown_pct
    return None


def dry_plan_for(
    remediations: Iterable[Remediation],
    incident: IncidentState,
    state: ClusterState,
    *,
    dry_run_now: bool,
) -> Remediation | None:
    """A dry run already recorded for ``incident``'s job and node, its incident still open
    and the dry run still in force (a plan awaiting approval, or the controller's policy
    still ``dry_run_now``; ``None``: none), for its node or one it batched (another slow
    node of the job). Such a dry run acts on nothing, so no restart
    covers a slow node's other ranks' incidents (:meth:`JobBook.covered`): without this
    each of them recorded the same plan again, eight approval rows for one node. They
    wait instead: an approved plan's restart covers them, and if the first incident
    resolves unapproved (or the dry run ends), the next one plans or acts anew."""
    node = culprit_node(incident)
    for rem in reversed(list(remediations)):
        if (
            (rem.awaiting_approval or (rem.dry_run and dry_run_now))
            and not rem.grow
            and rem.job == incident.job
            and node is not None
            and (rem.node == node or node in rem.batch)
            and rem.incident_id != incident.id
            and rem.incident_id in state.incidents
        ):
            return rem
    return None


def fault_time(incident: IncidentState) -> float:
    """When the fault began, as far as the evidence tells (else when it was opened):
    the goodput ledger charges detection delay from here."""
    evidence = incident.evidence
    opened = incident.opened_unix_s
    candidates: list[float] = []
    match evidence:
        case DegradedEvidence(since_unix_s=float() as since):  # the first cause's onset
            candidates.append(since)
        case NodeLostEvidence(last_report_unix_s=float() as last):
            candidates.append(last)
        case HangEvidence(elapsed_s=elapsed):  # time the peers have been waiting
            candidates.append(opened - elapsed)
    # The occurrences folded in (e.g. the XIDs of a gpu_fault).
    candidates += [e.time_unix_s for e in evidence.events or ()]
    valid = [t for t in candidates if 0 < t <= opened]
    return min(valid) if valid else opened


def jobs_of(
    state: ClusterState, incident: IncidentState, books: Mapping[str, JobBook] | None = None
) -> list[str]:
    """The jobs an incident concerns: its own, or those on its node.

    A job is on a node when it runs a rank there, or when its restart awaiting resume
    placed it there (``books``): the new generation has not reported ranks yet. While that
    placement is known, the ranks of the old generation no longer count for an incident
    opened after that restart: a node the restart left is not the job's any more. (One
    opened before it still concerns the job: its restart step says the job already
    restarted without the node.) After the wait (resumed or timed out) a rank on the node
    counts only if heard of since the newest restart left the node (:func:`has_rank_on`).
    """
    if incident.job is not None:
        return [incident.job]
    node = incident.node
    if node is None:
        return []
    placed: set[str] = set()
    moved: set[str] = set()
    for name, book in (books or {}).items():
        nodes = book.placement_in_flight()
        if nodes is None:
            continue
        if node in nodes:
            placed.add(name)
        elif not book.restarted_since(incident.opened_unix_s):
            moved.add(name)  # opened after the job left the node
    ranked = {
        job.name
        for job in state.jobs.values()
        if job.name not in moved
        and has_rank_on(job, node, (books or {}).get(job.name), incident.opened_unix_s)
    }
    return sorted(placed | ranked)


def has_rank_on(job: JobState, node: str, book: JobBook | None, opened_unix_s: float) -> bool:
    """Whether ``job`` runs a rank on ``node`` for an incident opened at ``opened_unix_s``:
    a running rank there, heard of after the newest restart that moved the job off
    ``node`` if the incident opened after that restart (a restart that never resumed leaves
    the old generation's ranks ``running`` in the state: they are not where the job runs).
    One opened before it still concerns the job (:func:`jobs_of`)."""
    left = book.left(node) if book is not None else None
    since = left.restarted_unix_s if left is not None else None
    if since is not None and opened_unix_s < since:
        since = None
    return running_on(job, node, heard_after=since)


def running_on(job: JobState, node: str, *, heard_after: float | None = None) -> bool:
    """Whether the state holds a ``running`` rank of ``job`` on ``node`` (heard of after
    ``heard_after``, when given). Without it: whichever generation the rank is of, the
    question the restart step asks to name a job a restart moved off ``node``."""
    return any(
        r.node == node
        and r.state == "running"
        and (heard_after is None or r.last_seen_unix_s > heard_after)
        for r in job.ranks.values()
    )
