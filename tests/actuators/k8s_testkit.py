"""Shared pieces of the Kubernetes package tests: the faithful fake, a client on it, and
the OpenAPI check every object trainguard writes must pass."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from controller.actuators.k8s.api import Kube
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_schema import crd_errors, schema_errors

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
    errors = schema_errors(obj)
    if errors:
        pytest.fail(f"{obj.get('kind')} {obj['metadata'].get('name')}: {errors[0]}")


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


def round_trip(obj: dict[str, Any]) -> None:
    """Fail unless ``obj`` survives the project's own published model unchanged (JobSet and
    TrainJob: ``kubeflow-trainer-api``; PyTorchJob: ``kubeflow-training``)."""
    errors = crd_errors(obj)
    if errors:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(errors[:5]))
