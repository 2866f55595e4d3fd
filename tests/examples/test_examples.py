"""examples/ manifests, validated through the projects' own published API models.

- JobSet, TrainingRuntime and TrainJob: ``kubeflow-trainer-api`` (Kubeflow Trainer's
  generated pydantic models, which carry JobSet v1alpha2 and the core types they embed).
- PyTorchJob: ``kubeflow-training`` (the Training Operator SDK's models, whose pod templates
  are the official ``kubernetes`` client's models), walked strictly by their openapi types.
- Core objects (PersistentVolumeClaims, and every pod template as a Pod):
  ``kubernetes-validate --strict`` for Kubernetes 1.33.

A model drops a field it does not know, so each object must survive a round trip through its
model unchanged: a misspelt or misplaced key fails the test instead of vanishing. Then the
trainguard contract is checked on every rank's pod: the job label, the agent's TCP address
from the node IP and the job token from its Secret (resolved as the kubelet would and read
by the ranks' own config), the restart annotations mapped to the environment the ranks
read; and every rank's pod must pass the Pod Security Standards ``baseline`` level.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.examples.pss_baseline import baseline_violations

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
JOB_ENDPOINT_PORT = 9471  # the chart's agent.jobEndpoint.port
JOB_TOKEN_SECRET = "trainguard-job-token"  # the chart's copy in agent.jobEndpoint.jobNamespaces

#: The kubeflow-trainer-api model class of each Kubeflow Trainer / JobSet kind.
TRAINER_MODELS = {
    "JobSet": "JobsetV1alpha2JobSet",
    "TrainingRuntime": "TrainerV1alpha1TrainingRuntime",
    "TrainJob": "TrainerV1alpha1TrainJob",
}


@functools.cache
def _libs() -> SimpleNamespace:
    """The model packages, imported on first use rather than at collection: they define
    thousands of model classes (~10 s of CPU here), which every pytest-xdist worker would
    otherwise pay while only one runs these tests. A missing package skips the test."""
    return SimpleNamespace(
        trainer=pytest.importorskip("kubeflow_trainer_api.models"),
        training=pytest.importorskip("kubeflow.training.models"),
        validate=pytest.importorskip("kubernetes_validate"),
        k8s=pytest.importorskip("kubernetes.client"),
    )


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: unknown to the model" for k in a.keys() - b.keys()]
        out += [f"{path}/{k}: added by the model" for k in b.keys() - a.keys()]
        for key in a.keys() & b.keys():
            out += _differences(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(
            x, y, f"{path}[{i}]")]  # fmt: skip
    return [] if a == b else [f"{path}: {a!r} became {b!r}"]


def _trainer_round_trip(doc: dict[str, Any]) -> list[str]:
    model = getattr(_libs().trainer, TRAINER_MODELS[doc["kind"]]).from_dict(doc)
    return _differences(doc, model.to_dict())


# -- the Training Operator's models (openapi-generator classes), walked strictly ------------

_LIST = re.compile(r"(?:list|List)\[(.+)\]")
_DICT = re.compile(r"(?:dict\(str, (.+)\)|Dict\[str, (.+)\])")


def _model_class(name: str) -> Any:
    for module in (_libs().training, _libs().k8s):
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise AssertionError(f"no model class {name}")


def _strict(value: Any, klass: str, path: str) -> list[str]:
    """Errors of ``value`` against the openapi type ``klass`` (unknown keys are errors)."""
    if value is None:
        return []
    if m := _LIST.fullmatch(klass):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(value) for e in _strict(v, m.group(1), f"{path}[{i}]")]
    if m := _DICT.fullmatch(klass):
        if not isinstance(value, dict):
            return [f"{path}: expected a map"]
        inner = m.group(1) or m.group(2)
        return [e for k, v in value.items() for e in _strict(v, inner, f"{path}/{k}")]
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str}
    if klass in primitive:
        ok = isinstance(value, primitive[klass]) and not (klass == "int" and value is True)
        return [] if ok else [f"{path}: expected {klass}, got {value!r}"]
    if klass == "object":
        return []
    cls = _model_class(klass)
    if not isinstance(value, dict):
        return [f"{path}: expected a {klass} object"]
    by_json = {json: attr for attr, json in cls.attribute_map.items()}
    errors = [f"{path}/{k}: not a field of {klass}" for k in value if k not in by_json]
    for key, item in value.items():
        if key in by_json:
            errors += _strict(item, cls.openapi_types[by_json[key]], f"{path}/{key}")
    if not errors:
        try:  # required fields and enums, checked by the model's own setters
            cls(**{by_json[k]: v for k, v in value.items()})
        except (ValueError, TypeError) as exc:
            errors.append(f"{path}: {klass}: {exc}")
    return errors


# -- core objects ------------------------------------------------------------------------------


def _core_errors(doc: dict[str, Any]) -> list[str]:
    _libs()  # skips without kubernetes-validate
    from tests.actuators.k8s_schema import schema_errors

    return [f"{doc['kind']} {doc['metadata'].get('name')}: {e}" for e in schema_errors(doc)]


def _as_pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    meta = {"name": name, **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank pod template of a workload."""
    kind = doc["kind"]
    if kind == "JobSet":
        return [rj["template"]["spec"]["template"] for rj in doc["spec"]["replicatedJobs"]]
    if kind == "TrainingRuntime":
        jobs = doc["spec"]["template"]["spec"]["replicatedJobs"]
        return [rj["template"]["spec"]["template"] for rj in jobs]
    if kind == "PyTorchJob":
        return [spec["template"] for spec in doc["spec"]["pytorchReplicaSpecs"].values()]
    return []


