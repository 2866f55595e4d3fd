"""Candidate paths between two NICs: every way ECMP could carry a flow, with the decisions
that select each one and the probability a random hash lands on it.

The fabric forwards on minimal up-down paths: a packet climbs until it reaches a switch
with a live path down to a leaf of the destination NIC, then descends. At every device with
more than one equal-cost next hop, the hash picks one (the bond driver for the NIC port, the
leaf for the spine, the spine for which of a dual-homed NIC's leaves). Next hops are ordered
by link name, which is the order the hash index is taken in (:mod:`.hashing`).

Routes are memoized per (switch, destination leaf set) and templates per (source leaves,
destination leaves): in a fat tree thousands of NIC pairs share a handful of shapes, which is
what keeps planning a 4,096-GPU job within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: A hash decision: (device, chosen branch index, number of branches). The device "@src" is
#: the sending NIC's bond, named per flow when the template is applied.
Choice = tuple[str, int, int]
SRC_DEVICE = "@src"

_Route = tuple[tuple[int, ...], tuple[Choice, ...], float, str]  # links, choices, prob, end leaf


@dataclass(slots=True)
class Template:
    """Paths shared by every NIC pair with the same live source and destination leaves."""

    src_port: IntArray
    dst_port: IntArray
    mid: IntArray
    prob: FloatArray
    choices: list[tuple[Choice, ...]]


@dataclass(slots=True)
class CandidateSet:
    """All candidate paths of one NIC pair; row r of ``links`` is candidate r."""

    links: IntArray
    prob: FloatArray
    src_port: IntArray
    dst_port: IntArray
    choices: list[tuple[Choice, ...]]

    def __len__(self) -> int:
        return int(self.links.shape[0])


class RouteTable:
    """Enumerates and caches candidate sets for a topology; call :meth:`invalidate` (or let
    the epoch check do it) after link health changes."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.mid_width = 2 * (topo.max_tier - 1)
        self.width = self.mid_width + 2
        self._epoch = -1
        self._routes: dict[tuple[str, int], list[_Route]] = {}
        self._updist: dict[tuple[str, int], float] = {}
        self._templates: dict[tuple[tuple[tuple[int, str], ...], ...], Template | None] = {}
        self._sets: dict[tuple[int, int, int, int], CandidateSet | None] = {}
        self._down_map: dict[str, dict[str, int]] = {}
        self._stale: list[tuple[object, ...]] = []

    def invalidate(self) -> None:
        """Start empty caches. Freeing the old ones (hundreds of thousands of tuples after
        a 4k-GPU plan) takes longer than re-planning itself, so they are parked and
        released by :meth:`release_stale`, off the re-planning path."""
        self._stale.append((self._routes, self._updist, self._templates, self._sets))
        self._routes, self._updist, self._templates, self._sets = {}, {}, {}, {}
        self._epoch = self.topo.epoch

    def release_stale(self) -> None:
        self._stale.clear()

    def _fresh(self) -> None:
        if self._epoch != self.topo.epoch:
            self.invalidate()

    # ------------------------------------------------------------------ switch-level routes

    def _up_dist(self, sw: str, targets: int) -> float:
        key = (sw, targets)
        hit = self._updist.get(key)
        if hit is not None:
            return hit
        desc = self.topo.descendants()
        if desc.get(sw, 0) & targets:
            d = 0.0
        else:
            d = float("inf")
            health = self.topo.health
            for nxt, link in self.topo.up[sw]:
                if health[link] > 0.0:
                    d = min(d, 1.0 + self._up_dist(nxt, targets))
        self._updist[key] = d
        return d

    def _down_nexts(self, sw: str, targets: int) -> list[tuple[str, int]]:
        topo = self.topo
        health = topo.health
        if topo.tier[sw] == 2 and targets.bit_count() * 4 < len(topo.down[sw]):
            # A spine above hundreds of leaves: look up the few target leaves directly.
            kids = self._down_map.get(sw)
            if kids is None:
                kids = self._down_map[sw] = {n: lk for n, lk in topo.down[sw]}
            found = []
            for leaf in self._leaves_of(targets):
                lk = kids.get(leaf)
                if lk is not None and health[lk] > 0:
                    found.append((leaf, lk))
            found.sort(key=lambda e: topo.link_names[e[1]])
            return found
        desc = topo.descendants()
        return [(n, lk) for n, lk in topo.down[sw] if health[lk] > 0 and desc[n] & targets]

    def _leaves_of(self, targets: int) -> list[str]:
        out = []
        leaves = self.topo.leaves
        while targets:
            low = targets & -targets
            out.append(leaves[low.bit_length() - 1])
            targets ^= low
        return out

    def routes(self, sw: str, targets: int) -> list[_Route]:
        """Minimal up-down routes from ``sw`` to any leaf whose bit is in ``targets``."""
        key = (sw, targets)
        hit = self._routes.get(key)
        if hit is not None:
            return hit
        topo = self.topo
        health = topo.health
        desc = topo.descendants()
        out: list[_Route] = []
        if topo.tier[sw] == 1 and topo.leaf_bit[sw] & targets:
            out.append(((), (), 1.0, sw))
        else:
            if desc.get(sw, 0) & targets:
                nexts = self._down_nexts(sw, targets)
            else:
                d = self._up_dist(sw, targets)
                nexts = [
                    (n, lk)
                    for n, lk in topo.up[sw]
                    if health[lk] > 0 and self._up_dist(n, targets) == d - 1.0
                ]
            n_br = len(nexts)
            for idx, (nxt, link) in enumerate(nexts):
                here: tuple[Choice, ...] = ((sw, idx, n_br),) if n_br > 1 else ()
                for links, choices, prob, end in self.routes(nxt, targets):
                    out.append(((link, *links), here + choices, prob / n_br, end))
        self._routes[key] = out
        return out

    # ------------------------------------------------------------------ NIC-level candidates

    def _template(
        self,
        src: tuple[int, ...],
        dst: tuple[int, ...],
        src_leaves: list[str],
        dst_leaves: list[str],
    ) -> Template | None:
        """``src``/``dst`` are the live port indices; leaves are per port index."""
        key = (
            tuple((p, src_leaves[p]) for p in src),
            tuple((p, dst_leaves[p]) for p in dst),
        )
        if key in self._templates:
            return self._templates[key]
        topo = self.topo
        targets = 0
        for p in dst:
            targets |= topo.leaf_bit[dst_leaves[p]]
        per_port = [(p, self.routes(src_leaves[p], targets)) for p in src]
        per_port = [(p, r) for p, r in per_port if r]
        rows_sp: list[int] = []
        rows_dp: list[int] = []
        rows_mid: list[tuple[int, ...]] = []
        rows_prob: list[float] = []
        rows_choice: list[tuple[Choice, ...]] = []
        n_src = len(per_port)
        for s_idx, (sp, rts) in enumerate(per_port):
            head: tuple[Choice, ...] = ((SRC_DEVICE, s_idx, n_src),) if n_src > 1 else ()
            for links, choices, prob, end in rts:
                ends = [p for p in dst if dst_leaves[p] == end]
                for d_idx, dp in enumerate(ends):
                    tail: tuple[Choice, ...] = ((end, d_idx, len(ends)),) if len(ends) > 1 else ()
                    rows_sp.append(sp)
                    rows_dp.append(dp)
                    rows_mid.append(links + (topo.dummy_link,) * (self.mid_width - len(links)))
                    rows_prob.append(prob / n_src / len(ends))
                    rows_choice.append(head + choices + tail)
        tpl = None
        if rows_sp:
            tpl = Template(
                src_port=np.asarray(rows_sp, dtype=np.int64),
                dst_port=np.asarray(rows_dp, dtype=np.int64),
                mid=np.asarray(rows_mid, dtype=np.int64).reshape(len(rows_sp), self.mid_width),
                prob=np.asarray(rows_prob, dtype=np.float64),
                choices=rows_choice,
            )
        self._templates[key] = tpl
        return tpl

    def candidates(
        self, src_node: int, src_nic: int, dst_node: int, dst_nic: int
    ) -> CandidateSet | None:
        """Candidate paths from one NIC to another, or None when no live path exists."""
        self._fresh()
        key = (src_node, src_nic, dst_node, dst_nic)
        if key in self._sets:
            return self._sets[key]
        topo = self.topo
        s_refs = topo.ports[src_node][src_nic]
        d_refs = topo.ports[dst_node][dst_nic]
        src = tuple(r.port for r in s_refs if topo.health[r.up_link] > 0)
        dst = tuple(r.port for r in d_refs if topo.health[r.down_link] > 0)
        cs = None
        if src and dst:
            tpl = self._template(src, dst, [r.leaf for r in s_refs], [r.leaf for r in d_refs])
            if tpl is not None:
                up = np.asarray([r.up_link for r in s_refs], dtype=np.int64)
                dn = np.asarray([r.down_link for r in d_refs], dtype=np.int64)
                links = np.empty((tpl.mid.shape[0], self.width), dtype=np.int64)
                links[:, 0] = up[tpl.src_port]
                links[:, 1 : 1 + self.mid_width] = tpl.mid
                links[:, -1] = dn[tpl.dst_port]
                cs = CandidateSet(links, tpl.prob, tpl.src_port, tpl.dst_port, tpl.choices)
        self._sets[key] = cs
        return cs

    def forget(self, keys: list[tuple[int, int, int, int]]) -> None:
        """Drop cached candidate sets (after a health change only they care about)."""
        for k in keys:
            self._sets.pop(k, None)


def real_links(row: IntArray, dummy: int) -> list[int]:
    """The links of one candidate row without padding, in path order."""
    return [int(x) for x in row if x != dummy]


__all__ = ["SRC_DEVICE", "CandidateSet", "Choice", "RouteTable", "Template", "real_links"]
