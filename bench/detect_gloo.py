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

Each recorded run is replayed on 5 phasings of the agents' report timers, at the default
5 s report interval and at 1 s. Detection is told three ways: the steps of data the
verdict took (the step that completed it, from the evidence's ``at_step``, minus the fault
step: the detector's own latency, which counts in steps), and the job's steps and
seconds until the incident opened (that plus the summaries' delivery: with 5 s report
timers and ~70 ms steps, a node's summaries wait up to ~70 steps before they are sent).
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
from pathlib import Path
from typing import Any

from bench.detect_sim import Delivery, SimOutcome, replay
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
                    with self._lock:
                        self.steps.extend(batch.records.steps)
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


def run_gloo(sc: dict[str, Any]) -> list[list[StepSummary]]:
    """Run one scenario on real gloo ranks (``sc["world"]``, 8 by default, two per node);
    its step summaries, grouped by step."""
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory(prefix="tgdetect") as tmp:
        world = sc.get("world", WORLD)
        sockets = [os.path.join(tmp, f"n{i}.sock") for i in range(-(-world // PER_NODE))]
        agents = [RecordingAgent(path) for path in sockets]
        try:
            spawn(_rank, args=(str(Path(tmp) / "store"), sockets, sc), nprocs=world)  # type: ignore[no-untyped-call]
            time.sleep(0.5)  # the last batches
        finally:
            for agent in agents:
                agent.close()
    by_step: dict[int, list[StepSummary]] = {}
    for agent in agents:
        for s in agent.steps:
            by_step.setdefault(s.step, []).append(s)
    return [sorted(rows, key=lambda s: s.rank) for _, rows in sorted(by_step.items())]


#: Delivery phasings replayed per recorded run (each seed draws the agents' report phases).
REPLAY_SEEDS = (1, 2, 3, 4, 5)
#: The agents' report interval: the default (5 s), and 1 s (``--report-interval-s 1``).
REPORT_INTERVALS_S = (5.0, 1.0)
FAULT_STEP = 60
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


def replays(steps: list[list[StepSummary]]) -> dict[float, list[SimOutcome]]:
    """The recorded run delivered by agents on each report interval, each phasing seed."""
    return {
        iv: [replay(steps, PER_NODE, Delivery(interval_s=iv), seed=s) for s in REPLAY_SEEDS]
        for iv in REPORT_INTERVALS_S
    }


def straggler_figures(sc: dict[str, Any], runs: dict[float, list[SimOutcome]]) -> dict[str, Any]:
    """Per replay: steps of data the verdict took (the step that completed it, from the
    evidence, minus the fault step), and the job's steps and seconds until it opened."""
    culprit, fault = sc["culprit"], sc["fault_step"]
    out: dict[str, Any] = {
        "detect_steps": [],
        "other_incidents": 0,
        "other_stragglers": 0,
        "named": 0,
        "other_kinds": [],
    }
    for iv, outcomes in runs.items():
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
            if iv == REPORT_INTERVALS_S[0]:
                out["named"] += 1
                out["detect_steps"].append(data - fault)
        out[f"named_after_steps_{iv:g}s_reports"] = named_after
        out[f"detect_s_{iv:g}s_reports"] = seconds
    return out


def gloo_results(quick: bool) -> dict[str, Any]:
    """The fleet keys measured on real gloo runs, trainguard's and the baseline's."""
    out: dict[str, Any] = {
        "ranks": WORLD,
        "nodes": WORLD // PER_NODE,
        "replays_per_run": len(REPLAY_SEEDS),
        "report_intervals_s": list(REPORT_INTERVALS_S),
    }
    base: dict[str, Any] = {"role_straggler_detect_steps": [], "role_straggler_other_incidents": 0}
    pooled: dict[str, Any] = {"detect_steps": [], "other_incidents": 0, "named": 0, "runs": 0}
    step_s: list[float] = []
    for sc in gloo_scenarios(quick):
        steps = run_gloo(sc)
        step_s += [max(x.step_time_s for x in rows) for rows in steps]
        runs = replays(steps)
        default = runs[REPORT_INTERVALS_S[0]]
        key = {"gloo-pp": "pp", "gloo-moe": "moe", "gloo-tp-mixed": "tp_mixed"}.get(sc["name"])
        if key:
            # Straggler incidents over every replay of the run, each report interval and
            # phasing (the criterion: no straggler incident). Other findings are
            # counted beside them: on this shared 2-core machine the loopback transfers
            # themselves slow down under load, which the slow-communication check reports.
            found = [f for o in runs_all(runs) for _, f in o.opened]
            stragglers = [f for f in found if f.kind is FindingKind.STRAGGLER]
            out[f"{key}_false_positives"] = len(stragglers)
            out[f"{key}_other_findings"] = sorted(
                f.kind.value for f in found if f.kind is not FindingKind.STRAGGLER
            )
            base[f"{key}_false_positives"] = len(default[0].baseline_opened)
            out[f"{key}_steps"] = len(steps)
            continue
        fig = straggler_figures(sc, runs)
        pooled["runs"] += len(default)
        for name, value in fig.items():
            if isinstance(value, list):
                pooled.setdefault(name, []).extend(value)
            else:
                pooled[name] = pooled.get(name, 0) + value
        culprit, fault = sc["culprit"], sc["fault_step"]
        theirs = [s for s, r in default[0].baseline_opened if r == culprit and s >= fault]
        base["role_straggler_detect_steps"].append(theirs[0] - fault if theirs else None)
        base["role_straggler_other_incidents"] += sum(
            1 for _, r in default[0].baseline_opened if r != culprit
        )
    out["step_s_p50"] = round(statistics.median(step_s), 4) if step_s else None
    out["role_straggler_detect_steps"] = pooled["detect_steps"]
    out["role_straggler_detect_steps_p50"] = _p50(pooled["detect_steps"])
    out["role_straggler_detected"] = (
        round(pooled["named"] / pooled["runs"], 3) if pooled["runs"] else None
    )
    # Any other incident in those replays (a slow-communication finding counts: on a
    # loaded machine the loopback transfers themselves can slow down), and how many of
    # them were stragglers.
    out["role_straggler_other_incidents"] = pooled["other_incidents"]
    out["role_straggler_other_stragglers"] = pooled["other_stragglers"]
    out["role_straggler_other_kinds"] = sorted(set(pooled.get("other_kinds", [])))
    for iv in REPORT_INTERVALS_S:
        out[f"role_straggler_named_after_steps_p50_{iv:g}s_reports"] = _p50(
            pooled.get(f"named_after_steps_{iv:g}s_reports", [])
        )
        out[f"role_straggler_detect_s_p50_{iv:g}s_reports"] = _p50(
            pooled.get(f"detect_s_{iv:g}s_reports", [])
        )
    out["baseline"] = base
    return out


def runs_all(runs: dict[float, list[SimOutcome]]) -> list[SimOutcome]:
    return [o for outcomes in runs.values() for o in outcomes]


if __name__ == "__main__":
    print(json.dumps(gloo_results(quick=True), indent=1))
