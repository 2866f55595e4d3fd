"""Hang classification from in-flight collective records.

A rank's watchdog reports a collective it entered and has not left (group, per-group
sequence number, time inside so far) while it is still stuck. For the stuck call
``(group, seq)`` the controller sorts the group's members into three sets:

* *entered*: they report being inside ``(group, seq)``;
* *passed*: their last completed sequence number in ``group`` is already ``>= seq``;
* *absent*: neither. They never reached the call.

If anyone is absent, the hang is outside communication and the absentees are the culprits
(MegaScale: "the ranks that never logged the in-flight op are the hung ones"). If every
member entered and nobody finished, the communication path itself is at fault, and a link
probe between ring neighbours localizes it.

Rank numbers inside a record (the reporter's own rank, ``group_ranks``, the two ranks of a
``p2p-<low>-<high>`` id) come from agents and are only range-checked at the wire, which
cannot know the job's world size. Here a record from a rank outside the world is dropped,
and a call whose membership claim names such a rank, or leaves out a rank reporting the
call, gets no verdict: the reports contradict each other, and blaming anyone would be a
guess. A buggy or hostile report never makes a non-existent rank a culprit (nor a huge
claimed world a memory bomb); a real hang still shows in the hung rank's other calls.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.job_evidence import HangEvidence
from controller.logic.detection.c4d.job_evidence import StuckCall as StuckCallEvidence
from controller.logic.world_size import outside_world
from trainguard.wire import MAX_GROUP_RANKS, InflightCollective

#: Point-to-point channel ids as ``collectives`` names them (``collectives/groups.py``:
#: ``p2p-<low rank>-<high rank>``; the controller does not import collectives).
_P2P_ID = re.compile(r"^p2p-(\d+)-(\d+)$")
#: Process-group ids ``collectives`` gives: ``g<size>-<digest>``.
_SIZED_ID = re.compile(r"^g(\d+)-")


@dataclass(frozen=True, slots=True)
class StuckCall:
    group: str
    seq: int
    op: str
    elapsed_s: float
    members: tuple[int, ...]
    entered: tuple[int, ...]
    passed: tuple[int, ...]
    absent: tuple[int, ...]
    #: Ranks inside another op under the same number (a desync); they are among ``absent``.
    mismatched: tuple[int, ...] = ()

    @property
    def communication(self) -> bool:
        """Every member entered and none finished: the path between them is at fault."""
        return not self.absent and not self.passed

    @property
    def stranded(self) -> tuple[int, ...]:
        """Ranks stuck inside a call the other members all finished (none is absent).

        Such a call completed for its group, so its communication worked: what holds these
        ranks is their own process or GPU. It was called a communication hang of the whole
        group (found by the fault-pattern sweep: a rank stuck in barrier #17 while its seven
        peers, past it, waited in #18 for it gave a critical hang naming all eight ranks
        with a link probe of every pair, and the rank holding the job up was not named).
        """
        return self.entered if not self.absent and self.passed else ()


def classify(
    records: list[InflightCollective],
    world_size: int,
    last_completed: dict[int, dict[str, int]],
) -> list[StuckCall]:
    """Group in-flight records by call and classify each stuck call, oldest first.

    ``last_completed`` maps rank -> group -> last finished seq, from every record the
    controller has seen (stuck ranks report theirs for *all* their groups, which is how a
    rank stuck in group A tells us it never reached the call in group B).

    No call gets a verdict while the job's world size is unknown (0): no record has told
    it yet (the controller restarted during a hang, the ``started`` events were lost).
    A call without a member list was then taken as a group of no rank, a critical
    communication hang naming nobody while a rank was missing, and a list naming rank
    2**31 - 1 could not be checked (found by the fault-pattern sweep). The ranks'
    heartbeats carry the world size every few seconds; the verdict waits for it.
    """
    if world_size <= 0:
        return []
    records = [r for r in records if not outside_world(r.rank, world_size)]
    calls: dict[tuple[str, int], list[InflightCollective]] = {}
    #: group -> ranks whose current record lists it among their groups; ranks that sent
    #: a (non-empty) list at all
    users: dict[str, set[int]] = {}
    informed: set[int] = set()
    for rec in records:
        calls.setdefault((rec.group, rec.seq), []).append(rec)
        if rec.last_completed_seq:
            informed.add(rec.rank)
            for g in rec.last_completed_seq:
                users.setdefault(g, set()).add(rec.rank)
    out: list[StuckCall] = []
    for (group, seq), recs in calls.items():
        members = _members(group, seq, recs, world_size, users, informed)
        if members is None:
            continue  # contradicted membership (:func:`_proven`)
        recs, mismatched = _same_op(recs)
        entered = {r.rank for r in recs}
        passed = {m for m in members - entered if last_completed.get(m, {}).get(group, -1) >= seq}
        absent = members - entered - passed
        out.append(
            StuckCall(
                group=group,
                seq=seq,
                op=recs[0].op,
                elapsed_s=max(r.elapsed_s for r in recs),
                members=tuple(sorted(members)),
                entered=tuple(sorted(entered)),
                passed=tuple(sorted(passed)),
                absent=tuple(sorted(absent)),
                mismatched=mismatched,
            )
        )
    out.sort(key=lambda c: -c.elapsed_s)
    return out


def _same_op(recs: list[InflightCollective]) -> tuple[list[InflightCollective], tuple[int, ...]]:
    """The records of the call's op, and the ranks inside another op under the same number.

    A group's calls are numbered in the order each rank issues them, so ranks reporting
    different ops under one number issued their collectives in different orders (a
    desync: rank 3 broadcasts where its peers all-reduce). The op most ranks report is the
    call; the others never entered it and are its absentees. This was read as every
    member inside the call, a communication hang of the whole group with a link probe
    (found by the fault-pattern sweep). Without an op most of the call's ranks report (a
    pair that disagrees: a send meets its recv on a point-to-point channel) nobody can be
    told apart: the call stays as reported.
    """
    counts = Counter(r.op for r in recs)
    if len(counts) < 2:
        return recs, ()
    ((top, n),) = counts.most_common(1)
    if 2 * n <= len(recs):
        return recs, ()
    odd = tuple(sorted({r.rank for r in recs if r.op != top}))
    return [r for r in recs if r.op == top], odd


def unexplained(
    skipped: list[StuckCall], explaining: set[tuple[str, int]], calls: list[StuckCall]
) -> list[StuckCall]:
    """Of ``skipped`` (stuck calls whose absentees all wait inside other calls), those
    whose waits lead to no call with a verdict of its own: the ranks wait for each other
    in a cycle (a deadlock: two ranks issued their calls in different orders).

    An absentee waiting elsewhere is a victim when the call it waits in is explained: it
    has culprits of its own (``explaining``: reported, or not yet past the timeout), or its
    own absentees are explained in turn. The victims' calls were skipped on the promise of
    an origin further down the chain; in a cycle there is none, and the hang was reported
    by nobody (found by the fault-pattern sweep: rank 3 in its TP all-gather waiting for
    rank 2, rank 2 in the world all-reduce waiting for rank 3, and no incident at all).
    """
    inside: dict[int, set[tuple[str, int]]] = {}
    for call in calls:
        for rank in call.entered:
            inside.setdefault(rank, set()).add((call.group, call.seq))
    ok = set(explaining)
    left = list(skipped)
    changed = True
    while changed and left:
        changed = False
        for call in list(left):
            if all(inside.get(rank, set()) & ok for rank in call.absent):
                ok.add((call.group, call.seq))
                left.remove(call)
                changed = True
    return left


def _members(
    group: str,
    seq: int,
    recs: list[InflightCollective],
    world_size: int,
    users: dict[str, set[int]],
    informed: set[int],
) -> set[int] | None:
    """The call's group members: from a record's ``group_ranks`` when one has them.

    Without them (an older or foreign reporter) the world was assumed, so a stuck call of a
    TP pair or a pipeline send named every other rank of the job as absent (the acceptance
    probe: a critical hang naming 62 ranks on 8 nodes). What the reports prove is used
    instead: a point-to-point channel id names its two ranks; a group id giving its size
    (``g2-...``) is exactly the ranks known to use it (inside the call, or listing it among
    the groups they completed calls in) once that many are known. Otherwise the world is
    still assumed (nothing says who else is in the group), less the ranks proven outside
    it: past the group's first call, every member has completed a call in it, so a rank
    whose current report lists its groups without this one is not a member. None: a list
    or id names a rank outside the world or leaves out a rank inside the call (or a
    point-to-point id names one rank twice)."""
    entered = {r.rank for r in recs}
    for rec in recs:
        if rec.group_ranks:
            return _proven(set(rec.group_ranks), entered, world_size)
    if (pair := _P2P_ID.match(group)) is not None:
        ends = {int(pair[1]), int(pair[2])}
        return _proven(ends, entered, world_size) if len(ends) == 2 else None
    known = entered | users.get(group, set())
    sized = _SIZED_ID.match(group)
    if sized is not None and len(known) >= int(sized[1]):
        return known
    if world_size > MAX_GROUP_RANKS:  # no group is larger: a hostile claim, not a world
        return known
    members = set(range(world_size))
    if seq >= 2:  # calls are numbered from 1: a first call proves nothing about who is in
        members -= informed - known
    return members


def _proven(members: set[int], entered: set[int], world_size: int) -> set[int] | None:
    """``members``, if the claim can be believed: it names only ranks of the job (when its
    world size is known) and includes every rank reporting the call; else None. A claim
    failing either comes from a buggy or hostile reporter: its ranks are not blamed."""
    if outside_world(max(members), world_size):
        return None
    return members if entered <= members else None


def ring_pairs(members: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Neighbour pairs of a ring over ``members``: every member is probed twice, so a
    member common to two slow pairs stands out."""
    n = len(members)
    if n < 2:
        return ()
    if n == 2:
        return ((members[0], members[1]),)
    return tuple((members[i], members[(i + 1) % n]) for i in range(n))


