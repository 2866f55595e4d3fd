"""What a plan turns into outside the controller: JSON for the API/CLI, the rank order for
the launcher, a queue-pair map a NIC/CCL plugin reads, and NCCL environment settings.

The QP map (format ``trainguard.traffic.qpmap/v1``) is grouped by node so each node's
plugin reads only its part: for every outgoing connection (local NIC, peer node and NIC,
NCCL channel, QP index) it gives the bond port to send on and the UDP source port to set
on the queue pair (e.g. with ``mlx5dv_modify_qp_udp_sport``); with that port the modelled
ECMP hash takes the planned path. Files are written atomically (temp file, fsync, rename),
so a reader never sees half a plan.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.planner import Plan

QPMAP_FORMAT = "trainguard.traffic.qpmap/v1"
PLAN_FORMAT = "trainguard.traffic.plan/v1"


def write_json_atomic(path: str | Path, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # plugins on the nodes read it, often as another user
        os.replace(tmp, p)
        dirfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def launcher_order(plan: Plan) -> list[dict[str, Any]]:
    """node_rank for each node (torchrun ``--node-rank``), in rank order."""
    gpn = plan.job.gpus_per_node
    return [
        {"node": n, "node_rank": i, "first_rank": i * gpn} for i, n in enumerate(plan.node_order)
    ]


def nccl_env(plan: Plan) -> dict[str, str]:
    """Settings that make NCCL's connections match the plan's flows.

    The plan assumes ``channels`` connections per ring edge and ``qps_per_connection``
    queue pairs each; splitting each message across the QPs keeps their loads equal, which
    is what the planner balanced. NCCL_CROSS_NIC=0 keeps rings rail-aligned.
    """
    job = plan.job
    return {
        "NCCL_IB_QPS_PER_CONNECTION": str(job.qps_per_connection),
        "NCCL_IB_SPLIT_DATA_ON_QPS": "1" if job.qps_per_connection > 1 else "0",
        "NCCL_MIN_NCHANNELS": str(job.channels),
        "NCCL_MAX_NCHANNELS": str(job.channels),
        "NCCL_CROSS_NIC": "0",
    }


def _names(plan: Plan, row: npt.NDArray[np.int64]) -> list[str]:
    dummy = plan.topology.dummy_link
    return [plan.topology.link_names[int(x)] for x in row if x != dummy]


def qp_map(plan: Plan, sports: npt.NDArray[np.int64], cfg: HashConfig) -> dict[str, Any]:
    topo, fl = plan.topology, plan.flows
    paths = plan.paths()
    nodes: dict[str, list[dict[str, Any]]] = {}
    for f in range(len(fl)):
        cs = plan.sets[plan.set_of[f]]
        c = plan.choice[f]
        src = topo.nodes[int(fl.src_node[f])].name
        nodes.setdefault(src, []).append(
            {
                "nic": int(fl.src_nic[f]),
                "peer": topo.nodes[int(fl.dst_node[f])].name,
                "peer_nic": int(fl.dst_nic[f]),
                "collective": plan.flows.collectives[int(fl.group[f])].name,
                "channel": int(fl.channel[f]),
                "qp": int(fl.qp[f]),
                "bond_port": int(cs.src_port[c]),
                "peer_port": int(cs.dst_port[c]),
                "udp_sport": int(sports[f]),
                "path": _names(plan, paths[f]),
            }
        )
    return {
        "format": QPMAP_FORMAT,
        "plan_id": plan.plan_id,
        "version": plan.version,
        "hash": {
            "function": cfg.function,
            "bond_function": cfg.bond_function,
            "default_seed": cfg.default_seed,
            "dport": cfg.dport,
        },
        "nodes": nodes,
    }


def plan_to_dict(plan: Plan, *, flows: bool = True) -> dict[str, Any]:
    """The plan as JSON-ready data; ``flows=False`` keeps only the summary."""
    out: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "plan_id": plan.plan_id,
        "version": plan.version,
        "parent_version": plan.parent_version,
        "created_unix_s": plan.created_unix_s,
        "job": plan.job.name,
        "topology": plan.topology.summary(),
        "stats": plan.stats(),
        "changes": plan.changes,
        "launcher_order": launcher_order(plan),
        "nccl_env": nccl_env(plan),
    }
    if flows:
        paths = plan.paths()
        fl = plan.flows
        topo = plan.topology
        out["flows"] = [
            {
                "src": f"{topo.nodes[int(fl.src_node[f])].name}/nic{int(fl.src_nic[f])}",
                "dst": f"{topo.nodes[int(fl.dst_node[f])].name}/nic{int(fl.dst_nic[f])}",
                "collective": fl.collectives[int(fl.group[f])].name,
                "channel": int(fl.channel[f]),
                "qp": int(fl.qp[f]),
                "size_bytes": float(fl.size_bytes[f]),
                "path": _names(plan, paths[f]),
            }
            for f in range(len(fl))
        ]
    return out


__all__ = [
    "PLAN_FORMAT",
    "QPMAP_FORMAT",
    "launcher_order",
    "nccl_env",
    "plan_to_dict",
    "qp_map",
    "write_json_atomic",
]
