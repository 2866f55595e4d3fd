"""Turn the agents' wire reports into the policy's inputs (readings and GPU statuses).

Kept here, next to the policy, so the controller's power loop is only plumbing: for each
report, ``readings_from_sample`` and ``gpu_statuses``, then ``policy.tick``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from power.config import Priority, WorkloadKind
from power.domains import DomainTree, Reading
from power.policy import GpuStatus
from trainguard.wire import NodeIdentity, NodeSample

#: Node label naming the priority class (``high`` or ``low``).
PRIORITY_LABEL = "trainguard.io/priority"
#: Node label naming the workload kind (``training``, ``inference``, ...).
WORKLOAD_LABEL = "trainguard.io/workload"


def priority_from_labels(labels: Mapping[str, str]) -> Priority:
    """The labelled priority; anything missing or unknown counts as high (never surprise-cap)."""
    try:
        return Priority(labels.get(PRIORITY_LABEL, "high").strip().lower())
    except ValueError:
        return Priority.HIGH


def workload_from_labels(labels: Mapping[str, str]) -> WorkloadKind | None:
    try:
        return WorkloadKind(labels.get(WORKLOAD_LABEL, "").strip().lower())
    except ValueError:
        return None


def readings_from_sample(
    node: str, sample: NodeSample, *, time_s: float | None = None, tree: DomainTree | None = None
) -> dict[str, Reading]:
    """Readings for the node's server domain (and its GPU domains, if the tree has any).

    The server reading is the node's metered power when the agent has one, else the sum of
    its GPUs; if any GPU did not answer, there is no server reading at all, so the domain
    counts as stale and holds its caps instead of trusting a partial sum. ``time_s``
    overrides the agent's timestamp with the controller's receive time, so a skewed
    agent clock cannot make an old sample look fresh.
    """
    t = sample.time_unix_s if time_s is None else time_s
    out: dict[str, Reading] = {}
    total = 0.0
    complete = bool(sample.gpus)
    for gpu in sample.gpus:
        if gpu.power_w is None or gpu.lost:
            complete = False
            continue
        total += gpu.power_w
        if tree is not None:
            gdom = tree.gpu_domain(node, gpu.index)
            if gdom is not None:
                out[gdom.name] = Reading(gpu.power_w, t)
    # A RAPL figure is RAPL plus the GPUs that answered (agents/node_power.py), so with a
    # GPU silent or lost it is a partial sum as well: trusting it would undercount the
    # server and let its domains uncap or exceed their budget. Only a sample with no GPU
    # at all (a CPU-only server) relies on RAPL alone.
    if (
        sample.node_power_w is not None
        and sample.node_power_source == "rapl"
        and (complete or not sample.gpus)
    ):
        out[node] = Reading(sample.node_power_w, t)
    elif complete:
        out[node] = Reading(total, t)
    return out


def gpu_statuses(
    identity: NodeIdentity,
    sample: NodeSample | None = None,
    *,
    priority: Priority | None = None,
    workload: WorkloadKind | None = None,
) -> list[GpuStatus]:
    """One :class:`GpuStatus` per GPU of the node, with the caps its latest sample shows."""
    prio = priority or priority_from_labels(identity.labels)
    kind = workload or workload_from_labels(identity.labels)
    current = {g.index: g for g in sample.gpus} if sample is not None else {}
    out = []
    for info in identity.gpus:
        now = current.get(info.index)
        out.append(
            GpuStatus(
                server=identity.name,
                index=info.index,
                model=info.name,
                priority=prio,
                workload=kind,
                sm_clock_max_mhz=info.sm_clock_max_mhz,
                power_limit_min_w=info.power_limit_min_w,
                power_limit_max_w=info.power_limit_max_w,
                locked_sm_clock_mhz=now.locked_sm_clock_mhz if now is not None else None,
                power_limit_w=now.power_limit_w if now is not None else None,
            )
        )
    return out


#: Where one rank of a prioritized job runs: (node, GPU index or None for "the node"),
#: and the job's priority class.
Placement = tuple[str, int | None, Priority]


def apply_job_priorities(
    gpus: Sequence[GpuStatus], placements: Iterable[Placement]
) -> list[GpuStatus]:
    """Job priorities over node priorities, GPU by GPU.

    A rank that said which GPU it runs on sets that GPU's class; one that did not sets every
    GPU of its node. Where ranks of a high- and a low-priority job share a GPU (or a rank
    without an index shares a node), high wins: capping high-priority work by surprise is
    the worse mistake. GPUs no job runs on keep their node's class.
    """
    per_gpu: dict[tuple[str, int], Priority] = {}
    per_node: dict[str, Priority] = {}
    for node, index, prio in placements:
        if index is None:
            per_node[node] = _higher(per_node.get(node), prio)
        else:
            per_gpu[(node, index)] = _higher(per_gpu.get((node, index)), prio)
    if not per_gpu and not per_node:
        return list(gpus)
    out = []
    for g in gpus:
        found = [p for p in (per_gpu.get((g.server, g.index)), per_node.get(g.server)) if p]
        if found:
            prio = Priority.HIGH if Priority.HIGH in found else Priority.LOW
            g = dataclasses.replace(g, priority=prio)
        out.append(g)
    return out


def _higher(a: Priority | None, b: Priority) -> Priority:
    return Priority.HIGH if Priority.HIGH in (a, b) else b
