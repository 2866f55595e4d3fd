"""``KubernetesActuator.restart_job`` the workload's own way, end to end on the fake cluster
(its JobSet controller, training operator and scheduler): PyTorchJob by its restartPolicy,
TrainJob through its JobSet's failurePolicy, elastic shrinks, and never half a gang when a
restart fails half-way."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.kubernetes import KubernetesActuator
from tests.actuators import k8s_objects as k
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, round_trip, run
from tests.actuators.test_k8s_workloads import jobset_doc
from trainguard.wire import RankEvent

__all__ = ["cluster"]

NODES = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")


def actuator(c: FakeCluster) -> KubernetesActuator:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return KubernetesActuator(client.ApiClient(cfg), NS, settle_timeout_s=2, poll_interval_s=0.05)


def report_ranks(act: KubernetesActuator, c: FakeCluster, job: str, per_pod: int = 2) -> None:
    """What the agents forward: ``per_pod`` torchrun ranks in each pod, no rank labels."""
    pods = sorted(c.items("", "pods", NS), key=lambda p: p["metadata"]["name"])
    world = len(pods) * per_pod
    for i, pod in enumerate(pods):
        for local in range(per_pod):
            ev = RankEvent(job=job, rank=per_pod * i + local, kind="started", time_unix_s=1.0,
                           local_rank=local, world_size=world, pod=pod["metadata"]["name"],
                           namespace=NS)  # fmt: skip
            act.observe_ranks(pod["spec"]["nodeName"], [ev])


def pods_of(c: FakeCluster) -> dict[str, tuple[str, str | None]]:
    """pod -> (node, trainguard generation annotation)."""
    return {
        p["metadata"]["name"]: (
            p["spec"]["nodeName"],
            (p["metadata"].get("annotations") or {}).get("trainguard.io/generation"),
        )
        for p in c.items("", "pods", NS)
    }


def elastic_pytorchjob(c: FakeCluster, *, policy: str = "OnFailure") -> dict[str, Any]:
    """Four workers, torchrun-elastic between two and four (``elasticPolicy``)."""
    template = k.pod_template("pt")
    template["spec"]["restartPolicy"] = policy
    doc = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "pt", "namespace": NS, "labels": {"trainguard.io/job": "pt"}},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "elasticPolicy": {"minReplicas": 2, "maxReplicas": 4, "rdzvBackend": "c10d"},
            "pytorchReplicaSpecs": {
                "Worker": {"replicas": 4, "restartPolicy": policy, "template": template}
            },
        },
    }
    round_trip(doc)
    for n in NODES:
        node(c, n)
    c.put("kubeflow.org", "pytorchjobs", doc)
    assert len(c.reconcile_pytorchjob(NS, "pt")) == 4
    return doc


def test_pytorchjob_on_failure_shrinks_within_its_elastic_policy_when_no_node_is_spare(
    cluster: FakeCluster,
) -> None:
    elastic_pytorchjob(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster, "pt")
    placement = run(act.current_placement("pt"))
    assert placement is not None and placement.nodes == NODES
    run(act.isolate_node("gpu-a", reason="xid 79"))
    # No spare node: the gang goes on three nodes, which elasticPolicy 2..4 allows.
    new = Placement(job="pt", nodes=NODES[1:], ranks_per_node=2, generation=1, resume_step=40)
    result = run(act.restart_job(new, reason="xid 79 on gpu-a"))
    assert result.details["mode"] == "delete-pods"
    assert result.details["resize"] == "shrunk from 4 to 3 pod(s) within elasticPolicy"
    assert "shrunk from 4 to 3 pod(s) within elasticPolicy" in result.outcome
    assert len(result.details["evicted"]) == 4  # the whole gang, not only gpu-a's pod
    pj = cluster.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pj is not None
    round_trip(pj)
    worker = pj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 3
    assert worker["template"]["metadata"]["annotations"]["trainguard.io/generation"] == "1"
    assert pj["metadata"]["annotations"]["trainguard.io/generation"] == "1"
    # The operator recreates the pods from the new spec, the scheduler keeps gpu-a out.
    cluster.reconcile_pytorchjob(NS, "pt")
    after = pods_of(cluster)
    assert sorted(n for n, _ in after.values()) == ["gpu-b", "gpu-c", "gpu-d"]
    assert {g for _, g in after.values()} == {"1"}
    reasons = [(e["involvedObject"]["kind"], e["reason"]) for e in cluster.items("", "events")]
    assert ("PyTorchJob", "JobRestarted") in reasons
    # Below elasticPolicy.minReplicas: refused, nothing written.
    writes = len([s for s in cluster.served if s[2] in ("patch", "delete", "create")])
    with pytest.raises(ActuatorError, match=r"outside its elasticPolicy \(2\.\.4\)"):
        run(act.restart_job(Placement(job="pt", nodes=("gpu-b",), ranks_per_node=2,
                                      generation=2), reason="x"))  # fmt: skip
    assert len([s for s in cluster.served if s[2] in ("patch", "delete", "create")]) == writes


def test_pytorchjob_restart_failing_half_way_suspends_it_and_a_retry_finishes(
    cluster: FakeCluster,
) -> None:
    elastic_pytorchjob(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster, "pt")
    cluster.faults[("", "pods/eviction", "create")] = 1  # the second eviction fails
    new = Placement(job="pt", nodes=NODES, ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(new, reason="hang"))
    assert err.value.retryable
    assert "interrupted after 1 of 4 old pod(s)" in str(err.value)
    assert "suspended so that no half gang trains" in str(err.value)
    pj = cluster.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pj is not None and pj["spec"]["runPolicy"]["suspend"] is True
    # Never old and new side by side: the operator runs nothing while suspended.
    assert cluster.reconcile_pytorchjob(NS, "pt") == [] and pods_of(cluster) == {}
    del cluster.faults[("", "pods/eviction", "create")]
    result = run(act.restart_job(new, reason="retry"))
    assert result.details["mode"] == "suspend-resume"
    pj = cluster.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pj is not None and pj["spec"]["runPolicy"]["suspend"] is False
    assert len(cluster.reconcile_pytorchjob(NS, "pt")) == 4
    assert {g for _, g in pods_of(cluster).values()} == {"1"}


def test_pytorchjob_never_goes_through_suspend_and_resume(cluster: FakeCluster) -> None:
    elastic_pytorchjob(cluster, policy="Never")
    act = actuator(cluster)
    report_ranks(act, cluster, "pt")
    new = Placement(job="pt", nodes=NODES, ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="hang"))
    assert result.details["mode"] == "suspend-resume" and "resize" not in result.details
    suspends = [
        s for s in cluster.served if s == ("kubeflow.org", "pytorchjobs", "patch")
    ]  # suspend, then one resize-and-resume patch
    assert len(suspends) == 2
    assert len(cluster.reconcile_pytorchjob(NS, "pt")) == 4


def test_indexed_job_restart_failing_half_way_stays_suspended(cluster: FakeCluster) -> None:
    cluster.instant_controller = False  # the pods outlive the suspension for a while
    job = k.indexed_job(cluster, "ix", 4)
    k.pods(cluster, "ix", job, ["gpu-a", "gpu-b"], 2)
    act = actuator(cluster)
    cluster.faults[("", "pods/eviction", "create")] = 2
    with pytest.raises(ActuatorError, match="injected fault"):
        run(act.restart_job(Placement(job="ix", nodes=("gpu-a", "gpu-b"), ranks_per_node=2,
                                      generation=1), reason="x"))  # fmt: skip
    obj = cluster.get("batch", "jobs", NS, "ix")
    assert obj is not None and obj["spec"]["suspend"] is True
    # The template still says the old generation: nothing of generation 1 can start.
    assert "annotations" not in obj["spec"]["template"].get("metadata", {})
    del cluster.faults[("", "pods/eviction", "create")]
    cluster.objects[("batch", "jobs", NS, "ix")]["status"] = {}  # the Job controller caught up
    result = run(act.restart_job(Placement(job="ix", nodes=("gpu-a", "gpu-b"), ranks_per_node=2,
                                           generation=1), reason="retry"))  # fmt: skip
    assert result.details["mode"] == "suspend-resume"
    obj = cluster.get("batch", "jobs", NS, "ix")
    assert obj is not None and obj["spec"]["suspend"] is False
    assert obj["spec"]["template"]["metadata"]["annotations"]["trainguard.io/generation"] == "1"


def trainjob(c: FakeCluster, *, max_restarts: int) -> None:
    """A TrainJob and the JobSet Kubeflow Trainer made of it (two nodes, torchrun x2)."""
    for n in NODES[:3]:
        node(c, n)
    tj = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "tj", "namespace": NS, "labels": {"trainguard.io/job": "tj"}},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": 2}},
    }
    round_trip(tj)
    tj = c.put("trainer.kubeflow.org", "trainjobs", tj)
    js = jobset_doc("tj", replicas=2, max_restarts=max_restarts)
    js["spec"]["replicatedJobs"][0]["name"] = "node"
    js["metadata"]["ownerReferences"] = [k.ref(tj)]
    c.put("jobset.x-k8s.io", "jobsets", js)
    assert c.reconcile_jobset(NS, "tj") == "created"


def test_trainjob_restarts_through_its_jobsets_failure_policy(cluster: FakeCluster) -> None:
    trainjob(cluster, max_restarts=2)
    act = actuator(cluster)
    report_ranks(act, cluster, "tj")
    run(act.isolate_node("gpu-a", reason="xid 79"))
    new = Placement(job="tj", nodes=("gpu-b", "gpu-c"), ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="xid 79 on gpu-a"))
    assert result.details["workload"] == "TrainJob tj"
    assert result.details["mode"] == "fail-child-jobs"
    assert (result.details["restarts_used"], result.details["max_restarts"]) == (1, 2)
    tj = cluster.get("trainer.kubeflow.org", "trainjobs", NS, "tj")
    assert tj is not None and tj["metadata"]["annotations"]["trainguard.io/generation"] == "1"
    round_trip(tj)
    assert cluster.reconcile_jobset(NS, "tj") == "restarted"
    assert sorted(n for n, _ in pods_of(cluster).values()) == ["gpu-b", "gpu-c"]
    reasons = [(e["involvedObject"]["kind"], e["reason"]) for e in cluster.items("", "events")]
    assert ("TrainJob", "TrainguardGangRestart") in reasons


def test_trainjob_shrink_is_refused_by_a_fixed_nnodes_and_resizes_on_the_trainjob(
    cluster: FakeCluster,
) -> None:
    trainjob(cluster, max_restarts=2)
    act = actuator(cluster)
    report_ranks(act, cluster, "tj")
    one = Placement(job="tj", nodes=("gpu-b",), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError, match=r"torchrun --nnodes=2 is fixed"):
        run(act.restart_job(one, reason="x"))
    js = cluster.objects[("jobset.x-k8s.io", "jobsets", NS, "tj")]
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container["containers"][0]["command"][1] = "--nnodes=1:2"
    result = run(act.restart_job(one, reason="x"))
    assert result.details["resize"] == "shrunk from 2 to 1 pod(s) within torchrun --nnodes=1:2"
    assert result.details["mode"] == "suspend-resume"
    tj = cluster.get("trainer.kubeflow.org", "trainjobs", NS, "tj")
    assert tj is not None
    assert tj["spec"]["trainer"]["numNodes"] == 1 and tj["spec"]["suspend"] is False
    round_trip(tj)


def test_pytorchjob_pods_kept_by_a_pdb_are_no_half_gang(cluster: FakeCluster) -> None:
    """With ``delete_on_pdb_block`` off, a PodDisruptionBudget that keeps old pods would
    leave them training beside the new ones: the PyTorchJob is suspended instead."""
    elastic_pytorchjob(cluster)
    cfg = client.Configuration(host=cluster.url)
    cfg.retries = 0
    act = KubernetesActuator(client.ApiClient(cfg), NS, delete_on_pdb_block=False)
    report_ranks(act, cluster, "pt")
    cluster.pdb_blocked.add("pt-worker-3")
    new = Placement(job="pt", nodes=NODES, ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError, match="PodDisruptionBudget kept 1 old pod"):
        run(act.restart_job(new, reason="hang"))
    pj = cluster.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pj is not None and pj["spec"]["runPolicy"]["suspend"] is True
    assert pods_of(cluster) == {}


def test_trainjob_stop_suspends_the_trainjob_not_its_jobset(cluster: FakeCluster) -> None:
    trainjob(cluster, max_restarts=2)
    act = actuator(cluster)
    report_ranks(act, cluster, "tj")
    result = run(act.stop_job("tj", reason="hang"))
    assert result.details["workload"] == "TrainJob tj"
    tj = cluster.get("trainer.kubeflow.org", "trainjobs", NS, "tj")
    js = cluster.get("jobset.x-k8s.io", "jobsets", NS, "tj")
    assert tj is not None and tj["spec"]["suspend"] is True
    assert js is not None and not js["spec"].get("suspend")  # the TrainJob's controller's
    assert pods_of(cluster) == {}


def test_limits_tell_the_engine_the_smallest_size_the_job_allows(cluster: FakeCluster) -> None:
    """``limits`` (read by the shrink planner right after ``candidate_nodes``): min_dp from
    the workload's own elastic range, in data-parallel ranks."""
    elastic_pytorchjob(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster, "pt")
    assert act.limits("pt") is None  # not read yet
    run(act.current_placement("pt"))
    assert run(act.candidate_nodes("pt")) == list(NODES)
    limits = act.limits("pt")
    assert limits is not None and limits.min_dp == 4  # minReplicas 2 x torchrun 2 ranks


