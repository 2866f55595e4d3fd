"""Schema checks for what trainguard writes: built-in kinds against the official OpenAPI
schema of the Kubernetes version the chart targets (``kubernetes-validate``, strict: an
unknown field is an error), custom resources through their projects' published models
(JobSet and TrainJob: ``kubeflow-trainer-api``; PyTorchJob: ``kubeflow-training``).

:class:`~tests.actuators.fake_cluster.FakeCluster` runs :func:`schema_errors` on every
object a client creates, patches or replaces and on every Eviction it posts, so no test
can write an object a real API server of that version would not know.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils

# kubernetes-validate reads and parses the version's whole ``_definitions.json`` (MBs) on
# every call: ~0.2 s of CPU for each object a fake API server takes, ~20 s per suite run
# (py-spy, measured here). The files are the installed package's and never change, and the
# validator only reads the parsed schemas: parse each once per process.
kubernetes_validate.utils.schema_contents = functools.cache(  # type: ignore[assignment]
    kubernetes_validate.utils.schema_contents
)

#: The Kubernetes version the chart and examples tests validate against.
K8S_VERSION = "1.33"
_CRD_GROUPS = ("jobset.x-k8s.io/", "trainer.kubeflow.org/", "kubeflow.org/")


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


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Why ``obj`` does not survive its project's own published model unchanged."""
    if obj["kind"] == "PyTorchJob":
        # kubeflow-training's own ApiClient cannot deserialize with today's kubernetes
        # client; the examples test walks its model classes strictly instead: reuse that.
        from tests.examples.test_examples import _strict

        return _strict(obj, "KubeflowOrgV1PyTorchJob", "")
    from kubeflow_trainer_api import models

    cls = {
        "JobSet": models.JobsetV1alpha2JobSet,
        "TrainJob": models.TrainerV1alpha1TrainJob,
    }[obj["kind"]]
    try:
        back = json.loads(cls.from_dict(obj).model_dump_json(by_alias=True, exclude_none=True))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        return [str(exc).splitlines()[0]]
    return _differences(obj, back)


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Why ``obj`` is not valid for :data:`K8S_VERSION` (empty: it is). ``status`` is checked
    only on Nodes (the only status trainguard writes: the TrainguardHealthy condition)."""
    doc = {k: v for k, v in obj.items() if k != "status" or obj.get("kind") == "Node"}
    if str(doc.get("apiVersion", "")).startswith(_CRD_GROUPS):
        return crd_errors(doc)
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


__all__ = ["K8S_VERSION", "crd_errors", "schema_errors"]
