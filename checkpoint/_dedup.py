"""Write each byte once: which rank writes each tensor that data-parallel replicas share.

Data-parallel replicas hold identical copies of every tensor that is not ZeRO-partitioned;
saving them all multiplies the bytes written by the DP size. Like DCP's deduplication, the
save is planned so that each unique tensor is written by exactly one of the ranks holding
it, balanced by bytes over them; the other ranks record in their manifest an entry with
``stored_by`` naming the writer, so any rank still loads its own state (same layout) or any
layout (the resharding loader reads the writer's fragment).

No collective is needed: every rank of a replica group sees the same tensors (names and
sizes), so each computes the same plan on its own. Pure: tested with plain data.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shared:
    """A tensor this rank holds that ``group`` (global ranks, sorted) hold identically."""

    name: str
    nbytes: int
    group: tuple[int, ...]


def plan_writers(items: Sequence[Shared]) -> dict[str, int]:
    """Entry name -> the global rank that writes it.

    Per replica group, largest tensors first (ties by name), each goes to the member with
    the fewest bytes so far (ties to the lowest rank): the same answer on every member, and
    bytes within one tensor of even.
    """
    by_group: dict[tuple[int, ...], list[Shared]] = defaultdict(list)
    for item in items:
        by_group[item.group].append(item)
    out: dict[str, int] = {}
    for group, members in by_group.items():
        load = dict.fromkeys(group, 0)
        for item in sorted(members, key=lambda i: (-i.nbytes, i.name)):
            writer = min(group, key=lambda r: (load[r], r))
            load[writer] += item.nbytes
            out[item.name] = writer
    return out
