"""Job detectors in a live controller: step records in, incidents and probe commands out."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests import http_calls
from tests.waiting import wait_for

JOB = "gpt-mini"
RANKS_PER_NODE = 4


def node_of(rank: int) -> str:
    return f"c4d-node-{rank // RANKS_PER_NODE}"


class Nodes:
    """Two agents' worth of reports, seq numbers kept per node."""

    def __init__(self, live: Any, world: int) -> None:
        self.live = live
        self.world = world
        self.seq: dict[str, int] = {}
        self.client = http_calls.client(
            base_url=live.url, headers=live.headers("agent"), timeout=10
        )

    def post(
        self, node: str, job: dict[str, Any], samples: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        body = {
            "node": {
                "name": node,
                "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in range(4)],
            },
            "agent_instance": "i1",
            "seq": seq,
            "sent_unix_s": time.time(),
            "job": job,
            "samples": samples or [],
        }
        resp = self.client.post("/api/v1/reports", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    def steps(
        self, step: int, compute: dict[int, float], comm_s: float
    ) -> list[tuple[str, dict[str, Any]]]:
        """Post one synchronous step; returns (node, command) for commands the replies carried."""
        times = {r: compute.get(r, 1.0) for r in range(self.world)}
        slowest = max(times.values())
        commands = []
        for node in sorted({node_of(r) for r in range(self.world)}):
            rows = [
                {
                    "job": JOB,
                    "rank": r,
                    "world_size": self.world,
                    "step": step,
                    "compute_time_s": c,
                    "collective_wait_s": slowest - c + comm_s,
                    "step_time_s": slowest + comm_s,
                    "gpu_index": r % RANKS_PER_NODE,
                }
                for r, c in times.items()
                if node_of(r) == node
            ]
            commands += [(node, c) for c in self.post(node, {"steps": rows})["commands"]]
        return commands


def answer_probes(
    nodes: Nodes, probes: dict[str, dict[str, Any]], gbps: Callable[[int, int], float]
) -> None:
    """Each node's ranks answer their node's probe command with ``gbps(src, dst)``."""
    size = 8 << 20
    for node, command in probes.items():
        results = [
            {
                "job": JOB,
                "probe_id": command["id"],
                "src_rank": src,
                "dst_rank": dst,
                "size_bytes": size,
                "duration_s": size * 8 / (gbps(src, dst) * 1e9),
            }
            for src, dst in command["pairs"]
            if node_of(src) == node
        ]
        nodes.post(node, {"probes": results})


def incidents(live: Any, kind: str) -> list[dict[str, Any]]:
    with http_calls.client(base_url=live.url, headers=live.headers("viewer")) as client:
        return client.get("/api/v1/incidents", params={"kind": kind}).json()["data"]  # type: ignore[no-any-return]


def wait_for_incidents(live: Any, kind: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = wait_for(
        lambda: incidents(live, kind), timeout_s=timeout_s, interval_s=0.05
    )
    return found


#: Detection does not depend on the database (the controller suite covers both backends,
#: and group commit's batching): each report is committed at once instead of waiting up to
#: ``ingest_flush_interval_s`` (20 ms) for others, and these tests post a few hundred. The
#: job detector ticks every 0.2 s instead of 1 s: findings are evaluated (and hangs found,
#: probe rounds ordered) at its ticks, and these tests wait for what a tick finds.
DETECTION_ONLY: dict[str, Any] = {"ingest_flush_interval_s": 0.0, "job_tick_interval_s": 0.2}
#: Slow communication must persist this long (``c4d_confirm_min_s``, 5 s in production) on
#: the controller's clock besides its steps; the test checks it did.
CONFIRM_MIN_S = 1.0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_straggler_becomes_an_incident_naming_rank_node_and_gpu(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(**DETECTION_ONLY)
    nodes = Nodes(live, world=8)
    # The slow rank's GPU (node 1, GPU 2) runs hot and throttled; the agent says so.
    for node in ("c4d-node-0", "c4d-node-1"):
        gpus: list[dict[str, Any]] = [
            {"index": i, "sm_clock_mhz": 1980, "temperature_c": 60.0} for i in range(4)
        ]
        if node == "c4d-node-1":
            gpus[2] |= {
                "sm_clock_mhz": 1200,
                "temperature_c": 91.0,
                "throttle_reasons": ["hw_thermal_slowdown"],
                "throttle_reasons_mask": 64,
            }
        nodes.post(node, {}, samples=[{"time_unix_s": time.time(), "gpus": gpus}])
    # A straggler is confirmed over steps alone (C4DConfig.straggler_confirm_steps and the
    # window's median), not seconds: the job steps as fast as its reports go.
    for step in range(24):
        nodes.steps(step, compute={6: 1.3}, comm_s=0.05)
    (incident,) = wait_for_incidents(live, "straggler")
    assert incident["job"] == JOB and incident["ranks"] == [6]
    assert incident["node"] == "c4d-node-1"
    assert incident["evidence"]["gpu_index"] == 2 and incident["gpu_index"] == 2
    assert incident["opened_unix_s"] <= incident["updated_unix_s"]
    assert 25 <= incident["evidence"]["slowdown_pct"] <= 35
    assert "thermal throttling at 91 °C" in incident["summary"]
    assert any("1200 MHz vs 1980 MHz" in c for c in incident["evidence"]["causes"])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_slow_communication_triggers_a_probe_that_localizes_the_rank(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(**DETECTION_ONLY, c4d_confirm_min_s=CONFIRM_MIN_S)
    nodes = Nodes(live, world=8)
    for step in range(45):
        nodes.steps(step, compute={}, comm_s=0.05)
    # The probe commands ride on the replies once the finding opens: one per node, all
    # naming the same step.
    probes: dict[str, dict[str, Any]] = {}

    def collect(carried: list[tuple[str, dict[str, Any]]]) -> None:
        probes.update((n, c) for n, c in carried if c["kind"] == "job_link_probe")

    # Slow steps until the finding opens: it must persist for ``c4d_confirm_min_s`` on the
    # controller's clock besides its steps.
    step, deadline = 45, time.monotonic() + 30
    first_slow_unix_s = time.time()
    opened: list[dict[str, Any]] = []
    while not opened and time.monotonic() < deadline:
        collect(nodes.steps(step, compute={}, comm_s=0.4))
        step += 1
        time.sleep(0.1)
        opened = incidents(live, "comm_slow")
    (slow,) = opened
    assert slow["job"] == JOB
    assert slow["opened_unix_s"] - first_slow_unix_s >= CONFIRM_MIN_S  # not before it held
    deadline = time.monotonic() + 10
    while len(probes) < 2 and time.monotonic() < deadline:
        collect(nodes.steps(step, compute={}, comm_s=0.4))
        step += 1
        time.sleep(0.1)
    assert sorted(probes) == ["c4d-node-0", "c4d-node-1"]
    assert len({p["at_step"] for p in probes.values()}) == 1
    pairs = probes["c4d-node-0"]["pairs"]
    assert len(pairs) == 8
    # Ranks answer through their own node's agent, echoing that node's command id; every
    # pair that touches rank 5 is slow.
    answer_probes(nodes, probes, lambda src, dst: 10.0 if 5 in (src, dst) else 100.0)
    (link,) = wait_for_incidents(live, "slow_link")
    assert link["ranks"] == [5] and link["node"] == "c4d-node-1"
    assert link["evidence"]["scope"] == "rank"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_chaos_drill_waits_for_every_rank_to_report(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """A drill sent while part of the job is unseen would reach only some nodes."""
    live = controller_factory(**DETECTION_ONLY)
    nodes = Nodes(live, world=8)
    row = {"job": JOB, "world_size": 8, "step": 0, "step_time_s": 1.0, "compute_time_s": 1.0}
    row |= {"collective_wait_s": 0.0}
    nodes.post("c4d-node-0", {"steps": [row | {"rank": r} for r in range(4)]})
    body = {"faults": [{"kind": "delay", "rank": 6, "from_step": 0, "delay_s": 0.04}]}
    with http_calls.client(base_url=live.url, headers=live.headers("operator")) as client:
        early = client.post(f"/api/v1/jobs/{JOB}/faults", json=body)
        assert early.status_code == 409
        assert "rank(s) [4, 5, 6, 7] have not reported" in early.json()["detail"]
        nodes.post("c4d-node-1", {"steps": [row | {"rank": r} for r in range(4, 8)]})
        sent = client.post(f"/api/v1/jobs/{JOB}/faults", json=body)
        assert sent.status_code == 201, sent.text
        assert sorted(c["node"] for c in sent.json()["data"]) == ["c4d-node-0", "c4d-node-1"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_communication_hang_is_localized_by_a_probe_in_the_next_run(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """Every rank is stuck inside the call, so no future step exists to probe at; the round
    is ordered once the restarted job steps again, over the ring of its ranks."""
    live = controller_factory(**DETECTION_ONLY)
    nodes = Nodes(live, world=8)
    for step in range(5):
        nodes.steps(step, compute={}, comm_s=0.05)
    group = list(range(8))
    for node in ("c4d-node-0", "c4d-node-1"):
        stuck = [
            {"job": JOB, "rank": r, "group": "g0", "op": "all_reduce", "seq": 40, "step": 5}
            | {"elapsed_s": 30.0, "last_completed_seq": {"g0": 39}, "group_ranks": group}
            for r in group
            if node_of(r) == node
        ]
        assert not nodes.post(node, {"inflight": stuck})["commands"]
    (hang,) = wait_for_incidents(live, "comm_hang")
    assert hang["ranks"] == group and "communication hang" in hang["summary"]
    # No probe while the job is hung (its ranks could never run one): not on a tick ...
    live.wait_ticks("JobDetector")
    carried = nodes.steps(5, compute={}, comm_s=0.05)  # ... nor on a reply
    assert not [c for _, c in carried if c["kind"] == "job_link_probe"]
    # The job restarts (same ranks: a restart in place) and steps again.
    now = time.time()
    for node in ("c4d-node-0", "c4d-node-1"):
        started = [
            {"job": JOB, "rank": r, "kind": "started", "time_unix_s": now, "world_size": 8}
            for r in group
            if node_of(r) == node
        ]
        nodes.post(node, {"rank_events": started})
    probes: dict[str, dict[str, Any]] = {}
    step, deadline = 3, time.monotonic() + 15
    while len(probes) < 2 and time.monotonic() < deadline:
        carried = nodes.steps(step, compute={}, comm_s=0.05)
        probes.update((n, c) for n, c in carried if c["kind"] == "job_link_probe")
        step += 1
        time.sleep(0.1)
    assert sorted(probes) == ["c4d-node-0", "c4d-node-1"], "no probe after the restart"
    command = probes["c4d-node-0"]
    assert command["at_step"] > step - 1 and "communication hang" in command["reason"]
    assert sorted(map(tuple, command["pairs"])) == sorted((r, (r + 1) % 8) for r in group)
    answer_probes(nodes, probes, lambda src, dst: 5.0 if {src, dst} == {2, 3} else 100.0)
    (link,) = wait_for_incidents(live, "slow_link")
    assert link["ranks"] == [2, 3] and link["evidence"]["scope"] == "link"
    assert link["evidence"]["after_incident"] == f"comm_hang:{JOB}:g0:40"
    assert "after the communication hang" in link["summary"]
