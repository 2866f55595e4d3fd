"""An acceptance sweep of job layouts and cluster states, each against the fake API server.

The other actuator tests follow the layouts docs/kubernetes.md shows (one replicatedJob, one
trainguard job per namespace, every call allowed). Real clusters are messier, so this file
drives the actuator through the official client over the layouts and states users meet
next, each test stating the outcome an operator sees:

* JobSets with a launcher next to the workers (several replicatedJobs), sidecar and init
  containers, a worker pod not scheduled yet, a JobSet that already finished;
* PyTorchJobs with a Master and Workers, with and without ``elasticPolicy``, one that
  already Succeeded;
* pods whose Node was deleted, pods trainguard cannot map to a workload, two jobs sharing a
  node, a node name with dots, a job of the same name in another namespace;
* hostile API answers: a 409 from a concurrent writer, a workload deleted meanwhile (404),
  a missing RBAC rule (403).

The rule throughout: a job trainguard cannot act on correctly is refused in one line that
says why, never another workload touched and never a success that did nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.kubernetes import KubernetesActuator
from tests.actuators import k8s_objects as k
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, pod, round_trip, run
from tests.actuators.test_k8s_workloads import jobset_doc
from trainguard.wire import RankEvent

__all__ = ["cluster"]

JS = ("jobset.x-k8s.io", "jobsets")
PTJ = ("kubeflow.org", "pytorchjobs")
WRITES = ("patch", "delete", "create", "update")


def actuator(c: FakeCluster, ns: str = NS) -> KubernetesActuator:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return KubernetesActuator(client.ApiClient(cfg), ns, settle_timeout_s=2, poll_interval_s=0.05)


def writes(c: FakeCluster) -> list[tuple[str, str, str]]:
    return [s for s in c.served if s[2] in WRITES]


def report(
    act: KubernetesActuator,
    job: str,
    pods: list[dict[str, Any]],
    per_pod: int = 2,
    world: int | None = None,
) -> None:
    """What the node agents forward: ``per_pod`` torchrun ranks in each of ``pods``, of a
    world of ``world`` ranks (default: those pods' ranks)."""
    world = world or len(pods) * per_pod
    for i, p in enumerate(pods):
        meta = p["metadata"]
        for local in range(per_pod):
            ev = RankEvent(job=job, rank=per_pod * i + local, kind="started", time_unix_s=1.0,
                           local_rank=local, world_size=world, pod=meta["name"],
                           namespace=meta["namespace"])  # fmt: skip
            act.observe_ranks(p["spec"].get("nodeName") or "", [ev])


def pods_where(c: FakeCluster, ns: str = NS, **labels: str) -> list[dict[str, Any]]:
    out = [
        p
        for p in c.items("", "pods", ns)
        if all((p["metadata"].get("labels") or {}).get(k_) == v for k_, v in labels.items())
    ]
    return sorted(out, key=lambda p: p["metadata"]["name"])


def launcher_jobset(c: FakeCluster, *, annotate: bool, max_restarts: int = 3) -> None:
    """A JobSet with a ``launcher`` replicatedJob next to two ``workers`` child Jobs; every
    pod carries the job's label, the workers run a sidecar and an init container."""
    for n in ("gpu-a", "gpu-b", "gpu-c", "cpu-a"):
        node(c, n)
    doc = jobset_doc("llm", replicas=2, max_restarts=max_restarts)
    doc["metadata"]["labels"] = {"trainguard.io/job": "llm"}
    if annotate:
        doc["metadata"]["annotations"] = {"trainguard.io/replicated-job": "workers"}
    workers = doc["spec"]["replicatedJobs"][0]
    pod_spec = workers["template"]["spec"]["template"]
    pod_spec["metadata"] = {"labels": {"trainguard.io/job": "llm"}}
    pod_spec["spec"]["containers"].append({"name": "metrics", "image": "exporter:1"})
    pod_spec["spec"]["initContainers"] = [{"name": "fetch", "image": "fetch:1"}]
    launcher = {
        "name": "launcher",
        "replicas": 1,
        "template": {
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": {"trainguard.io/job": "llm"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "launch", "image": "launch:1"}],
                    },
                },
            }
        },
    }
    doc["spec"]["replicatedJobs"].insert(0, launcher)
    round_trip(doc)
    c.put(*JS, doc)
    assert c.reconcile_jobset(NS, "llm") == "created"


