"""The in-flight collectives a job's ranks report stuck, indexed by rank.

Every step summary drops its rank's records of older steps (a rank that finished a later
step is no longer stuck in an older call). Scanning every record of the job for that made
each summary cost O(records): after a job-wide stall of a 4,096-rank job (8,192 records
kept, their step unknown), ~1 ms per summary, ~4 s per step (found by the acceptance probe).
Here each rank's records sit under the rank, so a summary looks at its own few records.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

from trainguard.wire import InflightCollective


@dataclass(slots=True)
class Inflight:
    """One stuck call a rank reported, and when the controller last heard of it."""

    record: InflightCollective
    received_s: float


class InflightTable(MutableMapping[tuple[int, str], Inflight]):
    """(rank, group) -> the latest record of that rank's stuck call in that group.

    A mapping like the dict it replaces (iteration in insertion order of the pairs is not
    kept across ranks; nothing reads it in order), with a per-rank index beneath."""

    __slots__ = ("_by_rank", "_len")

    def __init__(self) -> None:
        self._by_rank: dict[int, dict[str, Inflight]] = {}
        self._len = 0

    def __getitem__(self, key: tuple[int, str]) -> Inflight:
        return self._by_rank[key[0]][key[1]]

    def __setitem__(self, key: tuple[int, str], value: Inflight) -> None:
        groups = self._by_rank.setdefault(key[0], {})
        if key[1] not in groups:
            self._len += 1
        groups[key[1]] = value

    def __delitem__(self, key: tuple[int, str]) -> None:
        groups = self._by_rank[key[0]]
        del groups[key[1]]
        self._len -= 1
        if not groups:
            del self._by_rank[key[0]]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for rank, groups in self._by_rank.items():
            for group in groups:
                yield rank, group

    def __len__(self) -> int:
        return self._len

    def ranks(self) -> set[int]:
        """The ranks with a stuck call on record."""
        return set(self._by_rank)

    def passed(self, rank: int, step: int) -> None:
        """``rank`` finished ``step``: drop its records of calls in earlier steps (those
        whose step is unknown stay until they expire)."""
        groups = self._by_rank.get(rank)
        if not groups:
            return
        done = [g for g, v in groups.items() if v.record.step is not None and v.record.step < step]
        for group in done:
            del self[(rank, group)]


__all__ = ["Inflight", "InflightTable"]
