"""Real multi-process gloo runs for bench.detect: measured step timings, replayed to the detectors.

Eight ranks (4 nodes x 2) run a small job on torch.distributed (gloo over loopback) with the
real ``collectives`` instrumentation. Their step summaries (compute, collective wait and
bytes measured by the wrapper; roles derived from a real ``DeviceMesh`` or declared) go over
the real Unix-socket protocol to a recording stand-in for each node's agent. The recorded
summaries are then delivered to the detectors as agents on independent 5 s report phases
would deliver them (``bench.detect_sim.replay``), beside the threshold baseline fed the same
steps. Only the delivery is simulated; the timings, roles and bytes are the ranks' own.

Scenarios: a pipeline (DeviceMesh pp=4 x dp=2) whose last stage sleeps 30% longer; MoE
experts (role declared) whose token share is skewed 2x, moving uneven all-to-all volumes
(dispatch and combine with ``all_to_all_single`` splits); TP groups of two sizes built with
plain ``new_group`` (ranks 0-5 two groups of 3, ranks 6-7 one group of 2 whose ranks hold a
larger shard and compute 35% longer), no role declared: the peer groups come from the
process groups' sizes; the pipeline with one middle-stage rank slowed 15% (the
``slowdown`` fault) from step 60 (ranks 3 and 4, stages 1 and 2; 3 only with ``quick``).

Each recorded run is replayed as deployed: every summary reached its node's agent at the
time recorded, each agent seals reports by its own rule (``agents.cadence``, the code the
daemon runs) on its own phase, the controller observes a report on arrival and evaluates
on its own 1 s tick; 5 phasings per run, with the agents' default settings and, for
comparison, the 5 s timer alone (before the early flush for step summaries) and a 1 s
timer. The figure is the job's steps from the fault until the incident opened (and its
seconds); the steps of data the verdict took (the step that completed it, from the
evidence's ``at_step``, minus the fault step) are reported beside it.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.detect_sim import (
    AgentCadence,
    SimOutcome,
    ThresholdBaseline,
    agent_sends,
    node_arrivals,
    replay_deployed,
)
from controller.logic.detection.c4d import FindingKind
from trainguard.framing import FrameError, encode_frame, read_frame
from trainguard.wire import LocalRecords, LocalReply, StepSummary

WORLD = 8
PER_NODE = 2


class RecordingAgent:
    """Accepts the ranks' connections on one node's socket and keeps their step summaries."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[StepSummary] = []
        #: Monotonic time each summary reached this node's agent (the ranks ship every
        #: ~0.15 s): when a deployed agent could first have sent it.
        self.arrived_s: list[float] = []
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reply = encode_frame(LocalReply().model_dump_json().encode())
        with conn:
            try:
                read_frame(conn)  # hello
                conn.sendall(reply)
                while True:
                    batch = LocalRecords.model_validate_json(read_frame(conn))
                    now = time.monotonic()
                    with self._lock:
                        self.steps.extend(batch.records.steps)
                        self.arrived_s.extend(now for _ in batch.records.steps)
                    conn.sendall(reply)
            except (OSError, FrameError):
                return

    def close(self) -> None:
        self._server.close()