def jobset_gang(c: FakeCluster, job: str, nodes: list[str]) -> None:
    """A JobSet of one pod per child Job on ``nodes`` (ranks labelled)."""
    js = k.jobset(c, job, len(nodes))
    children = [k.child_job(c, js, f"{job}-workers-{i}") for i in range(len(nodes))]
    k.pods(c, job, children, nodes, 1)


def workers(c: FakeCluster) -> list[dict[str, Any]]:
    return pods_where(c, **{"jobset.sigs.k8s.io/replicatedjob-name": "workers"})


# -- JobSet layouts ------------------------------------------------------------------------


def test_a_jobset_with_a_launcher_not_saying_which_job_holds_the_ranks_is_refused(
    cluster: FakeCluster,
) -> None:
    launcher_jobset(cluster, annotate=False)
    act = actuator(cluster)
    report(act, "llm", workers(cluster))
    before = len(writes(cluster))
    new = Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError, match=r"annotate it trainguard.io/replicated-job=<one of"):
        run(act.restart_job(new, reason="xid 79"))
    assert len(writes(cluster)) == before  # nothing touched, not the launcher's size either


def test_a_jobset_with_a_launcher_shrinks_only_its_workers_and_keeps_its_containers(
    cluster: FakeCluster,
) -> None:
    launcher_jobset(cluster, annotate=True, max_restarts=0)
    doc = cluster.get(*JS, NS, "llm")
    assert doc is not None
    worker_rj = doc["spec"]["replicatedJobs"][1]
    command = worker_rj["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    command[1] = "--nnodes=1:2"
    cluster.objects[(*JS, NS, "llm")]["spec"] = doc["spec"]
    act = actuator(cluster)
    report(act, "llm", workers(cluster))
    placement = run(act.current_placement("llm"))
    assert placement is not None and placement.world_size == 4  # the launcher is no rank
    new = Placement(job="llm", nodes=("gpu-b",), ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="xid 79 on gpu-a"))
    assert result.details["mode"] == "suspend-resume"
    assert result.details["resize"] == "shrunk from 2 to 1 pod(s) within torchrun --nnodes=1:2"
    js = cluster.get(*JS, NS, "llm")
    assert js is not None and not js["spec"]["suspend"]
    round_trip(js)
    launcher, new_workers = js["spec"]["replicatedJobs"]
    assert (launcher["name"], launcher["replicas"]) == ("launcher", 1)
    assert new_workers["replicas"] == 1
    spec = new_workers["template"]["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["trainer", "metrics"]
    assert [c["name"] for c in spec["initContainers"]] == ["fetch"]
    assert "annotations" not in (launcher["template"]["spec"]["template"].get("metadata") or {})


def test_a_gang_with_a_worker_not_scheduled_yet_has_no_placement_and_says_why(
    cluster: FakeCluster,
) -> None:
    node(cluster, "gpu-a")  # room for one pod of two: the second stays Pending
    doc = jobset_doc("llm", replicas=2, max_restarts=3)
    doc["metadata"]["labels"] = {"trainguard.io/job": "llm"}
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] = {
        "labels": {"trainguard.io/job": "llm"}
    }
    cluster.put(*JS, doc)
    cluster.objects[("", "nodes", "", "gpu-a")]["spec"]["unschedulable"] = False
    assert cluster.reconcile_jobset(NS, "llm") == "created"
    # The fake scheduler puts both on gpu-a; make the second one unscheduled.
    pods = pods_where(cluster)
    stuck = cluster.objects[("", "pods", NS, pods[1]["metadata"]["name"])]
    stuck["spec"].pop("nodeName")
    stuck["status"] = {"phase": "Pending"}
    act = actuator(cluster)
    report(act, "llm", pods[:1], world=4)  # only the scheduled pod's ranks started
    with pytest.raises(ActuatorError, match=r"have not reported from pods"):
        run(act.current_placement("llm"))


