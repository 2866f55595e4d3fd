"""Where a (re)started job runs: the one value the restart planner and every actuator share.

Pure data, so the planner (``controller.logic``) and the actuators both use it without the
logic depending on any actuator.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        if self.ranks_per_node < 1 or self.tp < 1:
            # Said apart from divisibility: "tp=1 must divide ranks_per_node=0" is true of
            # the numbers and hides what is wrong with them.
            raise ValueError(
                f"placement of job {self.job!r}: ranks_per_node={self.ranks_per_node} and "
                f"tp={self.tp} must both be >= 1"
            )
        if self.ranks_per_node % self.tp:
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
