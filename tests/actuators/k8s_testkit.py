"""Shared pieces of the Kubernetes package tests: the faithful fake, a client on it, and
the OpenAPI check every object trainguard writes must pass."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client

from controller.actuators.k8s.api import Kube
from tests.actuators.fake_cluster import FakeCluster

#: The Kubernetes version the chart and examples tests validate against.
K8S_VERSION = "1.33"
NS = "train"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster.running() as server:
        yield server


def kube_on(cluster: FakeCluster) -> Kube:
    cfg = client.Configuration(host=cluster.url)
    cfg.retries = 0
    return Kube(client.ApiClient(cfg))


def validate(obj: dict[str, Any]) -> None:
    """Fail the test when ``obj`` is not valid for the chart's Kubernetes version."""
    doc = {k: v for k, v in obj.items() if k != "status" or obj.get("kind") == "Node"}
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj.get('kind')} {obj['metadata'].get('name')}: {exc.message}")


def node(cluster: FakeCluster, name: str, **spec: Any) -> dict[str, Any]:
    return cluster.put(
        "",
        "nodes",
        {
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": spec,
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
    )


def pod(
    cluster: FakeCluster,
    name: str,
    node_name: str,
    *,
    ns: str = NS,
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels or {}}
    if owners:
        meta["ownerReferences"] = owners
    if annotations:
        meta["annotations"] = annotations
    return cluster.put(
        "",
        "pods",
        {
            "metadata": meta,
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": phase},
        },
    )


def owner(obj: dict[str, Any], *, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: unknown to the model" for k in a.keys() - b.keys()]
        for key in a.keys() & b.keys():
            out += _differences(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: {a!r} became {b!r}"]


def round_trip(obj: dict[str, Any]) -> None:
    """Fail unless ``obj`` survives the project's own published model unchanged (JobSet and
    TrainJob: ``kubeflow-trainer-api``; PyTorchJob: ``kubeflow-training``)."""
    if obj["kind"] == "PyTorchJob":
        # kubeflow-training's own ApiClient cannot deserialize with today's kubernetes
        # client; the examples test walks its model classes strictly instead: reuse that.
        from tests.examples.test_examples import _strict

        errors = _strict(obj, "KubeflowOrgV1PyTorchJob", "")
        if errors:
            pytest.fail(f"PyTorchJob {obj['metadata']['name']}: " + "; ".join(errors[:5]))
        return
    else:
        from kubeflow_trainer_api import models

        cls = {
            "JobSet": models.JobsetV1alpha2JobSet,
            "TrainJob": models.TrainerV1alpha1TrainJob,
        }[obj["kind"]]
        back = json.loads(cls.from_dict(obj).model_dump_json(by_alias=True, exclude_none=True))
    errors = _differences(obj, back)
    if errors:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(errors[:5]))
