"""The fake API server behaves like a real one where trainguard depends on it; driven
through the official client so the wire format is the client's own."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.actuators.fake_cluster import FakeCluster, strategic_merge
from tests.actuators.k8s_testkit import NS, cluster, node, owner, pod

__all__ = ["cluster"]


def api(c: FakeCluster) -> client.ApiClient:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return client.ApiClient(cfg)


def test_stale_resource_version_is_409_for_replace_and_patch(cluster: FakeCluster) -> None:
    coord = client.CoordinationV1Api(api(cluster))
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="tg", namespace=NS),
        spec=client.V1LeaseSpec(holder_identity="a"),
    )
    created = coord.create_namespaced_lease(NS, lease)
    stale = created.metadata.resource_version
    created.spec.holder_identity = "b"
    fresh = coord.replace_namespaced_lease("tg", NS, created)
    assert fresh.metadata.resource_version != stale
    created.spec.holder_identity = "c"
    with pytest.raises(ApiException) as err:
        coord.replace_namespaced_lease("tg", NS, created)  # still the old resourceVersion
    assert err.value.status == 409 and "Conflict" in (err.value.body or "")
    node(cluster, "n1")
    core = client.CoreV1Api(api(cluster))
    with pytest.raises(ApiException) as err:
        core.patch_node(
            "n1",
            {"metadata": {"resourceVersion": "1"}, "spec": {"unschedulable": True}},
            _content_type="application/merge-patch+json",
        )
    assert err.value.status == 409
    assert coord.read_namespaced_lease("tg", NS).spec.holder_identity == "b"


def test_strategic_merge_patch_semantics() -> None:
    target: dict[str, Any] = {
        "metadata": {"finalizers": ["a"]},
        "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    patch = {
        "metadata": {"finalizers": ["b"]},
        "spec": {"taints": [{"key": "y", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "TrainguardHealthy", "status": "False"}]},
    }
    out = strategic_merge(target, patch)
    assert out["metadata"]["finalizers"] == ["a", "b"]  # set union
    assert out["spec"]["taints"] == [{"key": "y", "effect": "NoSchedule"}]  # no merge key
    assert [c["type"] for c in out["status"]["conditions"]] == ["Ready", "TrainguardHealthy"]
    again = strategic_merge(
        out,
        {
            "status": {"conditions": [{"type": "Ready", "$patch": "delete"}]},
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]},
        },
    )
    assert again["status"]["conditions"] == [{"type": "TrainguardHealthy", "status": "False"}]
    assert again["metadata"]["finalizers"] == ["b"]
    # JSON merge patch on the same lists replaces them (RFC 7386).
    from tests.actuators.fake_kube import merge_patch

    assert merge_patch(target, patch)["status"]["conditions"] == patch["status"]["conditions"]


def test_node_status_subresource_merges_conditions_and_ignores_spec(
    cluster: FakeCluster,
) -> None:
    node(cluster, "n1")
    core = client.CoreV1Api(api(cluster))
    core.patch_node_status(
        "n1",
        {
            "spec": {"unschedulable": True},
            "status": {"conditions": [{"type": "TrainguardHealthy", "status": "False"}]},
        },
        _content_type="application/strategic-merge-patch+json",
    )
    n = cluster.get("", "nodes", "", "n1")
    assert n is not None and not n["spec"].get("unschedulable")
    assert [c["type"] for c in n["status"]["conditions"]] == ["Ready", "TrainguardHealthy"]
    # Custom resources refuse strategic merge patches, as on a real server.
    cluster.put("jobset.x-k8s.io", "jobsets", {"metadata": {"name": "js", "namespace": NS}})
    with pytest.raises(ApiException) as err:
        client.CustomObjectsApi(api(cluster)).patch_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "js", {"spec": {}},
            _content_type="application/strategic-merge-patch+json",
        )  # fmt: skip
    assert err.value.status == 415


def test_eviction_respects_pod_disruption_budgets(cluster: FakeCluster) -> None:
    node(cluster, "n1")
    for i in range(3):
        pod(cluster, f"w{i}", "n1", labels={"app": "trainer"})
    cluster.put(
        "policy",
        "poddisruptionbudgets",
        {
            "metadata": {"name": "trainer", "namespace": NS},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "trainer"}}},
        },
    )
    core = client.CoreV1Api(api(cluster))

    def evict(name: str) -> None:
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=NS))
        core.create_namespaced_pod_eviction(name, NS, body)

    evict("w0")  # 3 healthy, 2 required: one may go
    with pytest.raises(ApiException) as err:
        evict("w1")
    assert err.value.status == 429
    assert json.loads(err.value.body)["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert cluster.get("", "pods", NS, "w1") is not None


def test_watch_streams_changes_bookmarks_and_410_gone(cluster: FakeCluster) -> None:
    node(cluster, "n1")
    core = client.CoreV1Api(api(cluster))
    listed = core.list_node()
    rv = listed.metadata.resource_version
    core.patch_node(
        "n1", {"spec": {"unschedulable": True}}, _content_type="application/merge-patch+json"
    )
    cluster.bookmark_interval_s = 0.05
    w = watch.Watch()
    seen = []
    for event in w.stream(
        core.list_node, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=1
    ):
        seen.append(event["type"])
        if "BOOKMARK" in seen:
            w.stop()
    assert seen[0] == "MODIFIED" and "BOOKMARK" in seen
    assert int(w.resource_version) >= int(rv) + 1
    cluster.compact()
    core.patch_node(
        "n1", {"spec": {"unschedulable": None}}, _content_type="application/merge-patch+json"
    )
    with pytest.raises(ApiException) as err:
        for _ in watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1):
            pass
    assert err.value.status == 410


def test_garbage_collection_of_a_jobsets_jobs_and_pods(cluster: FakeCluster) -> None:
    node(cluster, "n1")
    js = cluster.put("jobset.x-k8s.io", "jobsets", {"metadata": {"name": "js", "namespace": NS}})
    refs = {"ownerReferences": [owner(js)]}
    job = cluster.put("batch", "jobs", {"metadata": {"name": "js-w-0", "namespace": NS, **refs}})
    pod(cluster, "js-w-0-0", "n1", owners=[owner(job)])
    pod(cluster, "unrelated", "n1")
    custom = client.CustomObjectsApi(api(cluster))
    custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "js")
    assert cluster.get("batch", "jobs", NS, "js-w-0") is None
    assert cluster.get("", "pods", NS, "js-w-0-0") is None
    assert cluster.get("", "pods", NS, "unrelated") is not None
    # Orphan: the dependents stay and lose the reference.
    job2 = cluster.put("batch", "jobs", {"metadata": {"name": "j2", "namespace": NS}})
    pod(cluster, "j2-0", "n1", owners=[owner(job2)])
    client.BatchV1Api(api(cluster)).delete_namespaced_job("j2", NS, propagation_policy="Orphan")
    left = cluster.get("", "pods", NS, "j2-0")
    assert left is not None and not left["metadata"].get("ownerReferences")


def test_finalizers_hold_deletion_until_removed(cluster: FakeCluster) -> None:
    node(cluster, "n1")
    p = pod(cluster, "p", "n1")
    core = client.CoreV1Api(api(cluster))
    core.patch_namespaced_pod(
        "p", NS, {"metadata": {"finalizers": ["trainguard.io/hold"]}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    core.delete_namespaced_pod("p", NS)
    held = cluster.get("", "pods", NS, "p")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    assert held["metadata"]["uid"] == p["metadata"]["uid"]
    core.patch_namespaced_pod(
        "p", NS, {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
    )
    assert cluster.get("", "pods", NS, "p") is None


def test_every_write_is_checked_against_the_schema(cluster: FakeCluster) -> None:
    """A write the chart's Kubernetes version (or the CRD's published model) would not
    accept is refused with 422 and recorded; a valid one passes."""
    node(cluster, "n1")
    core = client.CoreV1Api(api(cluster))
    merge = "application/merge-patch+json"
    core.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=merge)
    with pytest.raises(ApiException) as err:
        core.patch_node("n1", {"spec": {"unschedulabel": True}}, _content_type=merge)
    assert err.value.status == 422 and "unschedulabel" in (err.value.body or "")
    cluster.put(
        "jobset.x-k8s.io",
        "jobsets",
        {"metadata": {"name": "js", "namespace": NS}, "spec": {"replicatedJobs": []}},
    )
    custom = client.CustomObjectsApi(api(cluster))
    args = ("jobset.x-k8s.io", "v1alpha2", NS, "jobsets", "js")
    custom.patch_namespaced_custom_object(*args, {"spec": {"suspend": True}})
    with pytest.raises(ApiException) as err:  # a field JobSet's own model does not know
        custom.patch_namespaced_custom_object(*args, {"spec": {"suspended": True}})
    assert err.value.status == 422 and "unknown to the model" in (err.value.body or "")
    assert len(cluster.invalid_writes) == 2
    cluster.invalid_writes.clear()  # seen; the fixture fails a test that leaves any


def _ptj_pods(c: FakeCluster) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in c.items("", "pods", NS)}


def test_training_operator_pods_env_and_exit_code_retries(cluster: FakeCluster) -> None:
    """The fake Training Operator: pods with the operator's torchrun variables and pod
    restartPolicy; a Failed pod is recreated when ``ExitCode`` retries its code (>= 128),
    left Failed when not (1..127)."""
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(cluster, n)
    rank = {"spec": {"containers": [{"name": "pytorch", "image": "t"}]}}
    specs = {
        "Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": rank},
        "Worker": {"replicas": 2, "restartPolicy": "ExitCode", "template": rank},
    }
    doc = {"metadata": {"name": "pt", "namespace": NS}, "spec": {"nprocPerNode": "2",
           "runPolicy": {}, "pytorchReplicaSpecs": specs}}  # fmt: skip
    cluster.put("kubeflow.org", "pytorchjobs", doc)
    assert cluster.reconcile_pytorchjob(NS, "pt") == ["pt-master-0", "pt-worker-0", "pt-worker-1"]
    pods = _ptj_pods(cluster)
    env = {e["name"]: e["value"] for e in pods["pt-worker-1"]["spec"]["containers"][0]["env"]}
    assert env["PET_NODE_RANK"] == env["RANK"] == "2"  # workers count from 1 after the master
    assert env["PET_NNODES"] == "3" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["WORLD_SIZE"] == "6" and env["PET_MASTER_ADDR"] == "pt-master-0"
    assert env["PET_MASTER_PORT"] == "23456"
    assert pods["pt-worker-1"]["spec"]["restartPolicy"] == "Never"  # ExitCode: the operator's
    for name, code in (("pt-worker-0", 137), ("pt-worker-1", 1)):
        failed = pods[name]
        failed["status"] = {"phase": "Failed", "containerStatuses": [
            {"name": "pytorch", "state": {"terminated": {"exitCode": code}}}]}  # fmt: skip
        cluster.put("", "pods", failed)
    assert cluster.reconcile_pytorchjob(NS, "pt") == ["pt-worker-0"]  # 137: retried
    after = _ptj_pods(cluster)
    assert after["pt-worker-0"]["metadata"]["uid"] != pods["pt-worker-0"]["metadata"]["uid"]
    assert after["pt-worker-1"]["status"]["phase"] == "Failed"  # 1: permanent, left alone
