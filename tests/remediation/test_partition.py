"""Partitions and mass failures through the service layer (issue 18).

A live controller (real HTTP, real database, the real health detector opening ``node_lost``
when an agent stops reporting) with a :class:`RecordingActuator` standing in for the
platform's word on each node (``Actuator.node_view``; the Kubernetes actuator's answer from
a Node and its pods is tested against the fake API server at the end). Agents keep
reporting from a background thread, except the ones a test silences.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import NodeView, Placement
from controller.actuators.kubernetes import KubernetesActuator
from controller.logic.detection.incident_evidence import QuarantineBudgetEvidence
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, pod
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import ENGINE, Agents, actions, incidents_of, open_incident
from tests.waiting import wait_for

__all__ = ["cluster"]

pytestmark = pytest.mark.usefixtures("fast_remediation_engine")

LOST_AFTER_S = 3.0


class Fleet:
    """Agents reporting every 0.2 s until silenced."""

    def __init__(self, live: Any, names: list[str]) -> None:
        self.agents = Agents(live)
        self.live_nodes = set(names)
        for name in names:
            self.agents.report(name)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                names = sorted(self.live_nodes)
            for name in names:
                self.agents.report(name)

    def silence(self, *names: str) -> None:
        with self._lock:
            self.live_nodes -= set(names)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def fleet_factory(controller_factory: Any) -> Iterator[Any]:
    fleets: list[Fleet] = []

    def start(n: int, **settings: Any) -> tuple[Any, Fleet, RecordingActuator]:
        live = controller_factory(node_lost_after_s=LOST_AFTER_S, **settings)
        fleet = Fleet(live, [f"n{i}" for i in range(n)])
        fleets.append(fleet)
        actuator = RecordingActuator(
            placements={"gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=2)},
            pools={"gpt": [f"n{i}" for i in range(n)]},
        )
        live.controller.remediation.actuator = actuator
        return live, fleet, actuator

    yield start
    for fleet in fleets:
        fleet.close()


def node_lost(live: Any, node: str) -> int:
    def find() -> int | None:
        for i in live.controller.state.incidents.values():
            if i.kind == "node_lost" and i.node == node:
                return int(i.id)
        return None

    return int(wait_for(find, timeout_s=10))


def acted(actuator: RecordingActuator) -> list[tuple[str, Any]]:
    return [(m, a) for m, a in actuator.calls if m in ("isolate_node", "restart_job")]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_unreachable_node_waits_for_a_second_signal(fleet_factory: Any) -> None:
    live, fleet, actuator = fleet_factory(5)
    step = {"job": "gpt", "rank": 2, "world_size": 4, "step": 1, "step_time_s": 1.0,
            "compute_time_s": 0.9, "collective_wait_s": 0.1, "end_unix_s": time.time()}  # fmt: skip
    fleet.agents.report("n1", job={"steps": [step]})  # job gpt runs a rank on n1
    # Partitioned from the controller, but the platform says it is fine: Ready, pods running.
    actuator.views["n1"] = NodeView(ready=True, pods_running=True)
    fleet.silence("n1")
    incident = node_lost(live, "n1")
    held = wait_for(lambda: [a for a in actions(live) if a["trigger"] == f"incident:{incident}"])
    assert held[0]["kind"] == "alert" and held[0]["outcome"].startswith("held, not acted on")
    assert "unreachable (silent, Node Ready, pods running" in held[0]["outcome"]

    def asked() -> int:
        return sum(1 for m, a in actuator.calls if m == "node_view" and a == "n1")

    before = asked()
    live.wait_ticks(ENGINE, 2)  # two more ticks, each asking the platform again
    assert acted(actuator) == []
    assert asked() >= before + 2
    assert str(incident) in live.controller.remediation.snapshot()["held"]
    # The second signal: the Node itself goes NotReady. Now it is lost, and acted on.
    actuator.views["n1"] = NodeView(ready=False, pods_running=True)
    wait_for(lambda: acted(actuator), timeout_s=10)
    wait_for(lambda: len(acted(actuator)) == 2, timeout_s=10)
    isolate, restart = acted(actuator)
    assert isolate == ("isolate_node", "n1")
    assert "n1" not in restart[1].nodes

    def ended() -> set[tuple[str, str]]:
        """The incident's action rows by (kind, status): a row says ``succeeded`` only once
        the engine has heard back from the actuator, a moment after the call was made."""
        rows = [a for a in actions(live) if a["trigger"] == f"incident:{incident}"]
        return {(a["kind"], a["status"]) for a in rows}

    wait_for(lambda: {("isolate_node", "succeeded"), ("restart_job", "succeeded")} <= ended())


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ranks_failing_is_a_second_signal(fleet_factory: Any) -> None:
    live, fleet, actuator = fleet_factory(5)
    actuator.views["n3"] = NodeView(ready=True, pods_running=True)
    fleet.silence("n3")
    incident = node_lost(live, "n3")
    wait_for(lambda: [a for a in actions(live) if a["trigger"] == f"incident:{incident}"])
    assert acted(actuator) == []
    # Other nodes' ranks report the job failing in collectives with n3.
    open_incident(live, "comm_failure", job="other", node="n3", severity="critical")
    wait_for(lambda: ("isolate_node", "n3") in acted(actuator), timeout_s=10)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_mass_silence_acts_on_nobody_and_says_so(fleet_factory: Any) -> None:
    live, fleet, actuator = fleet_factory(6)
    for name in ("n1", "n2", "n3"):
        actuator.views[name] = NodeView(ready=False, pods_running=False)  # would confirm
    fleet.silence("n1", "n2", "n3")
    incidents = [node_lost(live, n) for n in ("n1", "n2", "n3")]

    def held() -> list[dict[str, Any]]:
        triggers = {f"incident:{i}" for i in incidents}
        return [a for a in actions(live) if a["trigger"] in triggers]

    rows = wait_for(lambda: len(held()) == 3 and held())
    assert all("agents silent at once" in r["outcome"] for r in rows), rows
    live.wait_ticks(ENGINE)
    assert acted(actuator) == []
    assert not [c for c in actuator.calls if c[0] == "node_view"]  # not even asked


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_quarantine_budget_refuses_and_raises_an_incident(fleet_factory: Any) -> None:
    live, _, actuator = fleet_factory(10)  # 10 % of 10: one quarantine per hour
    first = open_incident(live, "gpu_fault", job=None, node="n5", severity="critical")
    wait_for(lambda: ("isolate_node", "n5") in acted(actuator))
    second = open_incident(live, "gpu_fault", job=None, node="n6", severity="critical")

    def refused() -> list[dict[str, Any]]:
        return [
            a
            for a in actions(live)
            if a["trigger"] == f"incident:{second}" and a["kind"] == "isolate_node"
        ]

    row = wait_for(refused)[0]
    assert row["status"] == "skipped" and row["outcome"].startswith("quarantine budget spent")
    assert "(limit 1, 10% of the fleet)" in row["outcome"]
    assert ("isolate_node", "n6") not in acted(actuator)
    budget = wait_for(lambda: incidents_of(live, "quarantine_budget"))
    assert len(budget) == 1 and budget[0].severity == "critical"
    evidence = budget[0].evidence
    assert isinstance(evidence, QuarantineBudgetEvidence)
    assert evidence.refused_node == "n6" and first != second


def test_kubernetes_node_view_from_the_node_and_its_pods(cluster: FakeCluster) -> None:
    node(cluster, "gpu-1")
    node(cluster, "gpu-2")
    pod(cluster, "w-0", "gpu-1")
    cfg = client.Configuration(host=cluster.url)
    act = KubernetesActuator(client.ApiClient(cfg), NS)

    async def views() -> list[NodeView]:
        got = [await act.node_view("gpu-1"), await act.node_view("gpu-2")]
        obj = cluster.get("", "nodes", "", "gpu-1")
        assert obj is not None
        obj["status"]["conditions"] = [{"type": "Ready", "status": "Unknown"}]
        cluster.put("", "nodes", obj)
        got.append(await act.node_view("gpu-1"))
        got.append(await act.node_view("gpu-9"))  # no such Node: gone
        await act.close()
        return got

    assert asyncio.run(views()) == [
        NodeView(ready=True, pods_running=True),
        NodeView(ready=True, pods_running=None),
        NodeView(ready=None, pods_running=True),
        NodeView(ready=False, pods_running=None),
    ]
