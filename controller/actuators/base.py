"""One interface for acting on the world, two implementations.

The policy engine decides what to do; an actuator does it. ``LocalProcessActuator``
(``controller.actuators.local``, the embedded default) runs a job's ranks as local
processes grouped into simulated nodes. ``KubernetesActuator``
(``controller.actuators.kubernetes``) cordons and taints nodes, evicts the job's pods and
restarts Job/JobSet/PyTorchJob-managed training through the official client.

Every method is idempotent: a call repeated after a timeout or a controller failover
converges on the same world (a node cordoned once, one restart per generation) instead of
acting twice. Methods raise :class:`ActuatorError` with a one-line message; the engine
records it as the action's outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from controller.logic.remediation.placement import Placement
from controller.logic.remediation.rules import JobPolicy
from trainguard.wire import RankEvent


class ActuatorError(Exception):
    """An action could not be carried out; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, kw_only=True, slots=True)
class JobLimits:
    """What a job itself allows a restart to do (the policy's ``restarts`` may be stricter)."""

    #: Smallest data-parallel size the job can run at.
    min_dp: int = 1
    #: Every data-parallel size must divide this (the global batch), if set.
    dp_must_divide: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ActuatorResult:
    """What an action did, in one line for the action log, plus structured details."""

    outcome: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeView:
    """What the platform itself says about a node whose agent went silent: the second
    signal the engine needs before it quarantines (a partition is not a dead node)."""

    #: The node's own health check (Kubernetes: the Node's ``Ready`` condition; a deleted
    #: Node is ``False``); ``None``: not known.
    ready: bool | None = None
    #: Whether the training pods (local: rank processes) on it still run; ``None``: none
    #: there, or not known.
    pods_running: bool | None = None


class Actuator(Protocol):
    #: ``"local"`` or ``"kubernetes"``; shown in actions and ``/api/v1/remediation``.
    name: str

    async def candidate_nodes(self, job: str) -> list[str]:
        """Nodes this job may run on, healthy or not, as the actuator sees them.

        Local: the job's declared node pool. Kubernetes: nodes that are not cordoned by
        someone else and carry the job's node-selector labels. The engine removes
        unhealthy and isolated nodes; the restart planner picks from the rest.
        """
        ...

    async def current_placement(self, job: str) -> Placement | None:
        """The placement the actuator last started (``None``: it does not manage the job)."""
        ...

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        """Keep new work off ``node`` (cordon + taint on Kubernetes) and say why."""
        ...

    async def release_node(self, node: str, *, reason: str) -> ActuatorResult:
        """Undo :meth:`isolate_node` (an operator decision, or capacity coming back)."""
        ...

    async def stop_job(self, job: str, *, reason: str) -> ActuatorResult:
        """Stop every rank of ``job`` (graceful first, then forced)."""
        ...

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        """Stop what runs of ``placement.job`` and start it again as ``placement`` says."""
        ...

    async def record_event(
        self, *, target: str, reason: str, message: str, warning: bool = False
    ) -> None:
        """Tell the platform's own event stream (Kubernetes Events; the log locally)."""
        ...

    async def start(self) -> list[Placement]:
        """Start what this actuator was configured to run when its replica starts leading
        (the local actuator's jobs; nothing on Kubernetes). Returns the placements it
        launched now, so the engine knows each job's first size."""
        ...

    def limits(self, job: str) -> JobLimits | None:
        """What ``job`` declares about its own restarts (``None``: nothing beyond policy)."""
        ...

    async def job_policy(self, job: str) -> JobPolicy | None:
        """The job's own policy (Kubernetes: its workload's ``trainguard.io/policy``
        annotation; ``None``: the controller's rule alone). A bad one raises
        :class:`ActuatorError` with a one-line message."""
        ...

    async def node_view(self, node: str) -> NodeView:
        """What the platform says about ``node`` (:class:`NodeView`); may raise
        :class:`ActuatorError` (the engine then counts it as not known)."""
        ...

    def observe_ranks(self, node: str, events: Sequence[RankEvent]) -> None:
        """What ranks on ``node`` said about themselves (Kubernetes: their pod and namespace,
        so the job's placement is learned from the job; the local actuator knows its own)."""
        ...

    async def close(self) -> None:
        """Release clients and, for the local actuator, stop the processes it owns."""
        ...


@runtime_checkable
class ForgetsJobs(Protocol):
    """An actuator that keeps something per job (placements learned from the ranks, a
    workload's limits, a finished generation) and can drop it: called when the controller
    forgets a job (``job_retention_s``, ``controller.services.job_retention``). Optional:
    an actuator without per-job memory need not implement it."""

    def forget_job(self, job: str) -> None:
        """Drop what is kept about ``job``; a job of that name seen later is learned anew.
        Never stops anything: a job still running keeps its processes."""
        ...


__all__ = [
    "Actuator",
    "ActuatorError",
    "ActuatorResult",
    "ForgetsJobs",
    "JobLimits",
    "JobPolicy",
    "NodeView",
    "Placement",
]
