"""The Kubernetes actuator with its k8s parts: placement from the ranks, gang restarts by
the JobSet's failurePolicy, writes fenced by the Lease."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.k8s.api import Fenced
from controller.actuators.k8s.lease import LeaseElector
from controller.actuators.kubernetes import KubernetesActuator
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, round_trip, run, validate
from tests.actuators.test_k8s_workloads import jobset_doc
from trainguard.wire import RankEvent

__all__ = ["cluster"]


def actuator(c: FakeCluster) -> KubernetesActuator:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return KubernetesActuator(client.ApiClient(cfg), NS, settle_timeout_s=2, poll_interval_s=0.05)


def launch(c: FakeCluster, *, max_restarts: int) -> dict[str, Any]:
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(c, n)
    doc = jobset_doc("llm", replicas=2, max_restarts=max_restarts)
    doc["metadata"]["labels"] = {"trainguard.io/job": "llm"}
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] = {
        "labels": {"trainguard.io/job": "llm"}
    }
    c.put("jobset.x-k8s.io", "jobsets", doc)
    assert c.reconcile_jobset(NS, "llm") == "created"
    return doc


def report_ranks(act: KubernetesActuator, c: FakeCluster) -> None:
    """What the agents forward: 2 torchrun ranks in each pod, no rank labels anywhere."""
    pods = sorted(c.items("", "pods", NS), key=lambda p: p["metadata"]["name"])
    for i, pod in enumerate(pods):
        for local in range(2):
            ev = RankEvent(job="llm", rank=2 * i + local, kind="started", time_unix_s=1.0,
                           local_rank=local, world_size=4, pod=pod["metadata"]["name"],
                           namespace=NS)  # fmt: skip
            act.observe_ranks(pod["spec"]["nodeName"], [ev])


def test_placement_from_ranks_and_a_jobset_gang_restart_by_its_failure_policy(
    cluster: FakeCluster,
) -> None:
    launch(cluster, max_restarts=1)
    act = actuator(cluster)
    report_ranks(act, cluster)
    placement = run(act.current_placement("llm"))
    assert placement is not None
    assert (placement.nodes, placement.ranks_per_node) == (("gpu-a", "gpu-b"), 2)
    run(act.isolate_node("gpu-a", reason="xid 79"))
    new = Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="xid 79 on gpu-a"))
    assert result.details["mode"] == "fail-child-jobs"
    assert result.details["restarts_used"] == 1 and result.details["max_restarts"] == 1
    assert [p.endswith("-r0") for p in result.details["deleted"]] == [True]
    # The JobSet's own controller restarts the whole gang, not just the lost pod.
    assert cluster.reconcile_jobset(NS, "llm") == "restarted"
    after = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in cluster.items("", "pods", NS)}
    assert sorted(after.values()) == ["gpu-b", "gpu-c"]
    assert all(name.endswith("-r1") for name in after)  # every pod is of the new attempt
    js = cluster.get("jobset.x-k8s.io", "jobsets", NS, "llm")
    assert js is not None and js["status"]["restarts"] == 1
    round_trip(js)
    again = run(act.restart_job(new, reason="retried"))
    assert again.details.get("already")
    # All restarts used: failing the JobSet once more would end it; refused for a human.
    with pytest.raises(ActuatorError, match=r"used 1 of 1 restarts"):
        run(act.restart_job(Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=2,
                                      generation=2), reason="again"))  # fmt: skip
    reasons = [(e["involvedObject"]["kind"], e["reason"]) for e in cluster.items("", "events")]
    assert ("Node", "TrainguardQuarantined") in reasons
    assert ("JobSet", "TrainguardGangRestart") in reasons
    for event in cluster.items("", "events"):
        validate(event)


def test_a_replica_that_does_not_hold_the_lease_writes_nothing(cluster: FakeCluster) -> None:
    launch(cluster, max_restarts=1)
    act = actuator(cluster)
    clock = [0.0]
    elector = LeaseElector(act.kube, NS, "trainguard", "me", clock=lambda: clock[0])
    act.fence_with(elector)
    before = [s for s in cluster.served if s[2] in ("patch", "create", "delete")]
    with pytest.raises(Fenced):
        run(act.isolate_node("gpu-a", reason="x"))
    with pytest.raises(Fenced):
        run(act.stop_job("llm", reason="x"))
    assert [s for s in cluster.served if s[2] in ("patch", "create", "delete")] == before
    assert run(elector.try_acquire_or_renew())
    run(act.isolate_node("gpu-a", reason="x"))
    n = cluster.get("", "nodes", "", "gpu-a")
    assert n is not None and n["metadata"]["annotations"]["trainguard.io/fence"] == "0"
