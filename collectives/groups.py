"""Process-group ids that every rank computes alike, without talking to the others.

Detectors line up the same call across ranks by ``(group, seq)``, so a group's id must not
depend on the rank that computes it. ``new_group`` is collective and creates groups in the
same order on every member, so torch's ``group_name`` agrees across members; together with
the sorted global ranks it separates two groups over the same ranks.

Point-to-point traffic is not collective (the other members of the group take no part),
so it gets a channel per unordered rank pair, ``p2p-<low>-<high>``, with its own counter
on both ends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(slots=True, frozen=True)
class GroupInfo:
    id: str
    ranks: frozenset[int]
    size: int
    name: str = ""
    """torch's own name of the group (``ProcessGroup.group_name``; Flight Recorder's key)."""


class GroupRegistry:
    """Caches the id of each process group object seen (lookups are on the hot path)."""

    def __init__(self, on_new: Callable[[GroupInfo], None] | None = None) -> None:
        self._by_key: dict[int, tuple[Any, GroupInfo]] = {}
        self._world: GroupInfo | None = None
        self._on_new = on_new

    def world(self) -> GroupInfo:
        if self._world is None:
            self._world = self.resolve(None)
        return self._world

    def resolve(self, group: Any) -> GroupInfo:
        if group is None:
            if self._world is not None:
                return self._world
            group = dist.distributed_c10d._get_default_group()
        hit = self._by_key.get(id(group))
        if hit is not None and hit[0] is group:
            return hit[1]
        ranks = sorted(dist.get_process_group_ranks(group))
        name = getattr(group, "group_name", "") or ""
        digest = hashlib.sha1(f"{','.join(map(str, ranks))}|{name}".encode()).hexdigest()[:12]
        info = GroupInfo(
            id=f"g{len(ranks)}-{digest}", ranks=frozenset(ranks), size=len(ranks), name=name
        )
        self._by_key[id(group)] = (group, info)  # keeps the group alive: ids are never reused
        if group is dist.distributed_c10d._get_default_group():
            self._world = info
        if self._on_new is not None:
            self._on_new(info)
        return info


def p2p_channel(me: int, peer: int | None) -> str:
    if peer is None:
        return f"p2p-any-{me}"
    low, high = sorted((me, peer))
    return f"p2p-{low}-{high}"


__all__ = ["GroupInfo", "GroupRegistry", "p2p_channel"]
