"""Our plan against random ECMP hashing and the contention-free ideal, in nccl-tests terms.

ECMP is modelled as what a good hash does to few large flows: every decision point picks
one of its equal-cost next hops independently and uniformly, so each candidate path is
drawn with the probability stored in its :class:`~.routes.CandidateSet`. The baseline is
the job as launched (the scheduler's node order) under ECMP; the row "ecmp, topology order"
isolates what path planning adds on top of the ring reordering.

nccl-tests conventions: algbw = S / t; all-reduce busbw = algbw · 2(n-1)/n, with S the
per-rank message size and n the ranks in one all-reduce; t includes 2(n-1) ring steps of
``hop_latency_s``. Step time = compute + (1 - overlap) · communication, communication
being the data-parallel all-reduce plus the pipeline and tensor-parallel phases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.jobs import Flows, JobSpec, build_flows
from controller.logic.traffic.planner import Plan, Planner
from controller.logic.traffic.routes import CandidateSet
from controller.logic.traffic.sim import completion_times, ideal_time_s
from controller.logic.traffic.topology import Topology

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
PHASES = ("dp", "tp", "pp")


@dataclass(kw_only=True, slots=True)
class SimConfig:
    ecmp_seeds: int = 20
    """Independent ECMP draws; median and p95 are taken over them."""
    seed: int = 0
    compute_time_s: float = 0.0
    """Compute time of one training step, for the step-time estimate."""
    overlap_fraction: float = 0.0
    """Share of communication hidden behind compute (0 = none, conservative)."""
    hop_latency_s: float = 0.0
    """alpha per ring step; 0 keeps the comparison purely about bandwidth."""


@dataclass(slots=True)
class Traffic:
    """Flows with their candidate paths: what the simulator needs besides a routing."""

    flows: Flows
    sets: list[CandidateSet]
    set_of: IntArray


@dataclass(slots=True)
class Variant:
    name: str
    phase_s: dict[str, float]
    allreduce_s: float
    busbw_bytes_per_s: float
    algbw_bytes_per_s: float
    step_s: float
    samples_s: list[float] = field(default_factory=list)


def traffic_of(plan: Plan) -> Traffic:
    return Traffic(plan.flows, plan.sets, plan.set_of)


def unplanned_traffic(planner: Planner, job: JobSpec) -> Traffic:
    """The job as launched (its own node order), with candidates but no routing decision."""
    flows = build_flows(job, planner.topo)
    sets, set_of = planner.candidate_sets(flows)
    return Traffic(flows, sets, set_of)


def ecmp_paths(topo: Topology, traffic: Traffic, rng: np.random.Generator) -> IntArray:
    """One random ECMP outcome: a path per flow drawn with its candidate's probability."""
    sets, set_of = traffic.sets, traffic.set_of
    if not sets:
        return np.zeros((0, 1), dtype=np.int64)
    widest = max((len(cs) for cs in sets), default=1)
    cum = np.full((len(sets), widest), np.inf)
    total = np.zeros(len(sets))
    count = np.zeros(len(sets), dtype=np.int64)
    offsets = np.zeros(len(sets), dtype=np.int64)
    for i, cs in enumerate(sets):
        cum[i, : len(cs)] = np.cumsum(cs.prob)
        total[i] = cum[i, len(cs) - 1]
        count[i] = len(cs)
        offsets[i] = offsets[i - 1] + count[i - 1] if i else 0
    links = np.concatenate([cs.links for cs in sets])
    u = rng.random(len(set_of)) * total[set_of]
    idx = np.minimum((cum[set_of] <= u[:, None]).sum(axis=1), count[set_of] - 1)
    chosen: IntArray = links[offsets[set_of] + idx]
    return chosen


def _dp_ranks(traffic: Traffic) -> tuple[int, int]:
    dp = [c for c in traffic.flows.collectives if c.kind == "dp"]
    if not dp:
        return 0, 0
    return len(dp[0].ranks), dp[0].size_bytes


