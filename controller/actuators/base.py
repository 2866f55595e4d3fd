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

from dataclasses import dataclass, field
from typing import Any, Protocol


class ActuatorError(Exception):
    """An action could not be carried out; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a (re)started job runs and in what parallel layout.

    Node ``i`` of ``nodes`` hosts ranks ``i * ranks_per_node … (i + 1) * ranks_per_node - 1``,
    so a tensor-parallel group (``tp`` consecutive ranks, ``tp`` dividing
    ``ranks_per_node``) never spans nodes. The data-parallel size is what shrinks when
    there are too few healthy nodes; the ranks reshard the universal checkpoint to it.
    On Kubernetes the scheduler picks the nodes: ``nodes`` is advisory there (cordoned
    nodes are excluded by the cordon itself) and ``world_size`` is what is enforced.
    """

    job: str
    nodes: tuple[str, ...]
    ranks_per_node: int
    tp: int = 1
    #: Restart count, starting at 0 for the first launch; ranks see it as
    #: ``TRAINGUARD_GENERATION`` and an actuator never starts the same generation twice.
    generation: int = 0
    #: The checkpoint step the ranks resume from (``None``: the newest complete one).
    resume_step: int | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError(f"placement of job {self.job!r} has no nodes")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"placement of job {self.job!r} repeats a node: {self.nodes}")
        if self.ranks_per_node < 1 or self.tp < 1 or self.ranks_per_node % self.tp:
            raise ValueError(
                f"placement of job {self.job!r}: tp={self.tp} must divide "
                f"ranks_per_node={self.ranks_per_node}"
            )

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def node_of(self, rank: int) -> str:
        return self.nodes[rank // self.ranks_per_node]


@dataclass(frozen=True, kw_only=True, slots=True)
class ActuatorResult:
    """What an action did, in one line for the action log, plus structured details."""

    outcome: str
    details: dict[str, Any] = field(default_factory=dict)


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

    async def close(self) -> None:
        """Release clients and, for the local actuator, stop the processes it owns."""
        ...
