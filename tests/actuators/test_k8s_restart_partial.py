"""Restarts interrupted part-way, and what the new pods get: a JobSet restarted by its own
``failurePolicy`` whose pod deletes fail (a retry finishes it, a retry after that is a
no-op), a rollback's resume-step bound that the JobSet's own restart cannot carry (it goes
the suspend/resume way), and suspend/resume restarts that fail after the suspension (the
error says the workload is left suspended and a retry resumes it)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.kubernetes import KubernetesActuator
from tests.actuators import k8s_objects as k
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, run
from tests.actuators.test_k8s_restart import trainjob
from tests.actuators.test_k8s_workloads import jobset_doc

__all__ = ["cluster"]

NODES = ("gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e", "gpu-f")
WRITES = ("patch", "delete", "create")


def actuator(c: FakeCluster) -> KubernetesActuator:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return KubernetesActuator(client.ApiClient(cfg), NS, settle_timeout_s=2, poll_interval_s=0.05)


def launch(
    c: FakeCluster, *, max_restarts: int = 3, annotations: dict[str, str] | None = None
) -> None:
    """A JobSet of four pods, one per node, restarted by its own failurePolicy."""
    for n in NODES:
        node(c, n)
    doc = jobset_doc("js", replicas=4, max_restarts=max_restarts)
    doc["metadata"]["labels"] = {"trainguard.io/job": "js"}
    template = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"] = {"labels": {"trainguard.io/job": "js"}}
    if annotations:
        template["metadata"]["annotations"] = annotations
    template["spec"]["containers"][0]["env"].append(
        {
            "name": "TRAINGUARD_GENERATION",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['trainguard.io/generation']"}
            },
        }
    )
    c.put("jobset.x-k8s.io", "jobsets", doc)
    assert c.reconcile_jobset(NS, "js") == "created"


def pods_on(c: FakeCluster) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"]["nodeName"] for p in c.items("", "pods", NS)}


def jobset(c: FakeCluster) -> dict[str, Any]:
    obj = c.get("jobset.x-k8s.io", "jobsets", NS, "js")
    assert obj is not None
    return obj


def writes(c: FakeCluster) -> int:
    return len([s for s in c.served if s[2] in WRITES])


def moved_off(c: FakeCluster, bad: list[str], gen: int, step: int | None = None) -> Placement:
    """The placement of generation ``gen``: the gang's nodes but ``bad``, plus spares."""
    used = list(pods_on(c).values())
    keep = [n for n in used if n not in bad]
    spare = [n for n in NODES if n not in used][: len(bad)]
    return Placement(
        job="js", nodes=tuple(keep + spare), ranks_per_node=1, generation=gen, resume_step=step
    )


def test_a_failed_pod_delete_is_finished_by_the_retry_and_a_retry_after_is_a_no_op(
    cluster: FakeCluster,
) -> None:
    launch(cluster)
    act = actuator(cluster)
    bad_pod, bad = sorted(pods_on(cluster).items())[0]
    run(act.isolate_node(bad, reason="xid 79"))
    new = moved_off(cluster, [bad], gen=1)
    cluster.faults[("", "pods", "delete")] = 0
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(new, reason="xid 79"))
    assert err.value.retryable
    assert "half done: generation recorded" in str(err.value)
    assert "deleted [] of 1 pod(s)" in str(err.value)
    assert "a retry of the restart finishes it" in str(err.value)
    assert bad_pod in pods_on(cluster)  # the old gang still runs on the bad node
    del cluster.faults[("", "pods", "delete")]
    result = run(act.restart_job(new, reason="retry"))
    assert result.details["finished"] and result.details["deleted"] == [bad_pod]
    assert "finished the interrupted restart" in result.outcome
    assert "trainguard.io/restart-pending" not in jobset(cluster)["metadata"]["annotations"]
    assert cluster.reconcile_jobset(NS, "js") == "restarted"
    assert bad not in pods_on(cluster).values()
    assert jobset(cluster)["status"]["restarts"] == 1
    before = writes(cluster)
    again = run(act.restart_job(new, reason="retry again"))
    assert again.details["already"] and writes(cluster) == before


def test_a_retry_after_the_jobset_restarted_deletes_nothing_more(cluster: FakeCluster) -> None:
    launch(cluster)
    act = actuator(cluster)
    (first, a), (_, b) = sorted(pods_on(cluster).items())[:2]
    new = moved_off(cluster, [a, b], gen=1)
    cluster.faults[("", "pods", "delete")] = 1  # the first delete goes through
    with pytest.raises(ActuatorError, match=r"deleted \['" + first + r"'\] of 2 pod\(s\)"):
        run(act.restart_job(new, reason="two bad nodes"))
    del cluster.faults[("", "pods", "delete")]
    # The deleted pod failed its child Job: the JobSet restarted the whole gang.
    assert cluster.reconcile_jobset(NS, "js") == "restarted"
    deletes = len([s for s in cluster.served if s == ("", "pods", "delete")])
    result = run(act.restart_job(new, reason="retry"))
    assert result.details["deleted"] == [] and result.details["restarts_used"] == 1
    assert "already restarted the gang" in result.outcome
    assert len([s for s in cluster.served if s == ("", "pods", "delete")]) == deletes
    cluster.reconcile_jobset(NS, "js")
    assert jobset(cluster)["status"]["restarts"] == 1  # one restart, not two
    before = writes(cluster)
    assert run(act.restart_job(new, reason="again")).details["already"]
    assert writes(cluster) == before


