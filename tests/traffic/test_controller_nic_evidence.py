"""NIC errors and flaps are evidence for slow communication, end to end (issue 17).

Four two-rail nodes (GPU k next to NIC mlx5_k, the fabric's nic<k>), job ``llm`` with two
ranks per node. Before the job slows down, agents report a flapping port on tg-3's mlx5_0
and a symbol-error rise on tg-1's mlx5_1 (and errors on tg-9, which runs no rank). When the
detectors open the ``comm_slow`` incident, its evidence names the two NICs of the job's
nodes, each with the rank whose GPU sits next to it, the flap first; the slow-link reaction
degrades exactly those NICs' links in the job's traffic plan. Each NIC's own incident has
already degraded its links when it opened, before the job slowed down.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import http_calls

JOB = "llm"
PLACEMENT = {"tg-0": [0, 1], "tg-1": [2, 3], "tg-2": [4, 5], "tg-3": [6, 7]}
LEAF = {"tg-0": "tor-a", "tg-1": "tor-a", "tg-2": "tor-b", "tg-3": "tor-b"}
#: What each agent reports about its RDMA ports (``wire.NicInfo``).
NICS = [
    {"device": "mlx5_0", "port": 1, "pci_bus_id": "0000:1a:00.0", "gpu_affinity": {0: "PIX"}},
    {"device": "mlx5_1", "port": 1, "pci_bus_id": "0000:9a:00.0", "gpu_affinity": {1: "PIX"}},
]
for nic, other in zip(NICS, (1, 0), strict=True):
    nic["gpu_affinity"][other] = "SYS"  # type: ignore[index]


@pytest.fixture
def two_rail_fabric(tmp_path: Path) -> Path:
    doc = {
        "name": "rails",
        "port_speed_gbps": 100,
        "switches": [{"name": n, "tier": 1} for n in ("tor-a", "tor-b")]
        + [{"name": n, "tier": 2} for n in ("spine-0", "spine-1")],
        "cables": [
            {"lower": lo, "upper": up} for lo in ("tor-a", "tor-b") for up in ("spine-0", "spine-1")
        ],
        "nodes": [
            {"name": n, "nics": [{"ports": [{"leaf": LEAF[n]}]}, {"ports": [{"leaf": LEAF[n]}]}]}
            for n in sorted(LEAF)
        ],
    }
    path = tmp_path / "fabric.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Agents:
    def __init__(self, live: Any) -> None:
        self.client = http_calls.client(
            base_url=live.url, headers=live.headers("agent"), timeout=10
        )
        self.seq = 0

    def post(
        self, node: str, *, job: dict[str, Any] | None = None, events: list[Any] | None = None
    ) -> None:
        self.seq += 1
        now = time.time()
        body: dict[str, Any] = {
            "node": {
                "name": node,
                "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in (0, 1)],
                "nics": NICS,
            },
            "agent_instance": "i1",
            "seq": self.seq,
            "sent_unix_s": now,
            "samples": [{"time_unix_s": now, "gpus": [], "events": events or []}],
        }
        if job is not None:
            body["job"] = job
        reply = self.client.post("/api/v1/reports", json=body)
        assert reply.status_code == 200, reply.text

    def step(self, step: int, comm_s: float) -> None:
        for node, ranks in PLACEMENT.items():
            rows = [
                {"job": JOB, "rank": r, "world_size": 8, "step": step, "compute_time_s": 1.0,
                 "collective_wait_s": comm_s, "step_time_s": 1.0 + comm_s, "gpu_index": k}
                for k, r in enumerate(ranks)
            ]  # fmt: skip
            self.post(node, job={"steps": rows})


def nic_event(kind: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "time_unix_s": time.time(), "device": device, "port": 1, **extra}


@pytest.mark.slow  # ~20 s: the detectors confirm slow communication over steps and seconds
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_nic_errors_name_the_first_suspects_and_degrade_their_links_in_the_plan(
    controller_factory: Any, two_rail_fabric: Path
) -> None:
    live = controller_factory(topology_file=two_rail_fabric)
    agents = Agents(live)
    for step in range(45):
        agents.step(step, comm_s=0.05)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=30)
    reply = op.post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 1}})
    assert reply.status_code == 201, reply.text
    plan_id = reply.json()["plan_id"]

    errors = {"counter": "symbol_error", "delta": 50}
    agents.post("tg-1", events=[nic_event("nic_errors_rising", "mlx5_1", **errors)])
    agents.post("tg-3", events=[nic_event("nic_port_down", "mlx5_0", detail="link_downed +3")])
    agents.post("tg-9", events=[nic_event("nic_errors_rising", "mlx5_0", **errors)])

    # Each NIC's own incident degrades its links at once, before any job slows down (tg-9
    # is outside the fabric: nothing to degrade there).
    assert wait_for(lambda: op.get(f"/api/v1/plans/{plan_id}").json()["version"] >= 3)
    early = op.get(f"/api/v1/plans/{plan_id}").json()["versions"][1:3]
    nic_incidents = {
        f"incident:{i['id']}"
        for i in op.get("/api/v1/incidents").json()["data"]
        if i["kind"] in ("hw_degraded", "nic_errors") and i["node"] in ("tg-1", "tg-3")
    }
    assert {v["trigger"] for v in early} == nic_incidents and len(nic_incidents) == 2
    assert {c["link"]: c["health"] for v in early for c in v["changes"]} == {
        "tg-3/nic0/p0->tor-b": 0.25,
        "tor-b->tg-3/nic0/p0": 0.25,
        "tg-1/nic1/p0->tor-a": 0.5,
        "tor-a->tg-1/nic1/p0": 0.5,
    }

    def comm_slow() -> list[dict[str, Any]]:
        found = op.get("/api/v1/incidents", params={"kind": "comm_slow"}).json()["data"]
        return found  # type: ignore[no-any-return]

    step, deadline = 45, time.monotonic() + 40
    while not comm_slow() and time.monotonic() < deadline:
        agents.step(step, comm_s=0.4)
        step += 1
        time.sleep(0.3)
    (incident,) = comm_slow()
    suspects = incident["evidence"]["nic"]["suspects"]
    assert [(s["node"], s["device"], s["signal"], s["affine_ranks"], s["nic_index"])
            for s in suspects] == [
        ("tg-3", "mlx5_0", "nic_port_down", [6], 0),
        ("tg-1", "mlx5_1", "nic_errors_rising", [3], 1),
    ]  # fmt: skip
    assert "first suspect: NIC mlx5_0 on tg-3 (nic_port_down x1" in incident["summary"]
    affine = {(a["rank"], a["device"]) for a in incident["evidence"]["nic"]["affine"]}
    assert (3, "mlx5_1") in affine and (6, "mlx5_0") in affine and len(affine) == 8

    replanned = wait_for(lambda: op.get(f"/api/v1/plans/{plan_id}").json()["version"] > 3)
    assert replanned
    latest = op.get(f"/api/v1/plans/{plan_id}").json()["versions"][-1]
    assert latest["trigger"] == f"incident:{incident['id']}"
    assert {c["link"]: c["health"] for c in latest["changes"]} == {
        "tg-3/nic0/p0->tor-b": 0.25,
        "tor-b->tg-3/nic0/p0": 0.25,
        "tg-1/nic1/p0->tor-a": 0.5,
        "tor-a->tg-1/nic1/p0": 0.5,
    }
    replans = {
        a["trigger"]: a
        for a in op.get("/api/v1/actions").json()["data"]
        if a["kind"] == "traffic_replan"
    }
    assert set(replans) == nic_incidents | {f"incident:{incident['id']}"}
    assert all(a["status"] == "succeeded" for a in replans.values())
    action = replans[f"incident:{incident['id']}"]
    assert action["outcome"].startswith("4 link(s) of suspect NICs degraded")


def wait_for(fetch: Any, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)