def _expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of an env value (earlier variables only)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _check_contract(template: dict[str, Any], job: str | None) -> None:
    """What trainguard needs from every rank's pod (docs/kubernetes.md, examples/README.md)."""
    pod = template["spec"]
    # Admitted in a namespace that enforces Pod Security `baseline`: no hostPath, no host
    # namespaces or ports, not privileged.
    assert baseline_violations(pod, template.get("metadata", {}).get("annotations")) == []
    if job is not None:
        assert template["metadata"]["labels"]["trainguard.io/job"] == job
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e for e in container["env"]}
    # The node's IP from the downward API, then the agent's address built from it.
    resolved: dict[str, str] = {}
    for entry in container["env"]:
        if entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.hostIP":
            resolved[entry["name"]] = "10.0.7.21"
        elif "value" in entry:
            resolved[entry["name"]] = _expand(entry["value"], resolved)
    # Imported here: the collectives package imports torch (~3 s of CPU), and the fake
    # Kubernetes API server (tests/actuators) imports this module for ``_strict`` alone.
    from collectives.config import config_from_env

    cfg = config_from_env(job="demo", env={**resolved, "TRAINGUARD_JOB": "demo"})
    assert cfg.agent_addr == f"10.0.7.21:{JOB_ENDPOINT_PORT}"
    # The token file lies in a mounted volume of the job-token Secret, under its item's path.
    token = Path(cfg.agent_token_file)
    (volume_name,) = [n for n, path in mounts.items() if token.parent == Path(path)]
    secret = volumes[volume_name]["secret"]
    assert secret["secretName"] == JOB_TOKEN_SECRET
    assert {"key": "token", "path": token.name} in secret["items"]
    assert "TRAINGUARD_AGENT_SOCKET" not in env
    for var, key in (("TRAINGUARD_GENERATION", "generation"),
                     ("TRAINGUARD_RESUME_STEP", "resume-step")):  # fmt: skip
        field = env[var]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == f"metadata.annotations['trainguard.io/{key}']"
    command = " ".join(container["command"])
    assert "torchrun" in command and "demojob.train" in command


# -- the examples --------------------------------------------------------------------------------


def test_jobset_example() -> None:
    docs = _docs("jobset.yaml")
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "JobSet"]
    pvc, jobset = docs
    assert _core_errors(pvc) == []
    assert _trainer_round_trip(jobset) == []
    assert jobset["metadata"]["labels"]["trainguard.io/job"] == "demo-llm"
    (template,) = _pod_templates(jobset)
    assert _core_errors(_as_pod(template, "rank")) == []
    _check_contract(template, "demo-llm")
    env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
    assert env["TRAINGUARD_JOB"] == "demo-llm"
    claim = template["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"]
    assert claim == pvc["metadata"]["name"]


