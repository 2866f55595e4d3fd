"""Detections and failed preflights reach the cluster through the actuator interface:
``controller.services.platform_events`` on the real event bus, the Kubernetes actuator on
the fake cluster (every Event and Node write schema-checked by it)."""

from __future__ import annotations

import json
from typing import Any

from controller.logic.remediation.preflight import PreflightVerdict
from controller.services.events import EventBus, IncidentOpened, NodeReported
from controller.services.platform_events import event_reason, subscribe_platform_events
from controller.state import IncidentState
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, run
from tests.actuators.test_k8s_actuator_integration import actuator, launch
from trainguard import wire

__all__ = ["cluster"]


def incident(id_: int, **kw: Any) -> IncidentState:
    return IncidentState(id=id_, kind="xid_fatal", severity="critical", state="open",
                         summary="XID 79: GPU has fallen off the bus", dedupe_key=f"k{id_}",
                         opened_unix_s=1.0, updated_unix_s=1.0, **kw)  # fmt: skip


def test_each_detection_is_an_event_on_its_node_and_its_job(cluster: FakeCluster) -> None:
    launch(cluster, max_restarts=1)
    act = actuator(cluster)
    verdicts: dict[str, PreflightVerdict] = {}

    async def go() -> None:
        bus = EventBus()
        subscribe_platform_events(bus, lambda: act, lambda: verdicts)
        await bus.deliver(IncidentOpened(incident(7, node="gpu-a", gpu_index=3, job="llm")))
        # A job the cluster does not know: its event fails, logged; the node's is written.
        await bus.deliver(IncidentOpened(incident(8, node="gpu-b", job="ghost")))
        await bus.stop()

    run(go())
    events = {
        (e["involvedObject"]["kind"], e["involvedObject"]["name"]): e
        for e in cluster.items("", "events")
    }
    assert set(events) == {("Node", "gpu-a"), ("JobSet", "llm"), ("Node", "gpu-b")}
    for event in (events[("Node", "gpu-a")], events[("JobSet", "llm")]):
        assert event["reason"] == "TrainguardXidFatal" and event["type"] == "Warning"
        assert event["message"] == (
            "incident 7 (critical, xid_fatal): XID 79: GPU has fallen off the bus [GPU 3]"
        )
        assert event["source"]["component"] == "trainguard"
    assert events[("Node", "gpu-a")]["metadata"]["namespace"] == "default"
    assert events[("JobSet", "llm")]["metadata"]["namespace"] == NS
    # Detection only: nothing was cordoned.
    node = cluster.get("", "nodes", "", "gpu-a")
    assert node is not None and not node["spec"].get("unschedulable")
    assert event_reason("comm_slow") == "TrainguardCommSlow"


def test_a_failed_preflight_cordons_and_taints_the_node_once(cluster: FakeCluster) -> None:
    launch(cluster, max_restarts=1)
    act = actuator(cluster)
    checks = "nvlink: 2 of 12 links down"
    verdicts = {
        "gpu-b": PreflightVerdict(node="gpu-b", passed=False, reason=checks, finished_unix_s=10),
        "gpu-c": PreflightVerdict(node="gpu-c", passed=True, reason="", finished_unix_s=10),
    }
    looked: list[int] = []

    def verdicts_now() -> dict[str, PreflightVerdict]:
        looked.append(1)
        return verdicts

    def report(acks: list[dict[str, object]]) -> NodeReported:
        body = {"node": {"name": "gpu-b"}, "agent_instance": "a", "seq": 1,
                "sent_unix_s": 11.0, "command_acks": acks}  # fmt: skip
        return NodeReported(report=wire.Report.model_validate(body), received_unix_s=11.0)

    ack = {"command_id": "c1", "status": "failed", "reason": checks, "finished_unix_s": 10.0}

    async def go() -> None:
        bus = EventBus()
        subscribe_platform_events(bus, lambda: act, verdicts_now)
        await bus.deliver(report([]))  # the first report: verdicts loaded at start count
        await bus.deliver(report([]))  # no ack: no new verdict, the commands are not read
        await bus.deliver(report([ack]))  # the same verdict again: not acted on twice
        await bus.stop()

    run(go())
    node = cluster.get("", "nodes", "", "gpu-b")
    assert node is not None and node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [
        {
            "key": "trainguard.io/unhealthy",
            "value": "preflight-failed-nvlink-2-of-12-links-down",
            "effect": "NoSchedule",
        }
    ]
    record = json.loads(node["metadata"]["annotations"]["trainguard.io/cordoned-by"])
    assert record["reason"] == f"preflight failed: {checks}" and record["cordoned"]
    (condition,) = [c for c in node["status"]["conditions"] if c["type"] == "TrainguardHealthy"]
    assert (
        condition["status"] == "False"
        and condition["reason"] == "PreflightFailedNvlink2Of12LinksDown"
    )
    patches = [s for s in cluster.served if s == ("", "nodes", "patch")]
    assert len(patches) == 1 and len(looked) == 2
    other = cluster.get("", "nodes", "", "gpu-c")
    assert other is not None and not other["spec"].get("unschedulable")
    reasons = [(e["involvedObject"]["name"], e["reason"]) for e in cluster.items("", "events")]
    assert reasons == [("gpu-b", "TrainguardQuarantined")]


def test_event_names_fit_a_dns_subdomain_for_the_longest_object_names() -> None:
    """A node may be named with all 253 characters a DNS subdomain allows; ``<node>.<hex
    time>`` was then 270 and the API server refused the Event (the quarantine's story lost)."""
    import re

    from controller.actuators.k8s.events import EVENT_NAME_MAX, event_name

    subdomain = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    t = 1_795_688_615_090_925_500
    assert event_name("gpu-1", t) == f"gpu-1.{t:x}"
    for node in ("n" * 253, "a" * 230 + "." + "b" * 22, "a" * 235 + "-" + "c" * 17):
        name = event_name(node, t)
        assert len(name) <= EVENT_NAME_MAX and subdomain.match(name), name
        assert name.endswith(f".{t:x}") and node.startswith(name.split(f".{t:x}")[0])