def test_limits_of_a_fixed_nnodes_forbid_any_shrink(cluster: FakeCluster) -> None:
    trainjob(cluster, max_restarts=2)
    act = actuator(cluster)
    report_ranks(act, cluster, "tj")
    run(act.candidate_nodes("tj"))
    limits = act.limits("tj")
    assert limits is not None and limits.min_dp == 4  # --nnodes=2, 2 ranks per pod


def test_pytorchjob_policy_max_restarts_counts_trainguards_restarts(cluster: FakeCluster) -> None:
    """A PyTorchJob has no restart counter of its own: its trainguard.io/policy
    ``max_restarts`` caps the restarts trainguard recorded (trainguard.io/generation)."""
    elastic_pytorchjob(cluster)
    pj = cluster.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pj is not None
    pj["metadata"]["annotations"] = {"trainguard.io/policy": '{"max_restarts": 1}'}
    cluster.put("kubeflow.org", "pytorchjobs", pj)
    act = actuator(cluster)
    report_ranks(act, cluster, "pt")
    first = Placement(job="pt", nodes=NODES, ranks_per_node=2, generation=1)
    assert run(act.restart_job(first, reason="hang")).details["mode"] == "delete-pods"
    cluster.reconcile_pytorchjob(NS, "pt")
    writes = len([s for s in cluster.served if s[2] in ("patch", "delete", "create")])
    second = Placement(job="pt", nodes=NODES, ranks_per_node=2, generation=2)
    with pytest.raises(ActuatorError, match=r"restarted it 1 time\(s\), the 1 its trainguard"):
        run(act.restart_job(second, reason="hang again"))
    assert len([s for s in cluster.served if s[2] in ("patch", "delete", "create")]) == writes


