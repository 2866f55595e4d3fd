"""Re-planning through the controller's API: what an operator (or a slow-link incident) waits.

A real controller (uvicorn on an ephemeral port, SQLite in a temporary directory) loads a
two-tier rail-optimized fat tree (8 bonded 2x200G NICs per node, 1:1) from a topology file.
Agents' reports place a job (tp=8, data-parallel rings, 2 channels) on a random half of the
cluster's nodes; ``POST /plans`` plans it. Then, repeatedly, a spine cable the plan uses is
marked down (``POST /topology/links/{cable}/state``) and healed again. Reported per cable:
the server's re-plan time (re-plan + source ports for the moved flows, in the reply),
the client's wall time for the whole request (including the database commit of the new
version and the JSON reply), and flows moved. The baseline, in the same run, is the library
doing the same work alone (``Planner.replan`` + ``enforce_changed`` on the same fabric and
job, no HTTP, no database), and next to it re-plan plus enforcement of every flow.

``--json``: the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from bench._server import Server as _Server
from controller.logic.traffic.enforce import enforce, enforce_changed
from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Planner

FABRIC = {"nics_per_node": 8, "ports_per_nic": 2, "port_speed_gbps": 200.0, "nodes_per_leaf": 16}


def Server(workdir: Path, topology_file: Path) -> _Server:
    """The traffic API bench's controller, with the fabric from ``topology_file``."""
    return _Server(
        workdir, ("agent", "operator"), client_timeout_s=300, topology_file=topology_file
    )


def report_job(agent: httpx.Client, job: str, nodes: list[str]) -> None:
    world = len(nodes) * 8
    for seq, node in enumerate(nodes):
        rows = [
            {"job": job, "rank": i * 8 + g, "world_size": world, "step": 0,
             "compute_time_s": 1.0, "collective_wait_s": 0.1, "step_time_s": 1.1, "gpu_index": g}
            for i in [seq] for g in range(8)
        ]  # fmt: skip
        body = {
            "node": {"name": node, "gpus": [{"index": g, "uuid": f"{node}-{g}"} for g in range(8)]},
            "agent_instance": "bench", "seq": 0, "sent_unix_s": time.time(),
            "job": {"steps": rows}, "samples": [],
        }  # fmt: skip
        reply = agent.post("/api/v1/reports", json=body)
        reply.raise_for_status()


def spine_cables(plan: dict[str, Any], count: int) -> list[str]:
    """Distinct leaf--spine cables the plan's flows cross, most used first."""
    uses: dict[str, int] = {}
    for qps in plan["source_ports"]["nodes"].values():
        for q in qps:
            for link in q["path"]:
                a, _, b = link.partition("->")
                if "spine" in b and "/" not in a:
                    uses[f"{a}--{b}"] = uses.get(f"{a}--{b}", 0) + 1
    return sorted(uses, key=lambda c: -uses[c])[:count]


def library_replan_ms(
    nodes_total: int, job: JobSpec, cables: list[str]
) -> tuple[list[float], list[float]]:
    """The server's procedure without HTTP or database (re-plan, ports for moved flows), and
    for comparison re-plan plus enforcement of every flow (what a naive service would do)."""
    topo = build_fat_tree(FatTreeSpec(nodes=nodes_total, **FABRIC))  # type: ignore[arg-type]
    planner = Planner(topo)
    cfg = HashConfig()
    plan, ports = enforce(planner.plan(job), cfg)
    incremental, full = [], []
    for cable in cables:
        t0 = time.perf_counter()
        new = planner.replan(plan, [(cable, 0.0)])
        moved = np.flatnonzero((plan.paths() != new.paths()).any(axis=1))
        if enforce_changed(new, cfg, ports, moved) is None:
            enforce(new, cfg, hash_aware=False, repair_budget_s=0.0)
        incremental.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        enforce(new, cfg, hash_aware=False, repair_budget_s=0.0)
        full.append((time.perf_counter() - t0) * 1e3 + incremental[-1])
        topo.set_health(topo.resolve_link(cable), 1.0)
    return incremental, full


def run_case(gpus: int, repeats: int) -> dict[str, Any]:
    nodes = gpus // 8
    total = nodes * 2
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        workdir = Path(tmp)
        fabric = workdir / "fabric.yaml"
        fabric.write_text(yaml.safe_dump({"name": "bench", "fat_tree": {"nodes": total, **FABRIC}}))
        names = [n.name for n in build_fat_tree(FatTreeSpec(nodes=total, **FABRIC)).nodes]  # type: ignore[arg-type]
        chosen = random.Random(gpus).sample(names, nodes)
        server = Server(workdir, fabric)
        try:
            with server.client("agent") as agent, server.client("operator") as op:
                report_job(agent, "bench-job", chosen)
                t0 = time.perf_counter()
                reply = op.post("/api/v1/plans", json={"job": "bench-job", "layout": {"tp": 8}})
                create_s = time.perf_counter() - t0
                reply.raise_for_status()
                plan = reply.json()
                cables = spine_cables(plan, repeats)
                server_ms, wall_ms, moved = [], [], []
                for cable in cables:
                    t0 = time.perf_counter()
                    down = op.post(f"/api/v1/topology/links/{cable}/state", json={"state": "down"})
                    wall_ms.append((time.perf_counter() - t0) * 1e3)
                    down.raise_for_status()
                    (changed,) = down.json()["plans"]
                    server_ms.append(down.json()["replan_ms"])
                    moved.append(changed["moved_flows"])
                    op.post(f"/api/v1/topology/links/{cable}/state", json={"state": "up"})
        finally:
            server.stop()
    order = [o["node"] for o in plan["launcher_order"]]
    job = JobSpec(name="bench-job", nodes=order, tp=8, channels=2)
    library, full = library_replan_ms(total, job, cables)
    return {
        "gpus": gpus,
        "flows": plan["flows"],
        "create_s": create_s,
        "replan_ms_server": statistics.median(server_ms),
        "replan_ms_wall": statistics.median(wall_ms),
        "replan_ms_library": statistics.median(library),
        "replan_ms_library_full_enforce": statistics.median(full),
        "moved_flows": statistics.median(moved),
        "cables": len(cables),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="512 GPUs only")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args(argv)
    sizes = [512] if args.quick else [512, 4096]
    rows = [run_case(g, repeats=5) for g in sizes]
    head = f"{'GPUS':>6} {'FLOWS':>6} {'CREATE_S':>9} {'SERVER_MS':>10} {'WALL_MS':>8} "
    print(head + f"{'LIBRARY_MS':>11} {'FULL_ENF_MS':>12} {'MOVED':>6}")
    for r in rows:
        print(
            f"{r['gpus']:>6} {r['flows']:>6} {r['create_s']:>9.2f} {r['replan_ms_server']:>10.1f} "
            f"{r['replan_ms_wall']:>8.1f} {r['replan_ms_library']:>11.1f} "
            f"{r['replan_ms_library_full_enforce']:>12.1f} {r['moved_flows']:>6.0f}"
        )
    last = rows[-1]
    summary = {
        "gpus": last["gpus"],
        "plan_create_s": round(last["create_s"], 3),
        "replan_ms_api_server": round(last["replan_ms_server"], 2),
        "replan_ms_api_wall": round(last["replan_ms_wall"], 2),
        "replan_ms_library": round(last["replan_ms_library"], 2),
        "api_server_vs_library_ratio": round(
            last["replan_ms_server"] / last["replan_ms_library"], 2
        ),
        "api_wall_vs_library_ratio": round(last["replan_ms_wall"] / last["replan_ms_library"], 2),
        "cases": rows,
    }
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
