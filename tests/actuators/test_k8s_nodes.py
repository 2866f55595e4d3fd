"""Quarantine, release and drain of nodes through the official client (faithful fake)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller.actuators.k8s.api import Fenced
from controller.actuators.k8s.events import EventRecorder
from controller.actuators.k8s.nodes import (
    ANN_CORDONED_BY,
    ANN_FENCE,
    NodeGuard,
    QuarantineSettings,
    condition_reason,
    taint_value,
)
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, kube_on, node, owner, pod, run, validate

__all__ = ["cluster"]


def guard(c: FakeCluster, **kw: Any) -> NodeGuard:
    kube = kube_on(c)
    fence = kw.pop("fence", None)
    settings = QuarantineSettings(
        drain_namespaces=(NS,), backoff_initial_s=0.01, drain_timeout_s=0.2, **kw
    )

    async def no_sleep(_: float) -> None:
        return None

    return NodeGuard(kube, EventRecorder(kube), settings, sleep=no_sleep,
                     fence_generation=lambda: fence)  # fmt: skip


def reasons(c: FakeCluster) -> list[str]:
    return [e["reason"] for e in c.items("", "events")]


def test_quarantine_cordons_taints_sets_condition_and_records_owner(cluster: FakeCluster) -> None:
    other = {"key": "example.com/maint", "value": "x", "effect": "PreferNoSchedule"}
    node(cluster, "gpu-1", taints=[other])
    g = guard(cluster)
    result = run(g.quarantine("gpu-1", reason="xid 79", message="GPU 3 fell off the bus"))
    n = cluster.get("", "nodes", "", "gpu-1")
    assert n is not None
    validate(n)
    assert n["spec"]["unschedulable"] is True
    assert n["spec"]["taints"] == [
        other,
        {"key": "trainguard.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"},
    ]
    cond = {c["type"]: c for c in n["status"]["conditions"]}
    assert cond["Ready"]["status"] == "True"  # merged by type, not replaced
    assert cond["TrainguardHealthy"]["status"] == "False"
    assert cond["TrainguardHealthy"]["reason"] == "Xid79"
    assert cond["TrainguardHealthy"]["message"] == "GPU 3 fell off the bus"
    record = json.loads(n["metadata"]["annotations"][ANN_CORDONED_BY])
    assert record["by"] == "trainguard" and record["cordoned"] and record["tainted"]
    assert result.details["taint"] == "trainguard.io/unhealthy=xid-79:NoSchedule"
    assert reasons(cluster) == ["TrainguardQuarantined"]
    for event in cluster.items("", "events"):
        validate(event)
        assert event["involvedObject"]["kind"] == "Node"
    again = run(g.quarantine("gpu-1", reason="xid 79", message="again"))
    assert again.details == {"already": True}
    # Release: condition back to True, taint and cordon gone, foreign taint kept.
    run(g.release("gpu-1", reason="repaired"))
    n = cluster.get("", "nodes", "", "gpu-1")
    assert n is not None and not n["spec"].get("unschedulable")
    assert n["spec"]["taints"] == [other]
    assert ANN_CORDONED_BY not in (n["metadata"].get("annotations") or {})
    cond = {c["type"]: c for c in n["status"]["conditions"]}
    assert cond["TrainguardHealthy"]["status"] == "True"
    assert reasons(cluster) == ["TrainguardQuarantined", "TrainguardReleased"]


def test_release_never_uncordons_a_node_someone_else_cordoned(cluster: FakeCluster) -> None:
    node(cluster, "gpu-2", unschedulable=True)
    g = guard(cluster)
    run(g.quarantine("gpu-2", reason="ecc", message="uncorrectable ECC"))
    run(g.release("gpu-2", reason="ok"))
    n = cluster.get("", "nodes", "", "gpu-2")
    assert n is not None and n["spec"]["unschedulable"] is True  # the admin's cordon stays
    assert not n["spec"].get("taints")
    # A node trainguard never touched: release is a no-op.
    node(cluster, "gpu-3", unschedulable=True)
    assert run(g.release("gpu-3", reason="ok")).details == {"already": True}
    assert cluster.get("", "nodes", "", "gpu-3")["spec"]["unschedulable"] is True  # type: ignore[index]


def test_quarantine_retries_a_409_from_a_concurrent_writer(cluster: FakeCluster) -> None:
    node(cluster, "gpu-4")
    g = guard(cluster)
    original = g._patch_spec
    calls = {"n": 0}

    async def racing(name: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 1:  # someone else writes the node between our read and our patch
            cluster.put("", "nodes", cluster.get("", "nodes", "", name) or {})
        return await original(name, body, what)

    g._patch_spec = racing  # type: ignore[method-assign]
    run(g.quarantine("gpu-4", reason="xid 48", message="DBE"))
    assert calls["n"] == 2
    assert ("", "nodes", "patch") in cluster.served
    assert cluster.get("", "nodes", "", "gpu-4")["spec"]["unschedulable"]  # type: ignore[index]


def test_no_execute_is_opt_in() -> None:
    with pytest.raises(ValueError, match="allow_no_execute"):
        QuarantineSettings(taint_effect="NoExecute")
    assert QuarantineSettings(taint_effect="NoExecute", allow_no_execute=True)


def test_label_safe_taint_value_and_condition_reason() -> None:
    assert taint_value("XID 79: GPU fell off the bus!") == "XID-79-GPU-fell-off-the-bus"
    assert len(taint_value("x" * 200)) == 63
    assert taint_value("!!!") == "unhealthy"
    assert condition_reason("nvlink down") == "NvlinkDown"


def test_a_deposed_leader_is_fenced_off_by_a_newer_generation(cluster: FakeCluster) -> None:
    node(cluster, "gpu-5")
    new_leader = guard(cluster, fence=7)
    run(new_leader.quarantine("gpu-5", reason="xid 79", message="m"))
    n = cluster.get("", "nodes", "", "gpu-5")
    assert n is not None and n["metadata"]["annotations"][ANN_FENCE] == "7"
    old_leader = guard(cluster, fence=6)
    with pytest.raises(Fenced, match="generation 7"):
        run(old_leader.release("gpu-5", reason="stale decision"))
    assert cluster.get("", "nodes", "", "gpu-5")["spec"]["unschedulable"]  # type: ignore[index]


def test_drain_evicts_respecting_pdb_with_backoff_and_skips_daemonsets(
    cluster: FakeCluster,
) -> None:
    node(cluster, "gpu-6")
    node(cluster, "gpu-7")
    ds = cluster.put("apps", "daemonsets", {"metadata": {"name": "agent", "namespace": NS}})
    pod(cluster, "agent-x", "gpu-6", owners=[owner(ds)])
    pod(cluster, "mirror", "gpu-6", annotations={"kubernetes.io/config.mirror": "h"})
    pod(cluster, "w0", "gpu-6", labels={"app": "t"})
    pod(cluster, "w1", "gpu-7", labels={"app": "t"})
    pod(cluster, "other", "gpu-6")
    cluster.put(
        "policy",
        "poddisruptionbudgets",
        {
            "metadata": {"name": "t", "namespace": NS},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "t"}}},
        },
    )
    g = guard(cluster)
    result = run(g.drain("gpu-6", reason="xid 79"))
    assert result.details["evicted"] == [f"{NS}/other"]
    assert result.details["blocked_by_pdb"] == [f"{NS}/w0"]
    assert sorted(result.details["skipped"]) == [f"{NS}/agent-x", f"{NS}/mirror"]
    # Backed off 0.01+0.02+0.04+0.08 s; the next 0.16 s would pass the 0.2 s budget.
    assert result.details["retries"] == 4
    assert cluster.get("", "pods", NS, "agent-x") is not None
    # Once the budget allows it (a replacement runs elsewhere), the retry goes through.
    pod(cluster, "w2", "gpu-7", labels={"app": "t"})
    result = run(g.drain("gpu-6", reason="xid 79"))
    assert result.details["evicted"] == [f"{NS}/w0"] and not result.details["blocked_by_pdb"]
    assert "TrainguardDrained" in reasons(cluster)