def _rank(rank: int, store: str, sockets: list[str], sc: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import collectives

    os.environ.update(
        {
            "TRAINGUARD_JOB": sc["name"],
            "TRAINGUARD_AGENT_SOCKET": sockets[rank // PER_NODE],
            "TRAINGUARD_FAULTS": json.dumps(sc.get("faults", [])),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    world = sc.get("world", WORLD)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    collectives.instrument(role=sc.get("role"))
    compute_s = sc["compute_s"]
    pp = sc.get("pp", 0)
    if pp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
        coord = mesh.get_coordinate()
        if coord is not None and coord[0] == pp - 1:
            compute_s *= 1 + sc.get("last_stage_extra", 0.0)
    tp_group = None
    for members in sc.get("tp_groups", []):  # new_group is collective: every rank, same order
        group = dist.new_group(ranks=members)
        if rank in members:
            tp_group, tp_size = group, len(members)
            compute_s *= sc.get("tp_work", {}).get(str(tp_size), 1.0)
    noise = random.Random(rank)
    shares = [1 + (sc.get("moe_skew", 1.0) - 1) * i / (world - 1) for i in range(world)]
    random.Random(7).shuffle(shares)
    rows_per_share, hidden = 64, 64
    tokens = [int(rows_per_share * s) for s in shares]  # tokens each expert receives
    grad = torch.zeros(4096)
    for step in range(sc["steps"]):
        with collectives.step(step):
            if sc.get("moe_skew"):
                # Attention alike on every rank; the expert's work grows with its tokens.
                work = 0.4 + 0.6 * shares[rank] / (sum(shares) / world)
                time.sleep(compute_s * work * (1 + noise.uniform(-0.05, 0.05)))
                send = [tokens[e] // world for e in range(world)]
                recv = [tokens[rank] // world] * world
                x = torch.ones(sum(send), hidden)
                y = torch.empty(sum(recv), hidden)
                dist.all_to_all_single(y, x, recv, send)  # dispatch: equal volume out
                z = torch.empty(sum(send), hidden)
                dist.all_to_all_single(z, y, send, recv)  # combine: the expert's tokens back
            else:
                time.sleep(compute_s * (1 + noise.uniform(-0.05, 0.05)))
            if tp_group is not None:
                dist.all_reduce(grad[:1024], group=tp_group)
            dist.all_reduce(grad)
    dist.barrier()
    collectives.uninstrument()
    dist.destroy_process_group()


@dataclass
class GlooRun:
    """One recorded run: its step summaries grouped by step, and when each summary reached
    its node's agent (monotonic seconds from the first arrival)."""

    steps: list[list[StepSummary]]
    arrived_s: dict[tuple[int, int], float] = field(default_factory=dict)


def run_gloo(sc: dict[str, Any]) -> list[list[StepSummary]]:
    """Run one scenario on real gloo ranks (``sc["world"]``, 8 by default, two per node);
    its step summaries, grouped by step."""
    return record_gloo(sc).steps


def record_gloo(sc: dict[str, Any]) -> GlooRun:
    """Run one scenario on real gloo ranks; its summaries and their arrival times."""
    import multiprocessing

    from torch.multiprocessing.spawn import start_processes

    # Ranks forked from a server that imported torch and this module once: spawned, each
    # rank imported them itself (~2 s of CPU each on a 2-core machine, more than the
    # scenario's own work). Nothing in the preload starts a thread, so forking it is safe.
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "collectives", __name__])
    with tempfile.TemporaryDirectory(prefix="tgdetect") as tmp:
        world = sc.get("world", WORLD)
        sockets = [os.path.join(tmp, f"n{i}.sock") for i in range(-(-world // PER_NODE))]
        agents = [RecordingAgent(path) for path in sockets]
        try:
            start_processes(  # type: ignore[no-untyped-call]
                _rank,
                args=(str(Path(tmp) / "store"), sockets, sc),
                nprocs=world,
                start_method="forkserver",
            )
            time.sleep(0.5)  # the last batches
        finally:
            for agent in agents:
                agent.close()
    by_step: dict[int, list[StepSummary]] = {}
    arrived: dict[tuple[int, int], float] = {}
    for agent in agents:
        for s, t in zip(agent.steps, agent.arrived_s, strict=True):
            by_step.setdefault(s.step, []).append(s)
            arrived[(s.step, s.rank)] = t
    t0 = min(arrived.values(), default=0.0)
    return GlooRun(
        [sorted(rows, key=lambda s: s.rank) for _, rows in sorted(by_step.items())],
        {key: t - t0 for key, t in arrived.items()},
    )


#: Delivery phasings replayed per recorded run (each seed draws the agents' report phases
#: and the controller's tick phase).
REPLAY_SEEDS = (1, 2, 3, 4, 5)
FAULT_STEP = 60
#: The agents' report settings each recorded run is replayed with: the shipped defaults
#: (5 s timer, and a report once a rank has 8 new step summaries, at most one a second:
#: ``agents.cadence``), and for comparison the timer alone at 5 s (the behaviour before
#: the early flush) and at 1 s.
CADENCES: dict[str, AgentCadence] = {
    "default": AgentCadence.defaults(),
    "timer_5s": AgentCadence(report_interval_s=5.0, job_flush_steps=0),
    "timer_1s": AgentCadence(report_interval_s=1.0, job_flush_steps=0),
}
#: TP groups of two sizes: ranks 0-5 in two groups of 3, ranks 6-7 in a group of 2 whose
#: ranks hold a larger shard (35% more compute per step, as in bench.detect_sim): compared
#: job-wide, the two would be stragglers.
TP_MIXED: dict[str, Any] = {"tp_groups": [[0, 1, 2], [3, 4, 5], [6, 7]], "tp_work": {"2": 1.35}}


def gloo_scenarios(quick: bool) -> list[dict[str, Any]]:
    steps = 220 if quick else 300
    pp = {"pp": 4, "last_stage_extra": 0.3, "compute_s": 0.04, "steps": steps}
    out: list[dict[str, Any]] = [
        {"name": "gloo-pp", **pp},
        {"name": "gloo-moe", "role": "expert", "moe_skew": 2.0, "compute_s": 0.04, "steps": steps},
        {"name": "gloo-tp-mixed", **TP_MIXED, "compute_s": 0.04, "steps": steps},
    ]
    # One rank of a middle stage (mesh pp=4 x dp=2: stage = rank // 2) slowed 15%.
    for culprit in (3,) if quick else (3, 4):
        out.append(
            {
                "name": f"gloo-pp-straggler-{culprit}",
                **pp,
                "faults": [
                    {"kind": "slowdown", "rank": culprit, "from_step": FAULT_STEP, "factor": 1.15}
                ],
                "culprit": culprit,
                "fault_step": FAULT_STEP,
            }
        )
    return out


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def replays(run: GlooRun) -> dict[str, list[SimOutcome]]:
    """The recorded run delivered by agents with each cadence, each phasing seed."""
    return {
        name: [
            replay_deployed(run.steps, run.arrived_s, PER_NODE, cadence, seed=s)
            for s in REPLAY_SEEDS
        ]
        for name, cadence in CADENCES.items()
    }


def reports_per_node_s(run: GlooRun, cadence: AgentCadence) -> float:
    """Reports per second one node's agent seals while the job runs, with ``cadence``
    (the ingest load the setting costs; the timer's empty reports included)."""
    rates = []
    for i, items in enumerate(node_arrivals(run.steps, run.arrived_s, PER_NODE).values()):
        first, last = items[0][0], items[-1][0]
        sealed: list[float] = []
        agent_sends(items, cadence, random.Random(i).uniform(0, cadence.report_interval_s), sealed)
        if last > first:
            rates.append(sum(1 for t in sealed if first <= t <= last) / (last - first))
    return round(statistics.mean(rates), 3) if rates else 0.0


def straggler_figures(sc: dict[str, Any], runs: dict[str, list[SimOutcome]]) -> dict[str, Any]:
    """Per replay: the job's steps from the fault until the incident opened (the job's
    step then, minus the fault step), its seconds, and the steps of data the verdict took
    (the step that completed it, from the evidence's ``at_step``, minus the fault step)."""
    culprit, fault = sc["culprit"], sc["fault_step"]
    out: dict[str, Any] = {
        "data_steps": [],
        "other_incidents": 0,
        "other_stragglers": 0,
        "named": 0,
        "other_kinds": [],
    }
    for name, outcomes in runs.items():
        named_after: list[float] = []
        seconds: list[float] = []
        for res in outcomes:
            others = [f for _, f in res.opened if f.ranks != (culprit,)]
            out["other_incidents"] += len(others)
            out["other_stragglers"] += sum(1 for f in others if f.kind is FindingKind.STRAGGLER)
            out["other_kinds"] += sorted({f.kind.value for f in others} - set(out["other_kinds"]))
            mine = [
                (step, data, t)
                for (step, f), data, t in zip(
                    res.opened, res.opened_data_step, res.opened_s, strict=True
                )
                if f.ranks == (culprit,)
            ]
            if not mine:
                continue
            step, data, t = mine[0]
            named_after.append(step - fault)
            seconds.append(round(t - res.step_end_s[fault - 1], 1))
            if name == "default":
                out["named"] += 1
                out["data_steps"].append(data - fault)
        out[f"named_after_steps_{name}"] = named_after
        out[f"detect_s_{name}"] = seconds
    return out


def gloo_results(quick: bool) -> dict[str, Any]:
    """The fleet keys measured on real gloo runs, trainguard's and the baseline's."""
    out: dict[str, Any] = {
        "ranks": WORLD,
        "nodes": WORLD // PER_NODE,
        "replays_per_run": len(REPLAY_SEEDS),
        "cadences": {name: asdict(c) for name, c in CADENCES.items()},
    }
    base: dict[str, Any] = {"role_straggler_detect_steps": [], "role_straggler_other_incidents": 0}
    pooled: dict[str, Any] = {"other_incidents": 0, "named": 0, "runs": 0}
    step_s: list[float] = []
    rates: dict[str, list[float]] = {name: [] for name in CADENCES}
    for sc in gloo_scenarios(quick):
        run = record_gloo(sc)
        steps = run.steps
        step_s += [max(x.step_time_s for x in rows) for rows in steps]
        for name, cadence in CADENCES.items():
            rates[name].append(reports_per_node_s(run, cadence))
        runs = replays(run)
        key = {"gloo-pp": "pp", "gloo-moe": "moe", "gloo-tp-mixed": "tp_mixed"}.get(sc["name"])
        if key:
            # Straggler incidents over every replay of the run, each cadence and phasing
            # (the criterion: no straggler incident). Other findings are counted
            # beside them: on this shared 2-core machine the loopback transfers themselves
            # slow down under load, which the slow-communication check reports.
            found = [f for o in runs_all(runs) for _, f in o.opened]
            stragglers = [f for f in found if f.kind is FindingKind.STRAGGLER]
            out[f"{key}_false_positives"] = len(stragglers)
            out[f"{key}_other_findings"] = sorted(
                f.kind.value for f in found if f.kind is not FindingKind.STRAGGLER
            )
            base[f"{key}_false_positives"] = len(_baseline(steps))
            out[f"{key}_steps"] = len(steps)
            continue
        fig = straggler_figures(sc, runs)
        pooled["runs"] += len(runs["default"])
        for name, value in fig.items():
            if isinstance(value, list):
                pooled.setdefault(name, []).extend(value)
            else:
                pooled[name] = pooled.get(name, 0) + value
        culprit, fault = sc["culprit"], sc["fault_step"]
        opened = _baseline(steps)
        theirs = [s for s, r in opened if r == culprit and s >= fault]
        base["role_straggler_detect_steps"].append(theirs[0] - fault if theirs else None)
        base["role_straggler_other_incidents"] += sum(1 for _, r in opened if r != culprit)
    out["step_s_p50"] = round(statistics.median(step_s), 4) if step_s else None
    # The figure: the job's steps from the fault until the straggler incident
    # opened, agents and controller at their defaults (delivery and tick included).
    detect_steps = pooled.get("named_after_steps_default", [])
    out["role_straggler_detect_steps"] = detect_steps
    out["role_straggler_detect_steps_p50"] = _p50(detect_steps)
    out["role_straggler_data_steps_p50"] = _p50(pooled.get("data_steps", []))
    out["role_straggler_detected"] = (
        round(pooled["named"] / pooled["runs"], 3) if pooled["runs"] else None
    )
    # Any other incident in those replays (a slow-communication finding counts: on a
    # loaded machine the loopback transfers themselves can slow down), and how many of
    # them were stragglers.
    out["role_straggler_other_incidents"] = pooled["other_incidents"]
    out["role_straggler_other_stragglers"] = pooled["other_stragglers"]
    out["role_straggler_other_kinds"] = sorted(set(pooled.get("other_kinds", [])))
    for name in CADENCES:
        out[f"role_straggler_named_after_steps_p50_{name}"] = _p50(
            pooled.get(f"named_after_steps_{name}", [])
        )
        out[f"role_straggler_detect_s_p50_{name}"] = _p50(pooled.get(f"detect_s_{name}", []))
        out[f"reports_per_node_s_{name}"] = round(statistics.mean(rates[name]), 3)
    out["baseline"] = base
    return out


def _baseline(steps: list[list[StepSummary]]) -> list[tuple[int, int]]:
    """The threshold baseline fed the same steps complete and in order: (step, rank)."""
    baseline = ThresholdBaseline()
    return [
        (rows[0].step, r)
        for rows in steps
        for r in baseline.add({s.rank: s.compute_time_s for s in rows})
    ]


def runs_all(runs: dict[str, list[SimOutcome]]) -> list[SimOutcome]:
    return [o for outcomes in runs.values() for o in outcomes]


if __name__ == "__main__":
    print(json.dumps(gloo_results(quick=True), indent=1))
