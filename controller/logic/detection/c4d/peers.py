"""Which ranks are compared with which: peer groups from the roles the ranks report.

The straggler premise (ranks doing the same work take the same time) holds only among
ranks that really do the same work. The last pipeline stage computes the loss; MoE experts
receive uneven token counts; a job may run TP groups of different sizes. Each step summary
carries the rank's ``role`` (declared with ``collectives.instrument(role=...)`` or derived
from its pipeline stage) and ``group_ranks`` (its peers, from the job's DeviceMesh or
declared); ranks that report the same pair are one peer group and are compared only with
each other. Where neither a mesh, a pipeline nor the job says more, ``collectives`` reports
the sizes of the process groups the rank's collectives use (``role="pg_sizes=2,8"``), so
TP groups of different sizes are told apart. A rank that reports none of these is in the
job-wide group (pure data parallelism, the premise C4D and MegaScale start from). A group
of one rank has no peer; the straggler detector compares it with its own history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from trainguard.wire import StepSummary

#: Role ``collectives`` derives from the sizes of a rank's process groups (the same string
#: as ``collectives.roles.PG_SIZES_PREFIX``; the controller does not import collectives).
PG_SIZES_PREFIX = "pg_sizes="


class PeerBasis(StrEnum):
    """Why ranks were put in one group (shown to the operator with the verdict)."""

    #: Their summaries list the same peer ranks (a DeviceMesh stage, or declared), and the
    #: same role if any.
    GROUP_RANKS = "group_ranks"
    #: Same role (declared, or ``pp_stage=<n>`` derived from pipelining), no member list.
    ROLE = "role"
    #: Same sizes of the process groups their collectives use (``role="pg_sizes=2,8"``,
    #: derived by ``collectives`` when neither a mesh, a pipeline nor the job says more):
    #: TP groups of different sizes do different work per rank.
    PROCESS_GROUPS = "process_groups"
    #: Nothing reported: every rank of the job is assumed to do the same work.
    JOB = "job"


@dataclass(frozen=True, slots=True)
class PeerKey:
    """Identity of a peer group: the role and the member list the ranks report."""

    role: str
    members: tuple[int, ...]

    @property
    def basis(self) -> PeerBasis:
        if self.members:
            return PeerBasis.GROUP_RANKS
        if self.role.startswith(PG_SIZES_PREFIX):
            return PeerBasis.PROCESS_GROUPS
        return PeerBasis.ROLE if self.role else PeerBasis.JOB

    def label(self) -> str:
        """Short stable text for keys and logs (``job``, ``role=pp_stage=2``, ...)."""
        parts = []
        if self.role:
            parts.append(f"role={self.role}")
        if self.members:
            parts.append(f"ranks={_span(self.members)}")
        return ",".join(parts) or "job"

    def why(self, pp_stage: int | None) -> str:
        """The reason these ranks are peers, in words an operator can check."""
        stage = f" (pipeline stage {pp_stage})" if pp_stage is not None else ""
        if self.basis is PeerBasis.GROUP_RANKS:
            role = f" and role {self.role!r}" if self.role else ""
            return (
                f"ranks that report the same peer group {_span(self.members)}{role}{stage}: "
                "the same work per step (from the job's DeviceMesh or its declaration)"
            )
        if self.basis is PeerBasis.PROCESS_GROUPS:
            sizes = self.role.removeprefix(PG_SIZES_PREFIX)
            return (
                f"ranks whose collectives use process groups of the same sizes ({sizes} "
                "ranks, the world group aside): ranks in groups of other sizes (a TP group "
                "of another size) do other work per step"
            )
        if self.basis is PeerBasis.ROLE:
            return f"ranks with the same role {self.role!r}{stage}"
        return "every rank of the job: none reported a role or peer group (data parallel)"


JOB_WIDE = PeerKey("", ())


class PeerIndex:
    """rank -> PeerKey, recomputed only when a rank's reported role/group changes.

    ``group_ranks`` can hold thousands of ranks; sorting it into a new key for every
    summary would cost more than the detector itself, so the cache is checked against the
    reported role and the member list: the very same list object (ingest hands every summary
    of a group one list, and a new one when its members change) is a hit at once, another
    list is compared element by element, nothing is copied or sorted. An earlier
    fingerprint of (role, length, first, middle, last member) kept a stale group when
    ``[0, 4, 8, 12]`` became ``[0, 5, 8, 12]`` (found by the acceptance probe).
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[int, tuple[str | None, Sequence[int], PeerKey]] = {}

    def key(self, s: StepSummary) -> PeerKey:
        g = s.group_ranks
        hit = self._cache.get(s.rank)
        if hit is not None and hit[0] == s.role and (hit[1] is g or hit[1] == g):
            return hit[2]
        key = PeerKey(s.role or "", tuple(sorted(g))) if (g or s.role) else JOB_WIDE
        self._cache[s.rank] = (s.role, g, key)
        return key


def _span(members: tuple[int, ...]) -> str:
    """``[4..7]`` for a contiguous run, the list otherwise (shortened past 16)."""
    if len(members) > 2 and members[-1] - members[0] == len(members) - 1:
        return f"[{members[0]}..{members[-1]}]"
    if len(members) > 16:
        return "[" + ", ".join(map(str, members[:8])) + f", ... ({len(members)} ranks)]"
    return str(list(members))