def test_a_forbidden_pod_delete_is_finished_once_rbac_is_fixed(cluster: FakeCluster) -> None:
    launch(cluster)
    act = actuator(cluster)
    bad_pod, bad = sorted(pods_on(cluster).items())[0]
    new = moved_off(cluster, [bad], gen=1)
    cluster.forbidden.add(("", "pods", "delete"))
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(new, reason="xid"))
    assert not err.value.retryable and "a retry of the restart finishes it" in str(err.value)
    cluster.forbidden.discard(("", "pods", "delete"))
    result = run(act.restart_job(new, reason="rbac fixed"))
    assert result.details["deleted"] == [bad_pod]
    assert cluster.reconcile_jobset(NS, "js") == "restarted"


def test_a_jobsets_own_restart_says_its_pods_do_not_get_the_generation(
    cluster: FakeCluster,
) -> None:
    launch(cluster)
    act = actuator(cluster)
    bad = sorted(pods_on(cluster).values())[0]
    result = run(act.restart_job(moved_off(cluster, [bad], gen=1), reason="xid"))
    assert result.details["mode"] == "fail-child-jobs"
    # The template maps TRAINGUARD_GENERATION, but from an annotation nobody changed.
    assert result.details["env_wired"] is False and result.details["template_written"] is False
    assert "the new pods do not get trainguard.io/generation=1" in result.outcome


def test_a_rollback_of_a_jobset_goes_through_suspend_and_resume(cluster: FakeCluster) -> None:
    launch(cluster)
    act = actuator(cluster)
    bad = sorted(pods_on(cluster).values())[0]
    result = run(act.restart_job(moved_off(cluster, [bad], gen=1, step=30), reason="nan"))
    assert result.details["mode"] == "suspend-resume"
    assert result.details["template_written"] and result.details["resume_step_carried"]
    assert "trainguard.io/resume-step=30" in result.outcome
    obj = jobset(cluster)
    template = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "trainguard.io/generation": "1",
        "trainguard.io/resume-step": "30",
    }
    assert obj["spec"]["suspend"] is False
    assert not (obj.get("status") or {}).get("restarts")  # no failurePolicy restart spent


def test_an_inherited_resume_step_is_removed_not_kept_by_the_jobsets_restart(
    cluster: FakeCluster,
) -> None:
    launch(cluster, annotations={"trainguard.io/resume-step": "30"})
    act = actuator(cluster)
    bad = sorted(pods_on(cluster).values())[0]
    result = run(act.restart_job(moved_off(cluster, [bad], gen=1), reason="xid"))
    assert result.details["mode"] == "suspend-resume"
    template = jobset(cluster)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert "trainguard.io/resume-step" not in template["metadata"]["annotations"]


def test_a_trainjob_rollback_says_its_pods_do_not_get_the_bound(cluster: FakeCluster) -> None:
    trainjob(cluster, max_restarts=2)
    act = actuator(cluster)
    new = Placement(job="tj", nodes=("gpu-b", "gpu-c"), ranks_per_node=1, generation=1,
                    resume_step=30)  # fmt: skip
    result = run(act.restart_job(new, reason="nan"))
    assert result.details["resume_step_carried"] is False
    assert result.details["env_wired"] is False
    assert "not from the rollback bound step 30" in result.outcome


def test_a_jobset_resume_that_fails_says_it_is_left_suspended(cluster: FakeCluster) -> None:
    launch(cluster, max_restarts=0)  # it never restarts itself: suspend/resume
    act = actuator(cluster)
    new = moved_off(cluster, [], gen=1)
    cluster.faults[("jobset.x-k8s.io", "jobsets", "patch")] = 1  # the suspend goes through
    with pytest.raises(ActuatorError) as err:
        run(act.restart_job(new, reason="hang"))
    assert err.value.retryable
    assert "left suspended" in str(err.value)
    assert "a retry of the restart resumes it" in str(err.value)
    assert jobset(cluster)["spec"]["suspend"] is True
    del cluster.faults[("jobset.x-k8s.io", "jobsets", "patch")]
    run(act.restart_job(new, reason="retry"))
    assert jobset(cluster)["spec"]["suspend"] is False


def test_an_indexed_job_eviction_refused_says_it_is_left_suspended(cluster: FakeCluster) -> None:
    job = k.indexed_job(cluster, "ix", 4)
    k.pods(cluster, "ix", job, ["gpu-a", "gpu-b"], 2)
    cluster.forbidden.add(("", "pods/eviction", "create"))
    new = Placement(job="ix", nodes=("gpu-a", "gpu-b"), ranks_per_node=2, generation=1)
    with pytest.raises(ActuatorError) as err:
        run(actuator(cluster).restart_job(new, reason="x"))
    assert not err.value.retryable
    assert "left suspended" in str(err.value) and "forbidden" in str(err.value)
    obj = cluster.get("batch", "jobs", NS, "ix")
    assert obj is not None and obj["spec"]["suspend"] is True
