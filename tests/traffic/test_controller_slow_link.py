"""A slow link found by the job detectors' probe round re-plans the job's traffic plan.

The job runs in its plan's launcher order (tg-0..tg-3, two ranks each), as it would after
being launched from the plan; reports carry step summaries, a slow phase makes the
detectors schedule a link probe, and the ranks' probe answers say the pair 3->4 (tg-1 on
tor-a to tg-2 on tor-b) runs at a tenth of the others.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls

JOB = "llm"
PLACEMENT = {"tg-0": [0, 1], "tg-1": [2, 3], "tg-2": [4, 5], "tg-3": [6, 7]}
NODE_OF = {r: n for n, ranks in PLACEMENT.items() for r in ranks}


class Ranks:
    def __init__(self, live: Any) -> None:
        self.client = http_calls.client(
            base_url=live.url, headers=live.headers("agent"), timeout=10
        )
        self.seq = 0

    def post(self, node: str, job: dict[str, Any]) -> list[dict[str, Any]]:
        self.seq += 1
        body = {
            "node": {"name": node, "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in (0, 1)]},
            "agent_instance": "i1", "seq": self.seq, "sent_unix_s": time.time(),
            "job": job, "samples": [],
        }  # fmt: skip
        reply = self.client.post("/api/v1/reports", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["commands"]  # type: ignore[no-any-return]

    def step(self, step: int, comm_s: float) -> dict[str, dict[str, Any]]:
        probes = {}
        for node, ranks in PLACEMENT.items():
            rows = [
                {"job": JOB, "rank": r, "world_size": 8, "step": step, "compute_time_s": 1.0,
                 "collective_wait_s": comm_s, "step_time_s": 1.0 + comm_s, "gpu_index": k}
                for k, r in enumerate(ranks)
            ]  # fmt: skip
            for command in self.post(node, {"steps": rows}):
                if command["kind"] == "job_link_probe":
                    probes[node] = command
        return probes


def wait_for(fetch: Any, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.slow  # ~5 s: the detectors confirm slow communication over steps and seconds
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_slow_link_incident_marks_the_suspect_links_slow_and_replans(
    controller_factory: Any, traffic_fabric_file: Path
) -> None:
    # Each report committed at once, not after the group commit's 20 ms wait for more: the
    # 45 steps of four sequential reports each before the slow phase took ~5 s of waiting.
    # Slow communication is confirmed after 1 s on the controller's clock (besides its
    # steps) instead of 5 s, and the job detector looks every 0.2 s instead of 1 s: this
    # test is about what the slow-link incident does to the plan, not about those waits
    # (tests/controller/c4d covers them).
    live = controller_factory(
        topology_file=traffic_fabric_file,
        ingest_flush_interval_s=0,
        c4d_confirm_min_s=1.0,
        job_tick_interval_s=0.2,
    )
    ranks = Ranks(live)
    for step in range(45):
        ranks.step(step, comm_s=0.05)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=30)
    reply = op.post("/api/v1/plans", json={"job": JOB, "layout": {"tp": 1}})
    assert reply.status_code == 201, reply.text
    plan = reply.json()
    assert [o["node"] for o in plan["launcher_order"]] == list(PLACEMENT)
    path_of = {
        (node, q["peer"], q["channel"]): q["path"]
        for node, qps in plan["source_ports"]["nodes"].items()
        for q in qps
    }

    probes: dict[str, dict[str, Any]] = {}
    step, deadline = 45, time.monotonic() + 40
    while len(probes) < len(PLACEMENT) and time.monotonic() < deadline:
        probes.update(ranks.step(step, comm_s=0.4))
        step += 1
        time.sleep(0.3)
    assert sorted(probes) == sorted(PLACEMENT)
    size = 8 << 20
    for node, command in probes.items():
        results = [
            {"job": JOB, "probe_id": command["id"], "src_rank": a, "dst_rank": b,
             "size_bytes": size,
             "duration_s": size * 8 / ((10.0 if (a, b) == (3, 4) else 100.0) * 1e9)}
            for a, b in command["pairs"]
            if NODE_OF[a] == node
        ]  # fmt: skip
        ranks.post(node, {"probes": results})

    def slow_link() -> list[dict[str, Any]]:
        found = op.get("/api/v1/incidents", params={"kind": "slow_link"}).json()["data"]
        return found  # type: ignore[no-any-return]

    (incident,) = wait_for(slow_link)
    assert incident["evidence"]["slow_pairs"] == [[3, 4]]
    replanned = wait_for(lambda: op.get(f"/api/v1/plans/{plan['plan_id']}").json()["version"] > 1)
    assert replanned
    detail = op.get(f"/api/v1/plans/{plan['plan_id']}").json()
    latest = detail["versions"][-1]
    assert latest["trigger"] == f"incident:{incident['id']}"
    marked = {c["link"]: c["health"] for c in latest["changes"]}
    # Suspects: every link the 3->4 traffic (tg-1 -> tg-2) crosses that no healthy pair's
    # traffic crosses, at the measured 10/100 bandwidth ratio.
    slow_paths = [p for (src, dst, _), p in path_of.items() if (src, dst) == ("tg-1", "tg-2")]
    healthy = {
        lk for (src, dst, _), p in path_of.items() if (src, dst) != ("tg-1", "tg-2") for lk in p
    }
    expected = set().union(*map(set, slow_paths)) - healthy
    assert expected and set(marked) == expected
    assert all(f == pytest.approx(0.1, rel=0.05) for f in marked.values())
    topo = op.get("/api/v1/topology").json()
    assert {s["link"] for s in topo["slow_links"]} == expected
    # The operator sees what the controller did and why.
    (action,) = [
        a for a in op.get("/api/v1/actions").json()["data"] if a["kind"] == "traffic_replan"
    ]
    assert action["trigger"] == f"incident:{incident['id']}" and action["status"] == "succeeded"
    assert action["target"] == f"job:{JOB}"
    assert f"marked {len(expected)} link(s) slow at 0.10" in action["outcome"]


@pytest.mark.parametrize("factor", [1e-320, 0.0, 0.0009, float("nan"), float("inf"), 1.0])
def test_slow_link_factor_outside_the_documented_range_is_refused(factor: float) -> None:
    from pydantic import ValidationError

    from controller.api.traffic import LinkStateRequest

    with pytest.raises(ValidationError) as err:
        LinkStateRequest.model_validate({"state": "slow", "capacity_factor": factor})
    assert err.value.errors()[0]["loc"] == ("capacity_factor",)
    ok = LinkStateRequest.model_validate({"state": "slow", "capacity_factor": 0.001})
    assert ok.factor() == 0.001