def _jobset_of_two_pods(c: FakeCluster) -> None:
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(c, n)
    doc = jobset_doc("llm", replicas=2, max_restarts=0, nnodes="1:8")
    doc["metadata"]["labels"] = {"trainguard.io/job": "llm"}
    pod_meta = {"labels": {"trainguard.io/job": "llm"}}
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] = pod_meta
    c.put("jobset.x-k8s.io", "jobsets", doc)
    c.reconcile_jobset(NS, "llm")


def _report_partly(act: KubernetesActuator, c: FakeCluster) -> None:
    """Two pods of 8 torchrun ranks; the first pod's ranks 3-7 have not reported yet."""
    pods = sorted(c.items("", "pods", NS), key=lambda p: p["metadata"]["name"])
    for i, pod in enumerate(pods):
        for local in range(8 if i else 3):
            ev = RankEvent(job="llm", rank=8 * i + local, kind="started", time_unix_s=1.0,
                           local_rank=local, world_size=16, pod=pod["metadata"]["name"],
                           namespace=NS)  # fmt: skip
            act.observe_ranks(pod["spec"]["nodeName"], [ev])


def replicas(c: FakeCluster) -> int:
    (jobset,) = c.items("jobset.x-k8s.io", "jobsets", NS)
    return int(jobset["spec"]["replicatedJobs"][0]["replicas"])


