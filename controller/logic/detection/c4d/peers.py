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

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller.logic.world_size import outside_world
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
        self._cache: dict[int, tuple[str | None, int | None, Sequence[int], PeerKey]] = {}

    def key(self, s: StepSummary) -> PeerKey:
        g = s.group_ranks
        hit = self._cache.get(s.rank)
        if (
            hit is not None
            and hit[0] == s.role
            and hit[1] == s.pp_stage
            and (hit[2] is g or hit[2] == g)
        ):
            return hit[3]
        # A summary with a pipeline stage but no role (a rank that declared only its stage,
        # or an older ``collectives``) is in that stage's group: stages do different work
        # (the last one computes the loss), so without this every stage would be one group
        # and the stage slower by design called stragglers (found by the acceptance probe).
        role = s.role or (f"pp_stage={s.pp_stage}" if s.pp_stage is not None else "")
        # A list naming a rank outside the job (filled in from a declared PeerGroup, which
        # the wire cannot check against the world size) is no peer group: without this its
        # ghost ranks would be the group's members in findings and on the dashboard.
        members = tuple(sorted(g)) if g and not outside_world(max(g), s.world_size) else ()
        key = PeerKey(role, members) if (members or role) else JOB_WIDE
        self._cache[s.rank] = (s.role, s.pp_stage, g, key)
        return key


#: Compared steps a rank's reported peer group may disagree with the other ranks' reports
#: (roles settle over a job's first steps, one rank earlier than another) before the rank
#: is compared with the ranks that list it, or with its own history.
SETTLE_STEPS = 20


class PeerGroups:
    """rank -> the peer group it is compared in, judged by who reports each key.

    Normally a rank is compared under the key it reports. A report can disagree with the
    others' (a stale or wrong ``group_ranks``: rank 7 of stage 3 listing stage 2's ranks);
    the right peers of such a rank are the ranks that *list it* in their own reports, since
    they agree among themselves that it does their work. A report is inconsistent when its
    member list leaves the rank itself out, or lists other ranks none of which reports it.
    Such a rank is held out for ``SETTLE_STEPS`` compared steps (its peers may report the
    same list a step later), then joins the group that lists it (the most-reported one; of
    its own role first), else a role-only group of its role that other ranks report, else it
    is a group of one, compared with its own history. It is never left uncompared, as the
    old check (a group's size read from the reported list) left it (found by the
    acceptance probe).
    """

    __slots__ = ("_due", "_since", "assigned", "index", "reported", "reporters", "size")

    def __init__(self) -> None:
        self.index = PeerIndex()
        #: rank -> the key it reports; key -> how many ranks report it
        self.reported: dict[int, PeerKey] = {}
        self.reporters: dict[PeerKey, int] = {}
        #: rank -> the key it is compared under; key -> how many ranks are compared under it
        self.assigned: dict[int, PeerKey] = {}
        self.size: dict[PeerKey, int] = {}
        #: inconsistent rank -> the step number (``update``'s count) when that began
        self._since: dict[int, int] = {}
        #: the step number at which a held rank's settling time runs out (None: none held)
        self._due: int | None = None

    def update(self, rows: Sequence[StepSummary], step_no: int) -> list[tuple[int, PeerKey]]:
        """Take one compared step's reports; return (rank, former group) of ranks moved.

        Cheap when nothing changes: the keys come from :class:`PeerIndex`'s cache and the
        whole job is reassigned only when some rank's report changed, or a held rank's
        settling time ran out."""
        changed = False
        for s in rows:
            key = self.index.key(s)
            old = self.reported.get(s.rank)
            if old != key:
                if old is not None:
                    self.reporters[old] -= 1
                    if not self.reporters[old]:
                        del self.reporters[old]
                self.reported[s.rank] = key
                self.reporters[key] = self.reporters.get(key, 0) + 1
                changed = True
        if not changed and (self._due is None or step_no < self._due):
            return []
        return self._assign(step_no)

    def group(self, rank: int) -> PeerKey | None:
        """The key ``rank`` is compared under (None: held out while its report settles)."""
        return self.assigned.get(rank)

    def alone(self, key: PeerKey) -> bool:
        """A group of one: one rank is compared under it (the job-wide group never is)."""
        return key != JOB_WIDE and self.size.get(key, 0) == 1

    def _assign(self, step_no: int) -> list[tuple[int, PeerKey]]:
        by_role: dict[str, list[PeerKey]] = {}
        for key, n in self.reporters.items():
            if n >= 2:
                by_role.setdefault(key.role, []).append(key)
        moved: list[tuple[int, PeerKey]] = []
        self._due = None
        for rank, key in self.reported.items():
            target: PeerKey | None = key
            if not self._consistent(rank, key):
                due = self._since.setdefault(rank, step_no) + SETTLE_STEPS
                if step_no >= due:
                    target = self._adopter(rank, key, by_role)
                else:
                    target = None
                    self._due = due if self._due is None else min(self._due, due)
            else:
                self._since.pop(rank, None)
            old = self.assigned.get(rank)
            if old == target:
                continue
            if old is not None:
                self.size[old] -= 1
                if not self.size[old]:
                    del self.size[old]
                moved.append((rank, old))
            if target is None:
                del self.assigned[rank]
            else:
                self.assigned[rank] = target
                self.size[target] = self.size.get(target, 0) + 1
        return moved

    def _consistent(self, rank: int, key: PeerKey) -> bool:
        m = key.members
        if not m:
            return True
        i = bisect_left(m, rank)
        if i == len(m) or m[i] != rank:
            return False  # a rank is always in its own peer group
        return len(m) == 1 or self.reporters.get(key, 0) >= 2

    def _adopter(self, rank: int, key: PeerKey, by_role: dict[str, list[PeerKey]]) -> PeerKey:
        """The group of the ranks that list ``rank`` (its own role first), else a role-only
        group of its role, else its own key (a group of one)."""
        best: tuple[int, int, PeerKey] | None = None
        for role, keys in by_role.items():
            for k in keys:
                m = k.members
                i = bisect_left(m, rank)
                if k != key and i < len(m) and m[i] == rank:
                    cand = (int(role == key.role), self.reporters[k], k)
                    if best is None or cand[:2] > best[:2]:
                        best = cand
        if best is not None:
            return best[2]
        for k in by_role.get(key.role, ()):
            if not k.members and key.role:
                return k
        return key


def _span(members: tuple[int, ...]) -> str:
    """``[4..7]`` for a contiguous run, the list otherwise (shortened past 16)."""
    if len(members) > 2 and members[-1] - members[0] == len(members) - 1:
        return f"[{members[0]}..{members[-1]}]"
    if len(members) > 16:
        return "[" + ", ".join(map(str, members[:8])) + f", ... ({len(members)} ranks)]"
    return str(list(members))
