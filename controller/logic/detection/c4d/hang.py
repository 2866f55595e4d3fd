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
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.wire import InflightCollective


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

    @property
    def communication(self) -> bool:
        return not self.absent


def classify(
    records: list[InflightCollective],
    world_size: int,
    last_completed: dict[int, dict[str, int]],
) -> list[StuckCall]:
    """Group in-flight records by call and classify each stuck call, oldest first.

    ``last_completed`` maps rank -> group -> last finished seq, from every record the
    controller has seen (stuck ranks report theirs for *all* their groups, which is how a
    rank stuck in group A tells us it never reached the call in group B).
    """
    calls: dict[tuple[str, int], list[InflightCollective]] = {}
    for rec in records:
        calls.setdefault((rec.group, rec.seq), []).append(rec)
    out: list[StuckCall] = []
    for (group, seq), recs in calls.items():
        members = _members(recs, world_size)
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
            )
        )
    out.sort(key=lambda c: -c.elapsed_s)
    return out


def _members(recs: list[InflightCollective], world_size: int) -> set[int]:
    for rec in recs:
        if rec.group_ranks:
            return set(rec.group_ranks)
    # Without membership, assume the default (world) group: every rank of the job.
    return set(range(world_size))


def ring_pairs(members: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Neighbour pairs of a ring over ``members``: every member is probed twice, so a
    member common to two slow pairs stands out."""
    n = len(members)
    if n < 2:
        return ()
    if n == 2:
        return ((members[0], members[1]),)
    return tuple((members[i], members[(i + 1) % n]) for i in range(n))
