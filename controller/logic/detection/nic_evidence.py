"""NIC evidence for slow communication: which network cards to suspect first.

A slow or failing link very often shows on its NIC before anyone times a transfer: the port
flaps (``link_downed`` rises, the port leaves ``ACTIVE``), its error counters climb, or the
RDMA device disappears. The agent turns those into hardware events and the controller keeps
them as ``hw_degraded`` / ``nic_errors`` incidents per (node, device). When a job's
communication is found slow (``comm_slow``) or a probe round localizes it (``slow_link``),
the NICs with such recent trouble on the involved nodes are named first, in this order:

1. a NIC that is the nearest (by PCIe distance) to the GPU of an involved rank, from the
   GPU-to-NIC affinity the agent reports (``wire.NicInfo.gpu_affinity``, nvidia-smi
   ``topo -m`` levels), since that is the NIC the rank's traffic leaves through;
2. then by what happened: a NIC gone, a port down or flapping, then error counters rising;
3. then the most occurrences, the most recent first.

Plain data in (issues, inventories, involved ranks), typed evidence out; the services glue
reads the incidents and the reports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

#: Hardware signals about a NIC, worst first (``controller.logic.detection.hw_rules``).
NIC_SIGNALS: tuple[str, ...] = (
    "nic_gone",
    "nic_port_down",
    "bond_member_down",
    "nic_errors_rising",
)
#: nvidia-smi ``topo -m`` levels, nearest first; a NIC at one of the first three shares a
#: PCIe switch or root complex with the GPU.
AFFINITY_LEVELS: tuple[str, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")
#: How long a NIC issue counts as evidence after its last occurrence (seconds).
DEFAULT_WINDOW_S = 900.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NicIssue:
    """Recent trouble on one NIC (one ``hw_degraded`` / ``nic_errors`` incident)."""

    node: str
    device: str
    signal: str
    count: int
    last_unix_s: float
    detail: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class NicPort:
    """One RDMA port as the node's agent describes it (``wire.NicInfo``)."""

    device: str
    port: int
    pci_bus_id: str = ""
    #: GPU index -> affinity level (``PIX`` … ``SYS``).
    gpu_affinity: Mapping[int, str]


@dataclass(frozen=True, kw_only=True, slots=True)
class InvolvedRank:
    rank: int
    node: str
    gpu_index: int | None


class AffineNic(BaseModel):
    """The NIC nearest an involved rank's GPU (the one its traffic leaves through)."""

    model_config = ConfigDict(frozen=True)

    rank: int
    node: str
    gpu_index: int
    device: str
    level: str
    nic_index: int
    """Position of the device among the node's RDMA devices (PCI order): the fabric's nic<k>."""


class NicSuspect(BaseModel):
    """A NIC with recent errors or flaps on a node the slow communication involves."""

    model_config = ConfigDict(frozen=True)

    node: str
    device: str
    signal: str
    count: int
    last_unix_s: float
    age_s: float
    nic_index: int | None
    """The fabric's nic<k> for this device (``None``: the node reported no such RDMA port)."""
    affine_ranks: list[int]
    """Involved ranks whose GPU is nearest this NIC."""
    detail: str
    why: str


class NicEvidence(BaseModel):
    """What an incident's ``nic`` evidence holds: suspects ranked, first one first."""

    model_config = ConfigDict(frozen=True)

    suspects: list[NicSuspect]
    affine: list[AffineNic]
    window_s: float

    def as_json(self) -> dict[str, object]:
        return self.model_dump(mode="json")

    def headline(self) -> str:
        """One clause for the incident summary (empty: no NIC to suspect)."""
        if not self.suspects:
            return ""
        s = self.suspects[0]
        near = f", nearest NIC of rank(s) {s.affine_ranks}" if s.affine_ranks else ""
        more = f" (+{len(self.suspects) - 1} more)" if len(self.suspects) > 1 else ""
        return f"first suspect: NIC {s.device} on {s.node} ({s.signal} x{s.count}{near}){more}"