def test_a_restart_at_the_same_size_keeps_the_pod_count_whatever_ranks_reported(
    cluster: FakeCluster,
) -> None:
    """Counted from the first pod's 3 reported ranks, 16 ranks would make 5 pods: the gang
    came back 40 ranks strong. The same world size keeps the workload's pod count."""
    _jobset_of_two_pods(cluster)
    act = actuator(cluster)
    _report_partly(act, cluster)
    same = Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=8, generation=1)
    result = run(act.restart_job(same, reason="gpu_fault"))
    assert result.details["ranks_per_pod"] == 8 and "resize" not in result.details
    assert replicas(cluster) == 2


def test_a_resize_from_a_partial_layout_is_refused_and_changes_nothing(
    cluster: FakeCluster,
) -> None:
    _jobset_of_two_pods(cluster)
    act = actuator(cluster)
    _report_partly(act, cluster)
    smaller = Placement(job="llm", nodes=("gpu-b",), ranks_per_node=8, generation=1)
    with pytest.raises(ActuatorError, match=r"ranks \[3, 4, 5, 6, 7\] have not reported"):
        run(act.restart_job(smaller, reason="gpu_fault"))
    assert replicas(cluster) == 2


def _job_running_half_its_indexes(cluster: FakeCluster, *, indexed: bool) -> None:
    """A Job of 4 completions, 2 pods at a time (parallelism < completions)."""
    for n in NODES:
        node(cluster, n)
    job = k.indexed_job(cluster, "half", 2)
    job["spec"]["completions"] = 4
    if not indexed:
        del job["spec"]["completionMode"]
    cluster.put("batch", "jobs", job)
    k.pods(cluster, "half", job, ["gpu-a", "gpu-b"], 1)


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "non-indexed"])
def test_a_same_size_restart_leaves_a_jobs_completions_alone(
    cluster: FakeCluster, indexed: bool
) -> None:
    """completions is immutable on a non-indexed Job: patched with the parallelism, the
    API server refused the resume (422) and left the Job suspended for good; an Indexed one
    silently lost its last two indexes."""
    _job_running_half_its_indexes(cluster, indexed=indexed)
    act = actuator(cluster)
    same = Placement(job="half", nodes=("gpu-a", "gpu-b"), ranks_per_node=1, generation=1)
    run(act.restart_job(same, reason="gpu_fault"))
    obj = cluster.get("batch", "jobs", NS, "half")
    assert obj is not None and not obj["spec"]["suspend"]
    assert (obj["spec"]["parallelism"], obj["spec"]["completions"]) == (2, 4)


def test_resizing_a_job_whose_completions_exceed_its_parallelism_is_refused(
    cluster: FakeCluster,
) -> None:
    _job_running_half_its_indexes(cluster, indexed=True)
    act = actuator(cluster)
    smaller = Placement(job="half", nodes=("gpu-a",), ranks_per_node=1, generation=1)
    with pytest.raises(ActuatorError, match="runs 4 completions 2 at a time"):
        run(act.restart_job(smaller, reason="gpu_fault"))
    obj = cluster.get("batch", "jobs", NS, "half")
    assert obj is not None and not obj["spec"].get("suspend")
    assert (obj["spec"]["parallelism"], obj["spec"]["completions"]) == (2, 4)