def hang_finding(
    job: str,
    calls: list[StuckCall],
    key: str,
    rank_node: dict[int, str],
    stuck_ranks: set[int],
    *,
    deadlock: bool = False,
) -> Finding:
    """The finding for one hang (``calls``: the stuck calls it explains, their culprits
    in ``absent``); ``stuck_ranks`` are the ranks that are themselves inside some
    collective. ``deadlock``: the culprits wait for each other (:func:`unexplained`)."""
    call = max(calls, key=lambda c: c.elapsed_s)
    what = f"{call.op} #{call.seq} in group {call.group}"
    evidence = HangEvidence(**dict(_call_evidence(call)))
    if len(calls) > 1:
        evidence.stuck_calls = [_call_evidence(c) for c in calls]
    if call.communication:
        nodes = tuple(sorted({rank_node.get(r, "?") for r in call.members}))
        # Every member is inside the call: the path between them is at fault, but which
        # link is unknown until a probe runs, and none can run while all are blocked.
        evidence.confidence = 0.5
        evidence.probe = "deferred: the link probe runs once the job steps again"
        return Finding(
            kind=FindingKind.COMM_HANG,
            job=job,
            severity="critical",
            summary=(
                f"job {job}: all {len(call.members)} ranks entered {what} and none "
                f"finished after {call.elapsed_s:.0f}s: communication hang; a link probe "
                "after restart localizes it"
            ),
            key=key,
            ranks=call.members,
            nodes=nodes,
            evidence=evidence,
            probe_pairs=ring_pairs(call.members),
        )
    culprits = sorted({r for c in calls for r in (c.stranded or c.absent)})
    nodes = tuple(sorted({rank_node.get(r, "?") for r in culprits}))
    # An absentee that is itself stuck in another collective may be a victim of a chain;
    # one stuck nowhere is the origin.
    evidence.confidence = 0.8 if set(culprits) & stuck_ranks else 1.0
    if deadlock:
        evidence.deadlock = True
        whats = ", ".join(f"{c.op} #{c.seq} in group {c.group}" for c in calls)
        summary = (
            f"job {job}: rank(s) {culprits} on {list(nodes)} wait for each other "
            f"({whats}), each absent from a call another waits in: a deadlock, "
            f"collectives issued in different orders; stuck {call.elapsed_s:.0f}s"
        )
    elif call.stranded:
        summary = (
            f"job {job}: rank(s) {culprits} on {list(nodes)} stuck {call.elapsed_s:.0f}s "
            f"in {what}, which its {len(call.passed)} other members finished"
        )
    else:
        odd = f" (rank(s) {list(call.mismatched)} called another op as #{call.seq}: out of order)"
        summary = (
            f"job {job}: rank(s) {list(call.absent)} on {list(nodes)} never entered "
            f"{what}{odd if call.mismatched else ''}; {len(call.entered)} peers waiting "
            f"{call.elapsed_s:.0f}s"
        )
    return Finding(
        kind=FindingKind.HANG,
        job=job,
        severity="critical",
        summary=summary,
        key=key,
        ranks=tuple(culprits),
        nodes=nodes,
        evidence=evidence,
    )


def _call_evidence(call: StuckCall) -> StuckCallEvidence:
    return StuckCallEvidence(
        group=call.group,
        seq=call.seq,
        op=call.op,
        elapsed_s=round(call.elapsed_s, 3),
        entered=list(call.entered),
        passed=list(call.passed),
        absent=list(call.absent),
    )