def _natural(text: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def device_order(ports: Sequence[NicPort]) -> list[str]:
    """The node's RDMA devices in PCI bus order (name order when a bus id is missing): the
    order the fabric description numbers a node's NICs (rail k = the k-th device)."""
    first: dict[str, NicPort] = {}
    for p in ports:
        first.setdefault(p.device, p)
    return sorted(first, key=lambda d: (first[d].pci_bus_id or "~", _natural(d)))


def affine_nics(
    inventory: Mapping[str, Sequence[NicPort]], involved: Iterable[InvolvedRank]
) -> list[AffineNic]:
    """For each involved rank with a known GPU, the nearest NIC (ties: PCI order)."""
    out: list[AffineNic] = []
    for r in involved:
        ports = inventory.get(r.node, ())
        if r.gpu_index is None or not ports:
            continue
        order = device_order(ports)
        best: tuple[int, int, str, str] | None = None
        for p in ports:
            level = p.gpu_affinity.get(r.gpu_index)
            if level not in AFFINITY_LEVELS:
                continue
            key = (AFFINITY_LEVELS.index(level), order.index(p.device), p.device, level)
            if best is None or key < best:
                best = key
        if best is not None:
            _, k, device, level = best
            out.append(
                AffineNic(
                    rank=r.rank,
                    node=r.node,
                    gpu_index=r.gpu_index,
                    device=device,
                    level=level,
                    nic_index=k,
                )
            )
    return out


def nic_evidence(
    issues: Iterable[NicIssue],
    inventory: Mapping[str, Sequence[NicPort]],
    involved: Sequence[InvolvedRank],
    now_unix_s: float,
    *,
    window_s: float = DEFAULT_WINDOW_S,
) -> NicEvidence:
    """Rank the recent NIC issues on the involved nodes (see the module docstring)."""
    nodes = {r.node for r in involved}
    affine = affine_nics(inventory, involved)
    near: dict[tuple[str, str], list[int]] = {}
    for a in affine:
        near.setdefault((a.node, a.device), []).append(a.rank)
    best: dict[tuple[str, str], NicIssue] = {}
    for issue in issues:
        if issue.node not in nodes or issue.signal not in NIC_SIGNALS:
            continue
        if now_unix_s - issue.last_unix_s > window_s:
            continue
        key = (issue.node, issue.device)
        held = best.get(key)
        if held is None or NIC_SIGNALS.index(issue.signal) < NIC_SIGNALS.index(held.signal):
            best[key] = issue
    suspects: list[NicSuspect] = []
    for (node, device), issue in best.items():
        ranks = sorted(near.get((node, device), []))
        order = device_order(inventory.get(node, ()))
        why = (
            f"nearest NIC of rank(s) {ranks} on {node}"
            if ranks
            else f"on {node}, which the slow communication involves"
        )
        suspects.append(
            NicSuspect(
                node=node,
                device=device,
                signal=issue.signal,
                count=issue.count,
                last_unix_s=issue.last_unix_s,
                age_s=round(max(0.0, now_unix_s - issue.last_unix_s), 3),
                nic_index=order.index(device) if device in order else None,
                affine_ranks=ranks,
                detail=issue.detail,
                why=why,
            )
        )
    suspects.sort(
        key=lambda s: (
            not s.affine_ranks,
            NIC_SIGNALS.index(s.signal),
            -s.count,
            -s.last_unix_s,
            s.node,
            _natural(s.device),
        )
    )
    return NicEvidence(suspects=suspects, affine=affine, window_s=window_s)


__all__ = [
    "AFFINITY_LEVELS",
    "DEFAULT_WINDOW_S",
    "NIC_SIGNALS",
    "AffineNic",
    "InvolvedRank",
    "NicEvidence",
    "NicIssue",
    "NicPort",
    "NicSuspect",
    "affine_nics",
    "device_order",
    "nic_evidence",
]