@pytest.mark.parametrize("state", ["Completed", "Failed"])
@pytest.mark.parametrize("max_restarts", [0, 3])
def test_a_finished_jobset_is_not_restarted_and_the_restart_says_why(
    cluster: FakeCluster, state: str, max_restarts: int
) -> None:
    """The JobSet controller does nothing with a Completed or Failed JobSet (suspended,
    resumed or its pods deleted): a restart that reported success would do nothing."""
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(cluster, n)
    doc = jobset_doc("llm", replicas=2, max_restarts=max_restarts)
    doc["metadata"]["labels"] = {"trainguard.io/job": "llm"}
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] = {
        "labels": {"trainguard.io/job": "llm"}
    }
    cluster.put(*JS, doc)
    assert cluster.reconcile_jobset(NS, "llm") == "created"
    act = actuator(cluster)
    report(act, "llm", pods_where(cluster))
    js = cluster.objects[(*JS, NS, "llm")]
    js["status"] = {
        "terminalState": state,
        "conditions": [{"type": state, "status": "True", "reason": "AllJobsCompleted"}],
    }
    before = len(writes(cluster))
    new = Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError, match=rf"JobSet llm has finished \({state}\)") as err:
        run(act.restart_job(new, reason="xid 79"))
    assert not err.value.retryable
    assert len(writes(cluster)) == before  # nothing written
    assert cluster.reconcile_jobset(NS, "llm") == "nothing"


def test_stopping_an_already_suspended_jobset_says_so(cluster: FakeCluster) -> None:
    k.jobset(cluster, "js", 2)
    cluster.objects[(*JS, NS, "js")]["spec"]["suspend"] = True
    act = actuator(cluster)
    result = run(act.stop_job("js", reason="x"))
    assert result.details.get("already") and "already stopped" in result.outcome


# -- PyTorchJob layouts --------------------------------------------------------------------


def master_worker(c: FakeCluster, *, workers: int, elastic: bool, policy: str) -> None:
    for n in ("gpu-a", "gpu-b", "gpu-c", "gpu-d"):
        node(c, n)
    template = k.pod_template("pt")
    spec: dict[str, Any] = {
        "runPolicy": {"cleanPodPolicy": "None"},
        "nprocPerNode": "2",
        "pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "restartPolicy": policy, "template": template},
            "Worker": {"replicas": workers, "restartPolicy": policy, "template": template},
        },
    }
    if elastic:
        spec["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": workers}
    doc = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "pt", "namespace": NS, "labels": {"trainguard.io/job": "pt"}},
        "spec": spec,
    }
    round_trip(doc)
    c.put(*PTJ, doc)
    assert len(c.reconcile_pytorchjob(NS, "pt")) == workers + 1


def operator_pods(c: FakeCluster) -> list[dict[str, Any]]:
    """Master first, then workers: the operator's RANK order."""
    pods = pods_where(c)
    return sorted(pods, key=lambda p: ("worker" in p["metadata"]["name"], p["metadata"]["name"]))


def test_a_master_and_workers_restart_in_place_keeping_the_master(cluster: FakeCluster) -> None:
    master_worker(cluster, workers=2, elastic=False, policy="OnFailure")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    placement = run(act.current_placement("pt"))
    assert placement is not None and len(placement.nodes) == 3
    run(act.isolate_node(placement.nodes[1], reason="xid 79"))
    spare = "gpu-d"
    nodes = (placement.nodes[0], spare, placement.nodes[2])
    result = run(act.restart_job(Placement(job="pt", nodes=nodes, ranks_per_node=2,
                                           generation=1), reason="xid"))  # fmt: skip
    assert result.details["mode"] == "delete-pods" and "resize" not in result.details
    pj = cluster.get(*PTJ, NS, "pt")
    assert pj is not None
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    assert len(cluster.reconcile_pytorchjob(NS, "pt")) == 3


