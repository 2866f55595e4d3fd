"""Localizing a slow link from a probe round of timed point-to-point transfers.

Each probed pair yields a bandwidth. Pairs far below the typical pair of their kind are
slow. A rank (its GPU or NIC) that appears in every slow pair is the culprit; failing that,
a node common to all slow pairs; otherwise the slow pairs' links themselves are to blame.

Two ranks on one node talk over NVLink/PCIe, ranks on different nodes over the network,
often several times slower: a ring over 4-GPU nodes has 3 same-node pairs per node
boundary. One median over both kinds made every healthy node-boundary pair "slow" (and
blamed whole nodes on a healthy cluster), so each pair is judged only against pairs of its
own kind (same node, or across nodes, as ``rank_node`` says).

Only the slow pairs of the worst pair's severity localize: a pair within ``1 /
slow_fraction`` of the slowest pair's slowdown. A GPU or NIC that is slow slows each of
its pairs about alike; a link 16x slow beside a pair 2.5x slow through one of its ranks
(a descheduled process, a burst of other traffic) is that link, not the shared rank. The
lesser pairs are still reported, as ``marginal_pairs``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median_high

from trainguard.wire import ProbeResult


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    slow_pairs: tuple[tuple[int, int], ...]
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    scope: str  # "rank", "node", "link", "none", "failed"
    #: The reference the slowest measured pair was judged against (its kind's upper
    #: median), so ``slowest / median_gbps`` is how degraded the worst link is.
    median_gbps: float
    pair_gbps: dict[tuple[int, int], float]
    #: Pairs slow against their kind but far less than the worst: reported, not localized.
    marginal_pairs: tuple[tuple[int, int], ...] = ()


def localize(
    results: list[ProbeResult], rank_node: dict[int, str], slow_fraction: float
) -> ProbeVerdict:
    pair_gbps: dict[tuple[int, int], float] = {}
    failed: set[tuple[int, int]] = set()
    for res in results:
        pair = (res.src_rank, res.dst_rank)
        if res.missed or res.src_rank == res.dst_rank:
            continue  # the source never ran it, or no link at all: no evidence either way
        if not res.ok:
            failed.add(pair)
            continue
        gbps = _gbps(res)
        if gbps is not None:  # the fastest of repeated answers, as the probe's own rounds
            pair_gbps[pair] = max(gbps, pair_gbps.get(pair, 0.0))
    failed -= pair_gbps.keys()  # a pair that answered with a timing did carry the transfer
    if not pair_gbps and not failed:
        return ProbeVerdict((), (), (), "none", 0.0, {})
    ref = _references(pair_gbps, rank_node)
    mid = ref[min(pair_gbps, key=pair_gbps.__getitem__)] if pair_gbps else 0.0
    ratio = {p: g / ref[p] for p, g in pair_gbps.items() if ref[p] > 0}
    measured = {p for p, r in ratio.items() if r < slow_fraction}
    if not measured and not failed:
        return ProbeVerdict((), (), (), "none", mid, pair_gbps)
    # Failed transfers are the worst a pair can do; among timed ones, the worst's band.
    worst = min((ratio[p] for p in measured), default=0.0)
    marginal = tuple(sorted(p for p in measured if ratio[p] > worst / slow_fraction))
    slow = sorted((measured - set(marginal)) | failed)
    verdict = _localized(slow, failed, pair_gbps, rank_node, mid)
    return dataclasses.replace(verdict, marginal_pairs=marginal)


def _localized(
    slow: list[tuple[int, int]],
    failed: set[tuple[int, int]],
    pair_gbps: dict[tuple[int, int], float],
    rank_node: dict[int, str],
    mid: float,
) -> ProbeVerdict:
    """The rank, node or links that every slow pair has in common."""
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


def _gbps(res: ProbeResult) -> float | None:
    """The pair's bandwidth, or None for a timing that measured nothing (no bytes, a zero,
    negative or non-finite duration): such an answer is no evidence about the link, and
    reading it as a failed or 0 GB/s transfer would blame a link nobody measured."""
    if res.size_bytes <= 0 or not 0.0 < res.duration_s < math.inf:
        return None
    gbps = res.size_bytes * 8 / res.duration_s / 1e9
    return gbps if math.isfinite(gbps) else None


def _references(
    pair_gbps: dict[tuple[int, int], float], rank_node: dict[int, str]
) -> dict[tuple[int, int], float]:
    """Each pair's healthy reference: the upper median of the pairs of its kind.

    The upper median, not the mean of the middle two: with exactly half of a kind slow (a
    slow rank in a 4-rank ring, one of the two pairs crossing between 2 nodes) that mean
    is half slow itself, and a link 2-3x slow would not stand out. With more than half of
    a kind slow the reference is slow too: a relative probe cannot tell "most links are
    slow" from "this is how fast these links are".
    """

    def kind(pair: tuple[int, int]) -> bool:
        a, b = rank_node.get(pair[0]), rank_node.get(pair[1])
        return a is not None and a == b

    by_kind: dict[bool, list[float]] = {}
    for pair, gbps in pair_gbps.items():
        by_kind.setdefault(kind(pair), []).append(gbps)
    ref = {k: median_high(v) for k, v in by_kind.items()}
    return {pair: ref[kind(pair)] for pair in pair_gbps}


def _in_every_pair(slow: list[tuple[int, int]], key: Callable[[int], str]) -> set[str]:
    """Keys (a rank, or its node) that appear in every slow pair."""
    sets = [{key(a), key(b)} for a, b in slow]
    return set.intersection(*sets)
