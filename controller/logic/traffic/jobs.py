"""A job's network traffic, derived from where its ranks run and how it is parallelized.

Rank layout follows Megatron's default order: tensor parallel varies fastest, then data
parallel, then pipeline (``rank = tp + TP·(dp + DP·pp)``), and rank r runs on node
``nodes[r // gpus_per_node]``, GPU ``r % gpus_per_node``. GPU g uses NIC
``g · nics / gpus_per_node``, the rail-aligned pairing of H100/H200 servers.

Ring all-reduce (what NCCL runs for data-parallel gradients) over n ranks sends
2(n-1)/n · S bytes across every ring edge. Edges inside a node ride NVLink and cost the
network nothing; each edge between nodes becomes ``channels x qps_per_connection`` flows,
because every NCCL channel is its own connection and every queue pair its own ECMP hash.
A channel enters and leaves a node through the same GPU (member ``c mod m`` of the node's m
ring members), so channels spread over the node's NICs the way NCCL spreads them.
Pipeline stages exchange activations forward and gradients backward: one flow each way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import JobSpecError
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """Placement and parallel layout of one training job."""

    name: str = "job"
    nodes: list[str]
    """Node names in launcher order: node_rank i runs on nodes[i]."""
    gpus_per_node: int = 8
    tp: int = 8
    """Tensor-parallel size; groups inside one node cost the network nothing."""
    pp: int = 1
    """Pipeline-parallel size; the data-parallel size is what is left."""
    grad_bytes: int = 1 << 30
    """All-reduce message size per rank (S in nccl-tests terms), bytes."""
    pp_bytes: int = 0
    """Activation bytes each stage boundary sends per step in each direction."""
    tp_bytes: int = 0
    """All-reduce bytes of a tensor-parallel group, only used when TP spans nodes."""
    channels: int = 2
    """NCCL channels per ring; each is its own connection through the fabric."""
    qps_per_connection: int = 1
    """NCCL_IB_QPS_PER_CONNECTION: queue pairs, each hashed separately by ECMP."""

    @property
    def world(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def validate(self, topo: Topology) -> None:
        if not self.nodes:
            raise JobSpecError("job.nodes is empty")
        for key in ("gpus_per_node", "tp", "pp", "channels", "qps_per_connection"):
            if int(getattr(self, key)) < 1:
                raise JobSpecError(f"job.{key} must be >= 1")
        for key in ("grad_bytes", "pp_bytes", "tp_bytes"):
            if int(getattr(self, key)) < 0:
                raise JobSpecError(f"job.{key} must be >= 0")
        if self.world % (self.tp * self.pp):
            raise JobSpecError(
                f"job: tp*pp={self.tp * self.pp} does not divide the {self.world} ranks"
            )
        seen: set[str] = set()
        for name in self.nodes:
            if name not in topo.node_index:
                raise JobSpecError(f"job.nodes: {name!r} is not in topology {topo.name!r}")
            if name in seen:
                raise JobSpecError(f"job.nodes: {name!r} is listed twice")
            seen.add(name)


@dataclass(slots=True)
class Collective:
    """One collective operation: its flows complete together, bus bandwidth is per this."""

    name: str
    kind: str
    """``dp`` (gradient all-reduce), ``tp`` (tensor-parallel all-reduce) or ``pp`` (send/recv)."""
    ranks: list[int]
    size_bytes: int


@dataclass(slots=True)
class Flows:
    """Network flows as parallel arrays; flow i belongs to ``collectives[group[i]]``."""

    src_node: IntArray
    src_nic: IntArray
    dst_node: IntArray
    dst_nic: IntArray
    size_bytes: FloatArray
    group: IntArray
    channel: IntArray
    qp: IntArray
    collectives: list[Collective] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.size_bytes.shape[0])

    def phase(self, kind: str) -> npt.NDArray[np.bool_]:
        kinds = np.asarray([c.kind == kind for c in self.collectives] + [False], dtype=bool)
        return kinds[self.group]


class _Builder:
    def __init__(self, job: JobSpec, topo: Topology) -> None:
        self.job, self.topo = job, topo
        self.node_of_rank = [topo.node_index[n] for n in job.nodes]
        self.rows: list[tuple[int, int, int, int, float, int, int, int]] = []
        self.collectives: list[Collective] = []

    def where(self, rank: int) -> tuple[int, int]:
        gpn = self.job.gpus_per_node
        node = self.node_of_rank[rank // gpn]
        nics = len(self.topo.ports[node])
        return node, (rank % gpn) * nics // gpn

    def ring(self, name: str, kind: str, ranks: list[int], size: int, channels: int) -> None:
        n = len(ranks)
        if n < 2 or size <= 0:
            return
        blocks: list[list[int]] = []
        for r in ranks:
            node = self.where(r)[0]
            if blocks and self.where(blocks[-1][0])[0] == node:
                blocks[-1].append(r)
            else:
                blocks.append([r])
        if len(blocks) > 1 and self.where(blocks[0][0])[0] == self.where(blocks[-1][0])[0]:
            blocks[0] = blocks.pop() + blocks[0]
        if len(blocks) < 2:
            return
        g = len(self.collectives)
        self.collectives.append(
            Collective(name=name, kind=kind, ranks=list(ranks), size_bytes=size)
        )
        qps = self.job.qps_per_connection
        per_flow = 2.0 * (n - 1) / n * size / channels / qps
        for i, blk in enumerate(blocks):
            nxt = blocks[(i + 1) % len(blocks)]
            for c in range(channels):
                sn, sk = self.where(blk[c % len(blk)])
                dn, dk = self.where(nxt[c % len(nxt)])
                for q in range(qps):
                    self.rows.append((sn, sk, dn, dk, per_flow, g, c, q))

    def pipeline(self, pairs: list[tuple[int, int]], size: int) -> None:
        cross = [(a, b) for a, b in pairs if self.where(a)[0] != self.where(b)[0]]
        if not cross or size <= 0:
            return
        g = len(self.collectives)
        ranks = sorted({r for p in cross for r in p})
        self.collectives.append(Collective(name="pp", kind="pp", ranks=ranks, size_bytes=size))
        qps = self.job.qps_per_connection
        for a, b in cross:
            for s, d in ((a, b), (b, a)):
                sn, sk = self.where(s)
                dn, dk = self.where(d)
                for q in range(qps):
                    self.rows.append((sn, sk, dn, dk, size / qps, g, 0, q))

    def flows(self) -> Flows:
        arr = np.asarray(self.rows, dtype=np.float64).reshape(len(self.rows), 8)
        ints = arr.astype(np.int64)
        return Flows(
            src_node=ints[:, 0],
            src_nic=ints[:, 1],
            dst_node=ints[:, 2],
            dst_nic=ints[:, 3],
            size_bytes=arr[:, 4].copy(),
            group=ints[:, 5],
            channel=ints[:, 6],
            qp=ints[:, 7],
            collectives=self.collectives,
        )


def build_flows(job: JobSpec, topo: Topology) -> Flows:
    """All network flows of one training step of ``job`` on ``topo``."""
    job.validate(topo)
    b = _Builder(job, topo)
    tp, dp, pp = job.tp, job.dp, job.pp

    def rank(t: int, d: int, p: int) -> int:
        return t + tp * (d + dp * p)

    for p in range(pp):
        for t in range(tp):
            ranks = [rank(t, d, p) for d in range(dp)]
            b.ring(f"dp[pp={p},tp={t}]", "dp", ranks, job.grad_bytes, job.channels)
    if job.tp_bytes > 0:
        for p in range(pp):
            for d in range(dp):
                ranks = [rank(t, d, p) for t in range(tp)]
                b.ring(f"tp[pp={p},dp={d}]", "tp", ranks, job.tp_bytes, job.channels)
    if pp > 1 and job.pp_bytes > 0:
        pairs = [
            (rank(t, d, p), rank(t, d, p + 1))
            for p in range(pp - 1)
            for d in range(dp)
            for t in range(tp)
        ]
        b.pipeline(pairs, job.pp_bytes)
    return b.flows()


# ---------------------------------------------------------------------- topology-aware order


def ring_order(members: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """Reorder a ring so members with the same key (leaf) are neighbours.

    Groups keep the order in which their first member appeared, members keep their order
    within a group, so a ring that is already leaf-contiguous comes back unchanged. The
    result crosses between keys exactly once per distinct key (when there are two or more),
    which is the minimum any ring can do.
    """
    groups: dict[Hashable, list[T]] = {}
    for m in members:
        groups.setdefault(key(m), []).append(m)
    return [m for grp in groups.values() for m in grp]


def ring_crossings(order: Sequence[T], key: Callable[[T], Hashable]) -> int:
    """Ring edges (including the wrap-around) whose two ends have different keys."""
    n = len(order)
    return sum(1 for i in range(n) if n > 1 and key(order[i]) != key(order[(i + 1) % n]))


def node_locality_key(topo: Topology, node: str) -> tuple[object, ...]:
    """Where a node sits: its pod, then the set of leaves its NIC ports attach to."""
    i = topo.node_index[node]
    leaves = sorted({ref.leaf for nic in topo.ports[i] for ref in nic})
    pods = topo.pods()
    return (min(pods[leaf] for leaf in leaves), tuple(leaves))


def topology_node_order(topo: Topology, nodes: Sequence[str]) -> list[str]:
    """Launcher order (node_rank → node) that makes every ring's neighbours share leaves.

    Sorting by pod then leaf set keeps each pipeline stage's nodes together as well, since
    stages are contiguous blocks of node ranks.
    """
    pos = {n: i for i, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (node_locality_key(topo, n), pos[n]))


__all__ = [
    "Collective",
    "Flows",
    "JobSpec",
    "build_flows",
    "node_locality_key",
    "ring_crossings",
    "ring_order",
    "topology_node_order",
]