def test_pytorchjob_example() -> None:
    docs = _docs("pytorchjob.yaml")
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "PyTorchJob"]
    pvc, job = docs
    assert _core_errors(pvc) == []
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert _strict(job, "KubeflowOrgV1PyTorchJob", "") == []
    templates = _pod_templates(job)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    for template in templates:
        assert _core_errors(_as_pod(template, "rank")) == []
        _check_contract(template, "demo-ptj")
        assert template["spec"]["containers"][0]["name"] == "pytorch"


def test_trainjob_example() -> None:
    docs = _docs("trainjob.yaml")
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "TrainingRuntime", "TrainJob"]
    pvc, runtime, trainjob = docs
    assert _core_errors(pvc) == []
    assert _trainer_round_trip(runtime) == []
    assert _trainer_round_trip(trainjob) == []
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert trainjob["spec"]["runtimeRef"]["kind"] == "TrainingRuntime"
    (template,) = _pod_templates(runtime)
    assert _core_errors(_as_pod(template, "rank")) == []
    _check_contract(template, None)  # the job label comes from the TrainJob's patch
    (patch,) = trainjob["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["name"]
    labels = rjob["template"]["spec"]["template"]["metadata"]["labels"]
    assert labels["trainguard.io/job"] == "demo-tj"
    env = {e["name"]: e.get("value") for e in trainjob["spec"]["trainer"]["env"]}
    assert env["TRAINGUARD_JOB"] == "demo-tj"


@pytest.mark.parametrize(
    ("kind", "mutate", "fragment"),
    [
        ("JobSet", lambda d: d["spec"].update(replicatedjobs=[]), "/spec/replicatedjobs"),
        ("PyTorchJob", lambda d: d["spec"].update(nprocsPerNode="2"), "/spec/nprocsPerNode"),
        ("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="1"),
         "expected int"),
    ],
)  # fmt: skip
def test_validation_catches_a_misspelt_or_mistyped_field(
    kind: str, mutate: Any, fragment: str
) -> None:
    name = {"JobSet": "jobset.yaml", "PyTorchJob": "pytorchjob.yaml"}[kind]
    doc = next(d for d in _docs(name) if d["kind"] == kind)
    mutate(doc)
    errors = (
        _trainer_round_trip(doc)
        if kind in TRAINER_MODELS
        else _strict(doc, f"KubeflowOrgV1{kind}", "")
    )
    assert any(fragment in e for e in errors), errors


# -- the Pod Security baseline checker catches each kind of violation ----------------------------


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda p: p["volumes"].append({"name": "s", "hostPath": {"path": "/run/trainguard"}}),
         "hostPath volumes: volume 's'"),
        (lambda p: p.update(hostNetwork=True), "host namespaces: hostNetwork=true"),
        (lambda p: p.update(hostPID=True), "host namespaces: hostPID=true"),
        (lambda p: p["containers"][0]["securityContext"].update(privileged=True),
         "privileged containers: containers[trainer]"),
        (lambda p: p["containers"][0]["securityContext"].update(
            capabilities={"add": ["SYS_ADMIN"]}), "adds ['SYS_ADMIN']"),
        (lambda p: p["containers"][0].update(ports=[{"containerPort": 1, "hostPort": 1}]),
         "host ports: trainer hostPort 1"),
        (lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}),
         "seccomp: spec.securityContext Unconfined"),
        (lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
         "sysctls: kernel.msgmax"),
    ],
)  # fmt: skip
def test_baseline_check_catches_violations(mutate: Any, fragment: str) -> None:
    jobset = next(d for d in _docs("jobset.yaml") if d["kind"] == "JobSet")
    (template,) = _pod_templates(jobset)
    assert baseline_violations(template["spec"]) == []
    mutate(template["spec"])
    errors = baseline_violations(template["spec"])
    assert any(fragment in e for e in errors), errors