def test_a_master_and_workers_without_elastic_policy_shrink_says_it_declares_no_range(
    cluster: FakeCluster,
) -> None:
    """Nothing declared, the engine's policy decides the size (``limits`` is ``None``);
    the operator recomputes WORLD_SIZE / PET_NNODES from the new replicas, and the outcome
    says the job declared no range."""
    master_worker(cluster, workers=2, elastic=False, policy="OnFailure")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    assert run(act.candidate_nodes("pt")) and act.limits("pt") is None
    new = Placement(job="pt", nodes=("gpu-a", "gpu-b"), ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="xid"))
    assert result.details["resize"] == (
        "shrunk from 3 to 2 pod(s) (the job declares no elastic range)"
    )
    pj = cluster.get(*PTJ, NS, "pt")
    assert pj is not None
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)


def test_a_master_and_workers_shrink_counts_workers_against_elastic_policy(
    cluster: FakeCluster,
) -> None:
    master_worker(cluster, workers=3, elastic=True, policy="OnFailure")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    new = Placement(job="pt", nodes=("gpu-a", "gpu-b"), ranks_per_node=2, generation=1)
    result = run(act.restart_job(new, reason="xid"))
    assert result.details["resize"] == "shrunk from 4 to 2 pod(s) within elasticPolicy"
    pj = cluster.get(*PTJ, NS, "pt")
    assert pj is not None
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)


@pytest.mark.parametrize("state", ["Succeeded", "Failed"])
def test_a_finished_pytorchjob_is_not_restarted(cluster: FakeCluster, state: str) -> None:
    master_worker(cluster, workers=1, elastic=False, policy="OnFailure")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    cluster.objects[(*PTJ, NS, "pt")]["status"] = {
        "conditions": [
            {"type": "Running", "status": "False"},
            {"type": state, "status": "True", "reason": f"PyTorchJob{state}"},
        ]
    }
    before = len(writes(cluster))
    new = Placement(job="pt", nodes=("gpu-a", "gpu-b"), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError, match=rf"PyTorchJob pt has finished \({state}\)"):
        run(act.restart_job(new, reason="xid"))
    assert len(writes(cluster)) == before


def test_a_finished_batch_job_is_not_restarted(cluster: FakeCluster) -> None:
    job = k.indexed_job(cluster, "ix", 2)
    k.pods(cluster, "ix", job, ["gpu-a", "gpu-b"], 1, phase="Succeeded")
    cluster.objects[("batch", "jobs", NS, "ix")]["status"] = {
        "succeeded": 2,
        "conditions": [{"type": "Complete", "status": "True"}],
    }
    act = actuator(cluster)
    new = Placement(job="ix", nodes=("gpu-a", "gpu-b"), ranks_per_node=1, generation=1)
    with pytest.raises(ActuatorError, match=r"Job ix has finished \(Complete\)"):
        run(act.restart_job(new, reason="x"))


# -- nodes and namespaces ------------------------------------------------------------------


def test_a_deleted_node_is_not_ready_not_a_candidate_and_isolating_it_says_404(
    cluster: FakeCluster,
) -> None:
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(cluster, n)
    jobset_gang(cluster, "js", ["gpu-a", "gpu-b"])
    with cluster.lock:  # the node object went, its pod stayed
        del cluster.objects[("", "nodes", "", "gpu-a")]
    act = actuator(cluster)
    view = run(act.node_view("gpu-a"))
    assert view.ready is False and view.pods_running is True
    assert run(act.candidate_nodes("js")) == ["gpu-b", "gpu-c"]
    with pytest.raises(ActuatorError, match=r'get node gpu-a: HTTP 404 nodes "gpu-a" not found'):
        run(act.isolate_node("gpu-a", reason="xid 79"))
    placement = run(act.current_placement("js"))
    assert placement is not None and placement.nodes == ("gpu-a", "gpu-b")


def test_two_jobs_on_one_node_drain_reports_both_and_the_view_sees_them(
    cluster: FakeCluster,
) -> None:
    node(cluster, "gpu-a.pool-1.example.internal")
    node(cluster, "gpu-b")
    shared = "gpu-a.pool-1.example.internal"
    for job in ("alpha", "beta"):
        jobset_gang(cluster, job, [shared, "gpu-b"])
    act = actuator(cluster)
    result = run(act.isolate_node(shared, reason="xid 79 (GPU fell off the bus)"))
    assert result.outcome.startswith(f"node {shared} cordoned, tainted trainguard.io/unhealthy=")
    drained = run(act.drain_node(shared, reason="xid 79"))
    assert sorted(drained.details["evicted"]) == [f"{NS}/alpha-0", f"{NS}/beta-0"]
    assert [p["metadata"]["name"] for p in cluster.items("", "pods", NS)] == ["alpha-1", "beta-1"]
    events = [e for e in cluster.items("", "events") if e["involvedObject"]["name"] == shared]
    assert {e["reason"] for e in events} >= {"TrainguardQuarantined", "TrainguardDrained"}
    released = run(act.release_node(shared, reason="repaired"))
    assert released.details == {"uncordoned": True, "untainted": True}


