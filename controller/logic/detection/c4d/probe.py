"""Localizing a slow link from a probe round of timed point-to-point transfers.

Each probed pair yields a bandwidth. Pairs far below the median are slow. A rank (its GPU
or NIC) that appears in every slow pair is the culprit; failing that, a node common to all
slow pairs; a single slow pair blames the link between its two ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from trainguard.wire import ProbeResult


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    slow_pairs: tuple[tuple[int, int], ...]
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    scope: str  # "rank", "node", "link", "none", "failed"
    median_gbps: float
    pair_gbps: dict[tuple[int, int], float]


def localize(
    results: list[ProbeResult], rank_node: dict[int, str], slow_fraction: float
) -> ProbeVerdict:
    pair_gbps: dict[tuple[int, int], float] = {}
    failed: list[tuple[int, int]] = []
    for res in results:
        pair = (res.src_rank, res.dst_rank)
        if not res.ok or res.duration_s <= 0:
            failed.append(pair)
            continue
        pair_gbps[pair] = res.size_bytes * 8 / res.duration_s / 1e9
    if not pair_gbps and not failed:
        return ProbeVerdict((), (), (), "none", 0.0, {})
    mid = median(pair_gbps.values()) if pair_gbps else 0.0
    slow = sorted({p for p, g in pair_gbps.items() if g < slow_fraction * mid} | set(failed))
    if not slow:
        return ProbeVerdict((), (), (), "none", mid, pair_gbps)
    if len(slow) >= 2:
        ranks = _in_every_pair(slow, lambda r: str(r))
        if ranks:
            culprits = tuple(sorted(int(r) for r in ranks))
            nodes = tuple(sorted({rank_node.get(r, "?") for r in culprits}))
            return ProbeVerdict(tuple(slow), culprits, nodes, "rank", mid, pair_gbps)
        common_nodes = _in_every_pair(slow, lambda r: rank_node.get(r, f"rank-{r}"))
        if common_nodes:
            culprits = tuple(
                sorted({r for p in slow for r in p if rank_node.get(r) in common_nodes})
            )
            nodes = tuple(sorted(common_nodes))
            return ProbeVerdict(tuple(slow), culprits, nodes, "node", mid, pair_gbps)
    culprits = tuple(sorted({r for p in slow for r in p}))
    nodes = tuple(sorted({rank_node.get(r, "?") for r in culprits}))
    scope = "failed" if failed and not pair_gbps else "link"
    return ProbeVerdict(tuple(slow), culprits, nodes, scope, mid, pair_gbps)


def _in_every_pair(slow: list[tuple[int, int]], key: Callable[[int], str]) -> set[str]:
    """Keys (a rank, or its node) that appear in every slow pair."""
    sets = [{key(a), key(b)} for a, b in slow]
    return set.intersection(*sets)