def _variant(
    name: str,
    topo: Topology,
    traffic: Traffic,
    phase_s: dict[str, float],
    cfg: SimConfig,
    samples: list[float] | None = None,
) -> Variant:
    n, size = _dp_ranks(traffic)
    ar = phase_s.get("dp", 0.0) + (2 * (n - 1) * cfg.hop_latency_s if n else 0.0)
    algbw = size / ar if ar > 0 else 0.0
    busbw = algbw * 2 * (n - 1) / n if n else 0.0
    comm = ar + sum(v for k, v in phase_s.items() if k != "dp")
    step = cfg.compute_time_s + (1 - cfg.overlap_fraction) * comm
    return Variant(name, phase_s, ar, busbw, algbw, step, samples or [])


def phase_times(topo: Topology, traffic: Traffic, paths: IntArray) -> dict[str, float]:
    cap = topo.capacity_ext()
    out: dict[str, float] = {}
    for kind in PHASES:
        mask = traffic.flows.phase(kind)
        if mask.any():
            fin = completion_times(
                paths[mask], traffic.flows.size_bytes[mask], cap, topo.dummy_link
            )
            out[kind] = float(fin.max())
    return out


def ideal_phase_times(topo: Topology, traffic: Traffic) -> dict[str, float]:
    fl = traffic.flows
    out: dict[str, float] = {}
    for kind in PHASES:
        m = fl.phase(kind)
        if m.any():
            out[kind] = ideal_time_s(
                topo,
                (fl.src_node[m], fl.src_nic[m]),
                (fl.dst_node[m], fl.dst_nic[m]),
                fl.size_bytes[m],
                traffic.sets,
                traffic.set_of[m],
            )
    return out


def compare(
    plan: Plan,
    baseline: Traffic,
    cfg: SimConfig,
    *,
    paths_only: Plan | None = None,
    ecmp: bool = True,
    topology_order_ecmp: bool = True,
) -> list[Variant]:
    """Rows: ECMP median and p95 (job as launched), our paths for the job as launched
    (``paths_only``, when given: planned without ring reordering, what C4P itself does),
    ECMP with our ring order, our plan, and the ideal bound.

    ``ecmp=False`` leaves out every ECMP row and ``topology_order_ecmp=False`` the one with
    our ring order (the same as the first when the plan keeps the launcher's order): each
    ECMP draw is a full simulation, which dominates the cost with tens of thousands of flows.
    """
    topo = plan.topology
    rng = np.random.default_rng(cfg.seed)
    ours_t = traffic_of(plan)
    rows: list[Variant] = []
    ecmp_runs = [("ecmp", baseline), ("ecmp, topology order", ours_t)] if ecmp else []
    if not topology_order_ecmp:
        ecmp_runs = ecmp_runs[:1]
    for label, traffic in ecmp_runs:
        runs = [
            _variant(
                label,
                topo,
                traffic,
                phase_times(topo, traffic, ecmp_paths(topo, traffic, rng)),
                cfg,
            )
            for _ in range(max(1, cfg.ecmp_seeds))
        ]
        runs.sort(key=lambda v: v.step_s)
        samples = [v.allreduce_s for v in runs]
        med = runs[(len(runs) - 1) // 2]
        p95 = runs[min(len(runs) - 1, int(np.ceil(0.95 * len(runs))) - 1)]
        rows.append(_variant(f"{label} median", topo, traffic, med.phase_s, cfg, samples))
        if label == "ecmp":
            rows.append(_variant(f"{label} p95", topo, traffic, p95.phase_s, cfg, samples))
            if paths_only is not None:
                po = traffic_of(paths_only)
                rows.append(
                    _variant(
                        "ours, paths only", topo, po, phase_times(topo, po, paths_only.paths()), cfg
                    )
                )
    rows.append(_variant("ours", topo, ours_t, phase_times(topo, ours_t, plan.paths()), cfg))
    ideal: dict[str, float] = {}
    for traffic in (baseline, ours_t):
        for k, v in ideal_phase_times(topo, traffic).items():
            ideal[k] = min(ideal.get(k, np.inf), v)
    rows.append(_variant("ideal", topo, ours_t, ideal, cfg))
    return rows


__all__ = [
    "SimConfig",
    "Traffic",
    "Variant",
    "compare",
    "ecmp_paths",
    "ideal_phase_times",
    "phase_times",
    "traffic_of",
    "unplanned_traffic",
]