def test_a_job_that_maps_to_no_workload_is_refused_and_touches_nothing(
    cluster: FakeCluster,
) -> None:
    """Pods with neither the job's label nor an owner trainguard knows: the ranks reported
    them, but nothing says which workload to restart."""
    node(cluster, "gpu-a")
    pod(cluster, "bare-0", "gpu-a")
    pod(cluster, "bare-1", "gpu-a")
    k.jobset(cluster, "other", 2)  # a workload of another job stands next to it
    act = actuator(cluster)
    report(act, "bare", pods_where(cluster), per_pod=1)
    before = len(writes(cluster))
    with pytest.raises(ActuatorError, match=r"2 pod\(s\) but none owned by a workload"):
        run(act.stop_job("bare", reason="x"))
    with pytest.raises(ActuatorError, match=r"job 'bare' not found in namespace train"):
        run(act.restart_job(Placement(job="bare", nodes=("gpu-a",), ranks_per_node=2,
                                      generation=1), reason="x"))  # fmt: skip
    assert len(writes(cluster)) == before


def test_a_job_in_another_namespace_never_resolves_to_a_same_named_pod_here(
    cluster: FakeCluster,
) -> None:
    """Two teams deploy the same PyTorchJob example: its pods are named ``pt-master-0``,
    ``pt-worker-0`` in both namespaces. The ranks of team-a's job (its own trainguard job
    name) report pods in team-a; the actuator of namespace train must not take train's
    same-named pods, and so train's PyTorchJob, for them."""
    master_worker(cluster, workers=1, elastic=False, policy="OnFailure")
    act = actuator(cluster)
    theirs = [
        {**p, "metadata": {**p["metadata"], "namespace": "team-a"}} for p in operator_pods(cluster)
    ]
    report(act, "team-a-pt", theirs)
    before = len(writes(cluster))
    with pytest.raises(ActuatorError, match=r"job 'team-a-pt' not found in namespace train"):
        run(act.stop_job("team-a-pt", reason="xid"))
    assert len(writes(cluster)) == before
    pj = cluster.get(*PTJ, NS, "pt")
    assert pj is not None and not pj["spec"]["runPolicy"].get("suspend")
    assert run(act.current_placement("team-a-pt")) is None


def test_an_actuator_in_another_namespace_acts_on_its_own_job_only(cluster: FakeCluster) -> None:
    """The same job name in two namespaces (stopped jobs: found by their label): the
    actuator of team-b suspends team-b's JobSet and evicts team-b's pod, nothing in train."""
    for ns in (NS, "team-b"):
        meta = {"name": "js", "namespace": ns, "labels": {"trainguard.io/job": "js"}}
        cluster.put(*JS, {"metadata": meta, "spec": {"replicatedJobs": []}})
        pod(cluster, "js-0", "gpu-a", ns=ns, labels={"trainguard.io/job": "js"})
    act = actuator(cluster, "team-b")
    result = run(act.stop_job("js", reason="x"))
    assert result.details == {"workload": "JobSet js", "evicted": ["js-0"]}
    assert cluster.get(*JS, "team-b", "js")["spec"]["suspend"] is True  # type: ignore[index]
    assert not cluster.get(*JS, NS, "js")["spec"].get("suspend")  # type: ignore[index]
    assert [p["metadata"]["name"] for p in cluster.items("", "pods", NS)] == ["js-0"]
    assert cluster.items("", "pods", "team-b") == []


# -- hostile API answers -------------------------------------------------------------------


