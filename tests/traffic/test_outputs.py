from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from controller.logic.traffic.enforce import enforce
from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.outputs import (
    launcher_order,
    nccl_env,
    plan_to_dict,
    qp_map,
    write_json_atomic,
)
from controller.logic.traffic.planner import Planner

from .conftest import small_fabric


def test_plan_json_launcher_order_env_and_qp_map(tmp_path: Path) -> None:
    topo = small_fabric(nodes=8)
    nodes = [topo.nodes[i].name for i in np.random.default_rng(0).permutation(8)]
    job = JobSpec(nodes=nodes, gpus_per_node=2, tp=2, channels=2, qps_per_connection=2)
    plan = Planner(topo).plan(job)
    order = launcher_order(plan)
    assert sorted(o["node"] for o in order) == sorted(nodes)
    assert [o["node_rank"] for o in order] == list(range(8))
    assert order[3]["first_rank"] == 6
    env = nccl_env(plan)
    assert env["NCCL_IB_QPS_PER_CONNECTION"] == "2"
    assert env["NCCL_IB_SPLIT_DATA_ON_QPS"] == "1"
    data = plan_to_dict(plan)
    text = json.dumps(data)  # serializable as is
    assert json.loads(text)["plan_id"] == plan.plan_id
    assert len(data["flows"]) == len(plan.flows)
    cfg = HashConfig()
    enforced, ports = enforce(plan, cfg)
    qm = qp_map(enforced, ports, cfg)
    entries = [e for v in qm["nodes"].values() for e in v]
    assert len(entries) == len(plan.flows)
    assert {e["udp_sport"] for e in entries} <= set(range(cfg.sport_min, cfg.sport_max + 1))
    assert all(
        e["path"][0].startswith(f"{src}/nic{e['nic']}/p{e['bond_port']}->")
        for src, v in qm["nodes"].items()
        for e in v
    )
    path = tmp_path / "sub" / "plan.json"
    write_json_atomic(path, data)
    assert json.loads(path.read_text())["version"] == 1
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_atomic_write_leaves_old_file_when_serialization_fails(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"version": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"version": object()})
    assert json.loads(path.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_package_face_is_lazy_and_complete() -> None:
    import controller.logic.traffic as traffic

    for name in traffic.__all__:
        assert getattr(traffic, name) is not None
    with pytest.raises(AttributeError):
        traffic.nope  # noqa: B018
