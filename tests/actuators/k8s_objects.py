"""Builders for the Kubernetes objects the actuator tests put into the fake API server.

They follow the label contract in docs/kubernetes.md: pods carry ``trainguard.io/job`` and
``trainguard.io/rank``, their controlling ownerReference leads to the workload, and the
workload carries ``trainguard.io/job`` too.
"""

from __future__ import annotations

from typing import Any

from tests.actuators.fake_kube import FakeKube

NS = "train"
DOWNWARD_ENV = [
    {
        "name": "TRAINGUARD_GENERATION",
        "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.annotations['trainguard.io/generation']"}
        },
    },
    {
        "name": "TRAINGUARD_RESUME_STEP",
        "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.annotations['trainguard.io/resume-step']"}
        },
    },
]


def node(kube: FakeKube, name: str, *, labels: dict[str, str] | None = None, **spec: Any) -> None:
    kube.put("", "nodes", {"metadata": {"name": name, "labels": labels or {}}, "spec": spec})


def pod_template(job: str, *, env: bool = True, selector: dict[str, str] | None = None) -> Any:
    container: dict[str, Any] = {"name": "trainer", "image": "trainer:1"}
    if env:
        container["env"] = DOWNWARD_ENV
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Never"}
    if selector:
        spec["nodeSelector"] = selector
    return {"metadata": {"labels": {"trainguard.io/job": job}}, "spec": spec}


def meta(name: str, job: str) -> dict[str, Any]:
    return {"name": name, "namespace": NS, "labels": {"trainguard.io/job": job}}


def indexed_job(kube: FakeKube, job: str, world: int, **kw: Any) -> dict[str, Any]:
    spec = {
        "parallelism": world,
        "completions": world,
        "completionMode": "Indexed",
        "template": pod_template(job, **kw),
    }
    return kube.put(
        "batch",
        "jobs",
        {
            "metadata": meta(job, job),
            "spec": spec,
            "status": {"active": world, "startTime": "2025-01-01T00:00:00Z"},
        },
    )


def pytorchjob(
    kube: FakeKube,
    job: str,
    workers: int,
    *,
    master: bool = True,
    restart_policy: str | None = None,
) -> dict[str, Any]:
    """``restart_policy``: every replica's (absent: the operator's default, ``Never``)."""
    policy = {"restartPolicy": restart_policy} if restart_policy else {}
    specs: dict[str, Any] = {
        "Worker": {"replicas": workers, "template": pod_template(job), **policy}
    }
    if master:
        specs["Master"] = {"replicas": 1, "template": pod_template(job), **policy}
    return kube.put(
        "kubeflow.org",
        "pytorchjobs",
        {
            "metadata": meta(job, job),
            "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": specs},
        },
    )


def jobset(kube: FakeKube, job: str, replicas: int, *, per_job: int = 1) -> dict[str, Any]:
    job_spec = {
        "parallelism": per_job,
        "completions": per_job,
        "completionMode": "Indexed",
        "template": pod_template(job),
    }
    rjobs = [{"name": "workers", "replicas": replicas, "template": {"spec": job_spec}}]
    return kube.put(
        "jobset.x-k8s.io",
        "jobsets",
        {"metadata": meta(job, job), "spec": {"replicatedJobs": rjobs}},
    )


def trainjob(kube: FakeKube, job: str, nodes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Kubeflow Trainer v2 TrainJob and the JobSet its controller made of it (same name,
    controlled by the TrainJob, the trainer's replicatedJob ``node``)."""
    tj = kube.put(
        "trainer.kubeflow.org",
        "trainjobs",
        {
            "metadata": meta(job, job),
            "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": nodes}},
        },
    )
    job_spec = {"parallelism": 1, "completions": 1, "template": pod_template(job)}
    rjobs = [
        {"name": "dataset-initializer", "replicas": 1, "template": {"spec": job_spec}},
        {"name": "node", "replicas": nodes, "template": {"spec": job_spec}},
    ]
    js = kube.put(
        "jobset.x-k8s.io",
        "jobsets",
        {
            "metadata": {**meta(job, job), "ownerReferences": [ref(tj)]},
            "spec": {"replicatedJobs": rjobs},
        },
    )
    return tj, js


def child_job(kube: FakeKube, owner: dict[str, Any], name: str) -> dict[str, Any]:
    """A JobSet's child Job (what the JobSet controller would create)."""
    obj = {
        "metadata": {"name": name, "namespace": NS, "ownerReferences": [ref(owner)]},
        "spec": {"parallelism": 1, "completions": 1, "template": pod_template("x")},
    }
    return kube.put("batch", "jobs", obj)


def ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }


def pods(
    kube: FakeKube,
    job: str,
    owner: dict[str, Any] | list[dict[str, Any]],
    nodes: list[str],
    per_node: int,
    *,
    phase: str = "Running",
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> list[str]:
    """One pod per rank, ranks filling nodes in order; ``owner`` per rank if a list."""
    names = []
    for rank in range(len(nodes) * per_node):
        own = owner[rank] if isinstance(owner, list) else owner
        name = f"{job}-{rank}"
        obj = {
            "metadata": {
                "name": name,
                "namespace": NS,
                "labels": {
                    "trainguard.io/job": job,
                    "trainguard.io/rank": str(rank),
                    **(labels or {}),
                },
                "annotations": dict(annotations or {}),
                "ownerReferences": [ref(own)],
            },
            "spec": {
                "nodeName": nodes[rank // per_node],
                "containers": [{"name": "t", "image": "t"}],
            },
            "status": {"phase": phase},
        }
        kube.put("", "pods", obj)
        names.append(name)
    return names
