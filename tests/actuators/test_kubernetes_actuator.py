"""The Kubernetes actuator against a stateful fake API server, through the real client."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.kubernetes import (
    ANN_GENERATION,
    ANN_ISOLATED,
    ANN_RESUME_STEP,
    RBAC_RULES,
    TAINT_KEY,
    KubernetesActuator,
    rbac_rules_yaml,
)
from tests.actuators import k8s_objects as k
from tests.actuators.fake_cluster import FakeCluster as FakeKube

NS = k.NS
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube.running() as server:
        yield server


def make_actuator(kube: FakeKube, **options: Any) -> KubernetesActuator:
    cfg = client.Configuration(host=kube.url)
    cfg.retries = 0
    options.setdefault("settle_timeout_s", 2.0)
    options.setdefault("poll_interval_s", 0.05)
    return KubernetesActuator(client.ApiClient(cfg), NS, **options)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def act(kube: FakeKube) -> Iterator[KubernetesActuator]:
    actuator = make_actuator(kube)
    yield actuator
    run(actuator.close())


def node_obj(kube: FakeKube, name: str) -> dict[str, Any]:
    obj = kube.get("", "nodes", "", name)
    assert obj is not None
    return obj


def events(kube: FakeKube) -> list[dict[str, Any]]:
    return kube.items("", "events")


def patches(kube: FakeKube) -> list[tuple[str, str, str]]:
    return [s for s in kube.served if s[2] == "patch"]


# -- nodes ---------------------------------------------------------------------------------


def test_isolate_cordons_taints_annotates_emits_event_and_is_idempotent(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    other = {"key": "gpu.example/maintenance", "value": "soon", "effect": "PreferNoSchedule"}
    k.node(kube, "gpu-1", taints=[other])

    result = run(act.isolate_node("gpu-1", reason="XID 79 on GPU 3"))

    taint = {"key": TAINT_KEY, "value": "XID-79-on-GPU-3", "effect": "NoSchedule"}
    assert result.outcome == f"node gpu-1 cordoned, tainted {TAINT_KEY}=XID-79-on-GPU-3:NoSchedule"
    node = node_obj(kube, "gpu-1")
    assert node["spec"]["unschedulable"] is True
    assert other in node["spec"]["taints"]
    assert taint in node["spec"]["taints"]
    (condition,) = [c for c in node["status"]["conditions"] if c["type"] == "TrainguardHealthy"]
    assert condition["status"] == "False" and condition["reason"] == "XID79OnGPU3"
    record = json.loads(node["metadata"]["annotations"][ANN_ISOLATED])
    assert record["reason"] == "XID 79 on GPU 3" and record["cordoned"] and record["tainted"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["at"])
    (event,) = events(kube)
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == "gpu-1"
    assert event["type"] == "Warning" and event["reason"] == "TrainguardQuarantined"
    assert event["reportingComponent"] == "trainguard" and "XID 79" in event["message"]

    version = node["metadata"]["resourceVersion"]
    again = run(act.isolate_node("gpu-1", reason="XID 79 again"))
    assert again.outcome == "node gpu-1 already quarantined" and again.details["already"]
    assert node_obj(kube, "gpu-1")["metadata"]["resourceVersion"] == version
    assert len(events(kube)) == 1


def test_release_undoes_only_what_trainguard_added(kube: FakeKube, act: KubernetesActuator) -> None:
    theirs = {"key": "ops/drain", "effect": "NoSchedule"}
    k.node(kube, "cordoned-by-ops", unschedulable=True, taints=[theirs])
    k.node(kube, "fresh")
    for name in ("cordoned-by-ops", "fresh"):
        run(act.isolate_node(name, reason="straggler"))

    for name in ("cordoned-by-ops", "fresh"):
        result = run(act.release_node(name, reason="repaired"))
        assert result.outcome == f"node {name} released"
        node = node_obj(kube, name)
        assert ANN_ISOLATED not in node["metadata"].get("annotations", {})
        assert all(t["key"] != TAINT_KEY for t in node["spec"].get("taints", []))
    # Ops cordoned and tainted it before trainguard came: both stay.
    ops = node_obj(kube, "cordoned-by-ops")
    assert ops["spec"]["unschedulable"] is True and ops["spec"]["taints"] == [theirs]
    assert not node_obj(kube, "fresh")["spec"].get("unschedulable")
    assert [e["reason"] for e in events(kube)].count("TrainguardReleased") == 2

    again = run(act.release_node("fresh", reason="repaired"))
    assert again.details["already"] and "not cordoned by trainguard" in again.outcome


def test_isolate_retries_on_a_concurrent_node_update(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    k.node(kube, "busy")
    original = kube._patch
    calls = {"n": 0}

    def racing_patch(key: Any, body: Any, ctype: str) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:  # someone else labels the node between our read and our write
            obj = kube.objects[key]
            obj["metadata"]["labels"] = {"new": "label"}
            obj["metadata"]["resourceVersion"] = kube._next_rv()
        return original(key, body, ctype)

    kube._patch = racing_patch  # type: ignore[method-assign]
    run(act.isolate_node("busy", reason="hang"))
    node = node_obj(kube, "busy")
    assert calls["n"] == 2 and node["metadata"]["labels"] == {"new": "label"}
    assert node["spec"]["unschedulable"] is True


# -- stop ----------------------------------------------------------------------------------


def test_stop_suspends_the_job_and_evicts_its_pods_deleting_when_a_pdb_refuses(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    kube.instant_controller = False  # the Job controller has not reacted yet
    job = k.indexed_job(kube, "llm", 4)
    names = k.pods(kube, "llm", job, ["n1", "n2"], 2)
    kube.pdb_blocked.add(names[3])

    result = run(act.stop_job("llm", reason="fatal XID on n2"))

    assert kube.get("batch", "jobs", NS, "llm")["spec"]["suspend"] is True  # type: ignore[index]
    assert result.details["evicted"] == names[:3]
    assert result.details["deleted_despite_pdb"] == [names[3]]
    assert kube.items("", "pods") == []
    assert ("", "pods/eviction", "create") in kube.served and ("", "pods", "delete") in kube.served
    (event,) = events(kube)
    assert event["involvedObject"]["kind"] == "Job" and event["reason"] == "JobStopped"
    assert event["metadata"]["namespace"] == NS

    again = run(act.stop_job("llm", reason="again"))
    assert again.details["already"] and "already stopped" in again.outcome


def test_stop_can_leave_pdb_protected_pods_running(kube: FakeKube) -> None:
    act = make_actuator(kube, delete_on_pdb_block=False)
    kube.instant_controller = False
    owner = k.pytorchjob(kube, "pt", 1)
    names = k.pods(kube, "pt", owner, ["n1"], 2)
    kube.pdb_blocked.add(names[0])

    result = run(act.stop_job("pt", reason="hang"))

    assert result.details["blocked_by_pdb"] == [names[0]]
    assert "kept by a PodDisruptionBudget" in result.outcome
    assert [p["metadata"]["name"] for p in kube.items("", "pods")] == [names[0]]
    pt = kube.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert pt is not None and pt["spec"]["runPolicy"]["suspend"] is True


# -- restart -------------------------------------------------------------------------------


def placement(
    job: str, nodes: tuple[str, ...], per_node: int, gen: int, step: int | None = 40
) -> Placement:
    return Placement(
        job=job, nodes=nodes, ranks_per_node=per_node, generation=gen, resume_step=step
    )


def test_restart_indexed_job_smaller_then_same_generation_is_a_no_op(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    job = k.indexed_job(kube, "llm", 4)
    k.pods(kube, "llm", job, ["n1", "n2"], 2)

    result = run(act.restart_job(placement("llm", ("n1",), 2, gen=1), reason="n2 isolated"))

    obj = kube.get("batch", "jobs", NS, "llm")
    assert obj is not None
    assert (obj["spec"]["parallelism"], obj["spec"]["completions"]) == (2, 2)
    assert obj["spec"]["suspend"] is False
    assert obj["spec"]["template"]["metadata"]["annotations"] == {
        ANN_GENERATION: "1",
        ANN_RESUME_STEP: "40",
    }
    assert obj["metadata"]["annotations"][ANN_GENERATION] == "1"
    assert kube.items("", "pods") == []
    assert result.details["previous_world_size"] == 4 and result.details["env_wired"]
    assert "generation 1 with 2 ranks" in result.outcome
    assert events(kube)[-1]["reason"] == "JobRestarted"

    served = len(patches(kube))
    again = run(act.restart_job(placement("llm", ("n1",), 2, gen=1), reason="retry"))
    assert again.details["already"] and len(patches(kube)) == served
    # A newer generation without a resume step removes the old step annotation.
    run(act.restart_job(placement("llm", ("n1",), 2, gen=2, step=None), reason="again"))
    obj = kube.get("batch", "jobs", NS, "llm")
    assert obj is not None
    assert obj["spec"]["template"]["metadata"]["annotations"] == {ANN_GENERATION: "2"}


def test_restart_waits_for_the_job_controller_then_says_retry(kube: FakeKube) -> None:
    act = make_actuator(kube, settle_timeout_s=0.3)
    kube.instant_controller = False  # the suspended Job keeps status.startTime
    k.indexed_job(kube, "slow", 2)

    with pytest.raises(ActuatorError, match="still has 2 active pod") as err:
        run(act.restart_job(placement("slow", ("n1",), 1, gen=1), reason="x"))
    assert err.value.retryable


def test_restart_non_indexed_job_cannot_resize(kube: FakeKube, act: KubernetesActuator) -> None:
    job = k.indexed_job(kube, "plain", 2)
    kube.objects[("batch", "jobs", NS, "plain")]["spec"].pop("completionMode")
    k.pods(kube, "plain", job, ["n1"], 2)
    with pytest.raises(ActuatorError, match="not an Indexed Job"):
        run(act.restart_job(placement("plain", ("n1",), 1, gen=1), reason="x"))


def test_restart_pytorchjob_shrinks_workers_and_deletes_old_pods(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    owner = k.pytorchjob(kube, "pt", 3, restart_policy="OnFailure")
    k.pods(kube, "pt", owner, ["n1", "n2"], 2)

    result = run(act.restart_job(placement("pt", ("n1",), 2, gen=1), reason="n2 bad"))

    obj = kube.get("kubeflow.org", "pytorchjobs", NS, "pt")
    assert obj is not None
    specs = obj["spec"]["pytorchReplicaSpecs"]
    assert specs["Worker"]["replicas"] == 1 and specs["Master"]["replicas"] == 1
    for role in ("Worker", "Master"):
        assert specs[role]["template"]["metadata"]["annotations"][ANN_GENERATION] == "1"
    assert obj["metadata"]["annotations"][ANN_GENERATION] == "1"
    assert kube.items("", "pods") == []
    assert len(result.details["evicted"]) == 4 and result.details["previous_world_size"] == 4
    assert result.details["mode"] == "delete-pods"
    resize = "shrunk from 4 to 2 pod(s) (the job declares no elastic range)"
    assert result.details["resize"] == resize
    assert result.details["resize"] in result.outcome


def test_restart_pytorchjob_keeps_pods_already_at_the_new_generation(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    owner = k.pytorchjob(kube, "pt", 1, restart_policy="OnFailure")
    k.pods(kube, "pt", owner, ["n1"], 2, annotations={ANN_GENERATION: "3"})
    run(act.restart_job(placement("pt", ("n1",), 2, gen=3), reason="retry after a crash"))
    assert len(kube.items("", "pods")) == 2


def test_restart_jobset_shrinks_replicas_and_resumes(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    owner = k.jobset(kube, "js", 4)
    children = [k.child_job(kube, owner, f"js-workers-{i}") for i in range(4)]
    k.pods(kube, "js", children, ["n1", "n2", "n3", "n4"], 1)

    result = run(act.restart_job(placement("js", ("n1", "n2"), 1, gen=1), reason="n3 bad"))

    obj = kube.get("jobset.x-k8s.io", "jobsets", NS, "js")
    assert obj is not None
    (rj,) = obj["spec"]["replicatedJobs"]
    assert rj["replicas"] == 2 and obj["spec"]["suspend"] is False
    annotations = rj["template"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {ANN_GENERATION: "1", ANN_RESUME_STEP: "40"}
    assert obj["metadata"]["annotations"][ANN_GENERATION] == "1"
    assert kube.items("", "pods") == []  # suspension removed them
    assert result.details["workload"] == "JobSet js"
    # The next restart is no rollback: a bound left from this one would hold the ranks
    # to a checkpoint that retention may delete meanwhile. The annotation goes.
    run(act.restart_job(placement("js", ("n1", "n2"), 1, gen=2, step=None), reason="hang"))
    obj = kube.get("jobset.x-k8s.io", "jobsets", NS, "js")
    assert obj is not None
    template = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {ANN_GENERATION: "2"}


def test_restart_after_stop_finds_the_workload_by_its_label(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    owner = k.jobset(kube, "js", 1, per_job=4)
    child = k.child_job(kube, owner, "js-workers-0")
    k.pods(kube, "js", child, ["n1", "n2"], 2)
    run(act.stop_job("js", reason="hang"))
    assert kube.items("", "pods") == []

    run(act.restart_job(placement("js", ("n1",), 2, gen=1), reason="resume"))

    obj = kube.get("jobset.x-k8s.io", "jobsets", NS, "js")
    assert obj is not None
    job_spec = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"]) == (2, 2)
    assert ("jobset.x-k8s.io", "jobsets", "list") in kube.served


# -- queries -------------------------------------------------------------------------------


def test_candidate_nodes_follow_the_node_selector_and_skip_foreign_cordons(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    pool = {"pool": "h100"}
    k.node(kube, "a1", labels=pool)
    k.node(kube, "a2", labels=pool, unschedulable=True)  # cordoned by ops
    k.node(kube, "a3", labels=pool)
    k.node(kube, "b1", labels={"pool": "cpu"})
    kube.put(
        "batch",
        "jobs",
        {
            "metadata": k.meta("sel", "sel"),
            "spec": {
                "parallelism": 2,
                "completions": 2,
                "completionMode": "Indexed",
                "template": k.pod_template("sel", selector=pool),
            },
        },
    )
    run(act.isolate_node("a3", reason="bad GPU"))

    assert run(act.candidate_nodes("sel")) == ["a1", "a3"]


def test_current_placement_reads_running_pods(kube: FakeKube, act: KubernetesActuator) -> None:
    assert run(act.current_placement("none")) is None
    job = k.indexed_job(kube, "llm", 4)
    k.pods(
        kube,
        "llm",
        job,
        ["n2", "n1"],
        2,
        labels={"trainguard.io/tp": "2"},
        annotations={ANN_GENERATION: "3", ANN_RESUME_STEP: "120"},
    )
    k.pods(kube, "pending", job, ["n3"], 1, phase="Pending")

    got = run(act.current_placement("llm"))

    assert got == Placement(
        job="llm", nodes=("n2", "n1"), ranks_per_node=2, tp=2, generation=3, resume_step=120
    )
    assert run(act.current_placement("pending")) is None


def test_current_placement_refuses_uneven_ranks(kube: FakeKube, act: KubernetesActuator) -> None:
    job = k.indexed_job(kube, "odd", 3)
    k.pods(kube, "odd", job, ["n1", "n2", "n2"], 1)
    kube.objects[("", "pods", NS, "odd-2")]["spec"]["nodeName"] = "n2"
    with pytest.raises(ActuatorError, match="uneven number of ranks per node"):
        run(act.current_placement("odd"))


def test_record_event_targets_nodes_and_jobs(kube: FakeKube, act: KubernetesActuator) -> None:
    k.node(kube, "gpu-9")
    owner = k.pytorchjob(kube, "pt", 1)
    k.pods(kube, "pt", owner, ["gpu-9"], 2)
    run(act.record_event(target="gpu-9", reason="Straggler", message="slow", warning=True))
    run(act.record_event(target="job/pt", reason="Checkpoint", message="saved step 10"))
    got = [
        (e["involvedObject"]["kind"], e["metadata"]["namespace"], e["type"]) for e in events(kube)
    ]
    assert sorted(got) == [("Node", "default", "Warning"), ("PyTorchJob", NS, "Normal")]
    with pytest.raises(ActuatorError, match="HTTP 404"):
        run(act.record_event(target="node/ghost", reason="X", message="y"))


# -- errors --------------------------------------------------------------------------------


def test_missing_workload_is_a_clear_error(kube: FakeKube, act: KubernetesActuator) -> None:
    kube.crd_groups.clear()  # no JobSet/PyTorchJob CRDs installed: their lists answer 404
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(placement("ghost", ("n1",), 1, gen=1), reason="x"))
    assert str(err.value) == (
        "job 'ghost' not found in namespace train: no pods, and no Job/JobSet/PyTorchJob/TrainJob "
        "labelled trainguard.io/job=ghost"
    )
    assert not err.value.retryable


def test_bare_pods_of_a_job_say_so_in_the_not_found_error(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    kube.crd_groups.clear()
    for rank in range(2):
        metadata = {
            "name": f"bare-{rank}",
            "namespace": NS,
            "labels": {"trainguard.io/job": "bare"},
        }
        pod = {"metadata": metadata, "spec": {"nodeName": "n1", "containers": []}}
        kube.put("", "pods", pod | {"status": {"phase": "Running"}})
    with pytest.raises(ActuatorError, match="2 pod\\(s\\) but none owned by a workload"):
        run(act.restart_job(placement("bare", ("n1",), 2, gen=1), reason="x"))


def test_forbidden_call_names_the_missing_permission(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    k.node(kube, "gpu-1")
    kube.forbidden.add(("", "nodes", "patch"))
    with pytest.raises(ActuatorError) as err:
        run(act.isolate_node("gpu-1", reason="x"))
    message = str(err.value)
    assert message.startswith("quarantine node gpu-1: HTTP 403 ")
    assert 'cannot patch resource "nodes"' in message and "RBAC_RULES" in message
    assert not err.value.retryable


def test_a_dropped_workload_rule_does_not_break_finding_the_others(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    """A site that runs no TrainJobs or PyTorchJobs drops their rules (403 on their lists):
    a stopped JobSet is still found by its label."""
    kube.forbidden |= {
        ("trainer.kubeflow.org", "trainjobs", "list"),
        ("kubeflow.org", "pytorchjobs", "list"),
    }
    k.jobset(kube, "js", 1)
    result = run(act.restart_job(placement("js", ("n1",), 1, gen=1), reason="resume"))
    assert result.details["workload"] == "JobSet js"
    kube.forbidden.add(("batch", "jobs", "list"))  # the built-in kind's rule is never optional
    with pytest.raises(ActuatorError, match="HTTP 403"):
        run(act.restart_job(placement("js", ("n1",), 1, gen=2), reason="x"))


def test_unsupported_owner_is_refused(kube: FakeKube, act: KubernetesActuator) -> None:
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "rs", "uid": "u"}}
    k.pods(kube, "rs", owner, ["n1"], 1)
    with pytest.raises(ActuatorError, match="owned by ReplicaSet rs"):
        run(act.stop_job("rs", reason="x"))


# -- RBAC and docs -------------------------------------------------------------------------


def _allowed(group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
        for r in RBAC_RULES
    )


def test_every_api_call_is_covered_by_rbac_rules_and_every_rule_is_used(
    kube: FakeKube, act: KubernetesActuator
) -> None:
    kube.instant_controller = False
    k.node(kube, "n1", labels={"pool": "a"})
    job = k.indexed_job(kube, "j", 2)
    k.pods(kube, "j", job, ["n1"], 2)
    run(act.isolate_node("n1", reason="x"))
    run(act.candidate_nodes("j"))
    run(act.current_placement("j"))
    kube.pdb_blocked.add("j-0")
    run(act.stop_job("j", reason="x"))
    kube.objects[("batch", "jobs", NS, "j")]["status"] = {}
    run(act.restart_job(placement("j", ("n1",), 1, gen=1), reason="x"))
    run(act.release_node("n1", reason="x"))
    run(act.drain_node("n1", reason="x"))
    owner = k.jobset(kube, "js", 1)
    k.pods(kube, "js", k.child_job(kube, owner, "js-workers-0"), ["n1"], 1)
    k.pods(kube, "pt", k.pytorchjob(kube, "pt", 1, master=False), ["n1"], 1)
    _, tjs = k.trainjob(kube, "tj", 1)
    k.pods(kube, "tj", k.child_job(kube, tjs, "tj-node-0"), ["n1"], 1)
    for name in ("js", "pt", "tj"):
        run(act.restart_job(placement(name, ("n1",), 1, gen=1), reason="x"))
    with pytest.raises(ActuatorError, match="not found"):  # lists every workload kind
        run(act.restart_job(placement("ghost", ("n1",), 1, gen=1), reason="x"))

    served = set(kube.served)
    assert [s for s in served if not _allowed(*s)] == []
    granted = {
        (g, r, v)
        for rule in RBAC_RULES
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert sorted(granted - served) == []


def test_docs_show_the_rbac_rules_verbatim() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"```yaml\n{rbac_rules_yaml()}```" in doc


def test_from_environment_uses_kubeconfig_outside_a_pod(
    kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "me", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
        "current-context": "fake",
    }
    path = tmp_path / "config"
    path.write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(path))
    k.node(kube, "gpu-1")
    act = KubernetesActuator.from_environment(NS)
    run(act.isolate_node("gpu-1", reason="x"))
    run(act.close())
    assert node_obj(kube, "gpu-1")["spec"]["unschedulable"] is True

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ActuatorError, match="no Kubernetes credentials"):
        KubernetesActuator.from_environment(NS)
