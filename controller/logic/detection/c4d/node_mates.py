"""Stragglers that share a node: one slow node, told as such in each rank's incident.

Ranks are judged one by one, each against its own peer group. A whole slow node whose ranks
sit in different groups (TP inside the node, DP across nodes: each rank's peers are the
same local rank on the other nodes) therefore opens one straggler incident per rank, eight
for an 8-GPU node. Each incident's summary names the other open stragglers on its node, so
the operator and whoever reads the incidents see one slow node rather than eight unrelated
GPUs (found by the fault-pattern sweep: the eight incidents said nothing of each other).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Open straggler rank -> (slowdown last reported, flaps last reported, controller time of
#: that report, the other open stragglers on its node then).
Reported = tuple[float, int, float, tuple[int, ...]]


def node_mates(
    rank: int, open_ranks: Iterable[int], rank_node: Mapping[int, str]
) -> tuple[int, ...]:
    """The open stragglers other than ``rank`` on ``rank``'s node, in rank order."""
    node = rank_node.get(rank)
    if node is None:
        return ()
    return tuple(r for r in sorted(open_ranks) if r != rank and rank_node.get(r) == node)


def node_note(node: str, mates: tuple[int, ...]) -> str:
    """The summary's clause naming them (empty when there are none)."""
    if not mates:
        return ""
    return (
        f"; {len(mates)} other rank(s) on {node} are stragglers too "
        f"({', '.join(map(str, mates))}): the node, not this GPU alone, is the likely culprit"
    )
