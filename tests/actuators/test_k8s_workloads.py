"""Gang restarts the workload's own way, through the official client and the fake cluster's
Job/JobSet controllers and scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.workloads import (
    JobPolicy,
    elastic_bounds,
    job_policy,
    plan_gang_restart,
)
from tests.actuators.k8s_testkit import NS, cluster, round_trip

__all__ = ["cluster"]


def jobset_doc(name: str, *, replicas: int, max_restarts: int, nnodes: str = "2") -> dict[str, Any]:
    """A JobSet as docs/kubernetes.md shows it: one pod per node, torchrun x2 ranks each."""
    container = {
        "name": "trainer",
        "image": "ghcr.io/example/trainer:1",
        "command": ["torchrun", f"--nnodes={nnodes}", "--nproc-per-node=2", "train.py"],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": replicas,
                    "template": {
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            "backoffLimit": 0,
                            "template": {
                                "spec": {"restartPolicy": "Never", "containers": [container]}
                            },
                        }
                    },
                }
            ],
        },
    }


def test_a_jobset_restarts_through_its_failure_policy_until_its_restarts_are_used() -> None:
    """The restart itself (pods deleted, the JobSet's controller restarting the gang off
    the bad node) is tested through the actuator in test_k8s_actuator_integration.py."""
    js = jobset_doc("llm", replicas=2, max_restarts=1)
    round_trip(js)
    plan = plan_gang_restart("JobSet", js, current_nodes=2, healthy_nodes=2)
    assert plan.mode == "fail-child-jobs" and not plan.shrunk
    # maxRestarts used up: trainguard does not fail the JobSet for good; a human decides.
    js["status"] = {"restarts": 1}
    refused = plan_gang_restart("JobSet", js, current_nodes=2, healthy_nodes=2)
    assert refused.mode == "refuse" and "used 1 of 1 restarts" in refused.note


def test_shrink_only_within_the_jobs_elastic_range() -> None:
    fixed = jobset_doc("fixed", replicas=4, max_restarts=3)
    plan = plan_gang_restart("JobSet", fixed, current_nodes=4, healthy_nodes=3)
    assert plan.mode == "refuse" and "declares no elastic range" in plan.note
    elastic = jobset_doc("elastic", replicas=4, max_restarts=3, nnodes="2:4")
    assert elastic_bounds("JobSet", elastic) is not None
    plan = plan_gang_restart("JobSet", elastic, current_nodes=4, healthy_nodes=3)
    assert (plan.mode, plan.nodes, plan.shrunk) == ("suspend-resume", 3, True)
    assert plan.note == "shrunk from 4 to 3 node(s) within torchrun --nnodes=2:4"
    assert plan_gang_restart("JobSet", elastic, current_nodes=4, healthy_nodes=1).mode == "refuse"
    ptj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "p", "namespace": NS},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "elasticPolicy": {"minReplicas": 2, "maxReplicas": 4},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 4,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "t:1"}]}},
                }
            },
        },
    }
    round_trip(ptj)
    assert (
        plan_gang_restart("PyTorchJob", ptj, current_nodes=4, healthy_nodes=4).mode == "delete-pods"
    )
    assert plan_gang_restart("PyTorchJob", ptj, current_nodes=4, healthy_nodes=2).nodes == 2
    ptj["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Never"
    assert (
        plan_gang_restart("PyTorchJob", ptj, current_nodes=4, healthy_nodes=4).mode
        == "suspend-resume"
    )
    job = {"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {}}}
    assert plan_gang_restart("Job", job, current_nodes=2, healthy_nodes=2).mode == "suspend-resume"


def test_backoff_limit_above_zero_is_never_a_half_restart() -> None:
    doc = jobset_doc("js", replicas=2, max_restarts=3)
    doc["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 3
    plan = plan_gang_restart("JobSet", doc, current_nodes=2, healthy_nodes=2)
    assert plan.mode == "suspend-resume" and "replaced alone" in plan.note


def test_per_job_policy_annotation() -> None:
    def w(raw: str) -> dict[str, Any]:
        return {"metadata": {"name": "js", "annotations": {"trainguard.io/policy": raw}}}

    assert job_policy({"metadata": {"name": "x"}}) == JobPolicy()
    got = job_policy(w('{"steps": ["isolate", "webhook"], "dry_run": true, "max_restarts": 0}'))
    assert got == JobPolicy(("isolate", "webhook"), True, 0)
    for bad, msg in [("{", "not JSON"), ('{"stepz": []}', "expected an object"),
                     ('{"max_restarts": -1}', "max_restarts"), ('{"steps": "x"}', "steps"),
                     ('{"dry_run": "yes"}', "dry_run")]:  # fmt: skip
        with pytest.raises(ActuatorError, match=msg):
            job_policy(w(bad))
    doc = jobset_doc("js", replicas=2, max_restarts=5)
    doc["status"] = {"restarts": 1}
    plan = plan_gang_restart(
        "JobSet", doc, current_nodes=2, healthy_nodes=2, policy=JobPolicy(max_restarts=1)
    )
    assert plan.mode == "refuse" and "used 1 of 1 restarts its trainguard.io/policy" in plan.note
    never = jobset_doc("never", replicas=2, max_restarts=0)
    plan = plan_gang_restart("JobSet", never, current_nodes=2, healthy_nodes=2)
    assert plan.mode == "suspend-resume" and "maxRestarts is 0" in plan.note


def test_policy_max_restarts_without_a_restart_counter_caps_trainguards_restarts() -> None:
    """A PyTorchJob or Job keeps no restart count (a JobSet's status.restarts): the policy's
    max_restarts caps the restarts trainguard recorded, refused in the plan like a JobSet's."""
    ptj = {
        "kind": "PyTorchJob",
        "metadata": {"name": "pt"},
        "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "OnFailure"}}},
    }
    job = {"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {}}}
    cap = JobPolicy(max_restarts=2)
    for kind, doc, mode in [("PyTorchJob", ptj, "delete-pods"), ("Job", job, "suspend-resume")]:
        under = plan_gang_restart(
            kind, doc, current_nodes=2, healthy_nodes=2, policy=cap, recorded_restarts=1
        )
        assert under.mode == mode
        at = plan_gang_restart(
            kind, doc, current_nodes=2, healthy_nodes=2, policy=cap, recorded_restarts=2
        )
        assert at.mode == "refuse"
        assert (
            at.note
            == "trainguard has restarted it 2 time(s), the 2 its trainguard.io/policy allows"
        )
        unbounded = plan_gang_restart(
            kind, doc, current_nodes=2, healthy_nodes=2, recorded_restarts=9
        )
        assert unbounded.mode == mode
    # A JobSet counts its own restarts: trainguard's record does not stand in for them.
    js = jobset_doc("js", replicas=2, max_restarts=5)
    plan = plan_gang_restart(
        "JobSet", js, current_nodes=2, healthy_nodes=2, policy=cap, recorded_restarts=2
    )
    assert plan.mode == "fail-child-jobs"


def test_docs_show_the_tested_jobset() -> None:
    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    shown = jobset_doc("llm", replicas=2, max_restarts=3, nnodes="1:2")
    assert f"```yaml\n{yaml.safe_dump(shown, sort_keys=False)}```" in doc
    round_trip(shown)
    plan = plan_gang_restart("JobSet", shown, current_nodes=2, healthy_nodes=1)
    assert plan.note == "shrunk from 2 to 1 node(s) within torchrun --nnodes=1:2"