def test_a_workload_deleted_meanwhile_is_a_clear_404_not_a_success(cluster: FakeCluster) -> None:
    master_worker(cluster, workers=1, elastic=False, policy="Never")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    pods = run(act._job_pods("pt"))
    with cluster.lock:  # deleted by its owner between list and get
        del cluster.objects[(*PTJ, NS, "pt")]
    with pytest.raises(ActuatorError, match=r'get PyTorchJob train/pt: HTTP 404 .*"pt" not found'):
        run(act._resolve("pt", pods))


def test_a_forbidden_workload_patch_names_the_verb_and_resource(cluster: FakeCluster) -> None:
    master_worker(cluster, workers=1, elastic=False, policy="Never")
    act = actuator(cluster)
    report(act, "pt", operator_pods(cluster))
    cluster.forbidden.add(("kubeflow.org", "pytorchjobs", "patch"))
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(Placement(job="pt", nodes=("gpu-a", "gpu-b"), ranks_per_node=2,
                                      generation=1), reason="x"))  # fmt: skip
    message = str(err.value)
    assert message.startswith("suspend PyTorchJob pt: HTTP 403 ")
    assert 'cannot patch resource "pytorchjobs" in API group "kubeflow.org"' in message
    assert "RBAC_RULES" in message and not err.value.retryable
    assert cluster.reconcile_pytorchjob(NS, "pt") == []  # its pods were left running


def test_a_forbidden_eviction_names_the_subresource(cluster: FakeCluster) -> None:
    jobset_gang(cluster, "js", ["gpu-a", "gpu-b"])
    cluster.instant_controller = False
    cluster.forbidden.add(("", "pods/eviction", "create"))
    act = actuator(cluster)
    with pytest.raises(ActuatorError, match=r'evict pod js-0: HTTP 403 .*"pods/eviction"'):
        run(act.stop_job("js", reason="x"))


def test_a_409_from_a_concurrent_writer_leaves_the_jobset_suspended_and_a_retry_resumes(
    cluster: FakeCluster,
) -> None:
    """The JobSet controller writes the JobSet's status right after a suspension, so the
    resize-and-resume patch (resourceVersion-guarded: it replaces ``replicatedJobs``) may
    find it changed."""
    launcher_jobset(cluster, annotate=True, max_restarts=0)
    act = actuator(cluster)
    report(act, "llm", workers(cluster))
    key = (*JS, NS, "llm")

    def controller_writes_status(c: FakeCluster, _key: Any) -> None:
        bumped = dict(c.objects[key], status={"conditions": [{"type": "Suspended",
                                                              "status": "True"}]})  # fmt: skip
        c._store(key, bumped)

    cluster.concurrent_writes[("jobset.x-k8s.io", "jobsets", "patch")] = [
        None,  # the suspend patch goes through
        controller_writes_status,  # then the controller writes before the resize patch
    ]
    new = Placement(job="llm", nodes=("gpu-b", "gpu-c"), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(new, reason="xid"))
    assert "HTTP 409" in str(err.value) and "left suspended" in str(err.value)
    assert err.value.retryable
    assert cluster.get(*JS, NS, "llm")["spec"]["suspend"] is True  # type: ignore[index]
    result = run(act.restart_job(new, reason="retry"))
    js = cluster.get(*JS, NS, "llm")
    assert js is not None and js["spec"]["suspend"] is False
    assert result.details["mode"] == "suspend-resume"
    assert js["metadata"]["annotations"]["trainguard.io/generation"] == "1"


def test_a_trainjob_whose_jobset_failed_is_not_restarted(cluster: FakeCluster) -> None:
    """Trainer has not copied the JobSet's end onto the TrainJob yet: the JobSet says it."""
    _, js = k.trainjob(cluster, "tj", 2)
    cluster.objects[(*JS, NS, "tj")]["status"] = {
        "terminalState": "Failed",
        "conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs"}],
    }
    act = actuator(cluster)
    new = Placement(job="tj", nodes=("gpu-a", "gpu-b"), ranks_per_node=1, generation=1)
    with pytest.raises(ActuatorError, match=r"job tj: TrainJob tj has finished \(Failed\)"):
        run(act.restart_job(new, reason="x"))
    assert js["metadata"]["name"] == "tj"
