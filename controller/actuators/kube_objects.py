"""The Kubernetes side of the actuator's contract: labels and annotations, RBAC rules,
workload kinds, API errors, and the pure helpers that read and patch API objects.

Kept apart from :mod:`controller.actuators.kubernetes` (the client calls) so each stays
small; everything here works on plain dicts as the API sends them. The contract in full is
in that module's docstring and docs/kubernetes.md.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, TypedDict, cast

import yaml
from kubernetes.client.exceptions import ApiException

from controller.actuators.base import ActuatorError, Placement

LABEL_JOB: Final = "trainguard.io/job"
LABEL_RANK: Final = "trainguard.io/rank"
LABEL_TP: Final = "trainguard.io/tp"
#: The quarantine taint (``k8s.nodes.TAINT_KEY``; value: the reason, label-safe).
TAINT_KEY: Final = "trainguard.io/unhealthy"
#: JSON on a quarantined node (``{"by", "instance", "reason", "at", "cordoned", "tainted",
#: "taint", "kept_taints"}``, see ``k8s.nodes``): what trainguard changed, so that release
#: undoes exactly that.
ANN_ISOLATED: Final = "trainguard.io/cordoned-by"
ANN_GENERATION: Final = "trainguard.io/generation"
ANN_RESUME_STEP: Final = "trainguard.io/resume-step"
#: On a JobSet with several replicatedJobs: the name of the one that holds the ranks.
ANN_REPLICATED_JOB: Final = "trainguard.io/replicated-job"
ENV_GENERATION: Final = "TRAINGUARD_GENERATION"
MERGE_PATCH: Final = "application/merge-patch+json"
COMPONENT: Final = "trainguard"


class PolicyRule(TypedDict):
    """One rule of a Kubernetes Role/ClusterRole, spelled as the API spells it."""

    apiGroups: list[str]
    resources: list[str]
    verbs: list[str]


#: Exactly what this module calls, and nothing more (a test serves every call through a
#: fake API server and fails on a call outside these rules). ``nodes`` and ``nodes/status``
#: (the TrainguardHealthy condition) are cluster-scoped and need a ClusterRole; node Events
#: are written to ``default`` (see docs/kubernetes.md).
RBAC_RULES: Final[tuple[PolicyRule, ...]] = (
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]},
    {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]},
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "patch"]},
    {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "patch"]},
    {
        "apiGroups": ["kubeflow.org"],
        "resources": ["pytorchjobs"],
        "verbs": ["get", "list", "patch"],
    },
    {
        "apiGroups": ["trainer.kubeflow.org"],
        "resources": ["trainjobs"],
        "verbs": ["get", "list", "patch"],
    },
)


def rbac_rules_yaml() -> str:
    """``RBAC_RULES`` as the ``rules:`` YAML a Role or ClusterRole takes (docs, Helm)."""
    rules = [dict(rule) for rule in RBAC_RULES]
    return yaml.safe_dump({"rules": rules}, sort_keys=False, default_flow_style=None)


class KubernetesApiError(ActuatorError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, *, status: int, retryable: bool) -> None:
        super().__init__(message, retryable=retryable)
        self.status = status


@dataclass(frozen=True, slots=True)
class WorkloadKind:
    """A kind of training workload trainguard can stop and restart."""

    kind: str
    group: str
    version: str
    plural: str
    #: Where the suspend switch lives in the object.
    suspend_path: tuple[str, ...]


JOB: Final = WorkloadKind("Job", "batch", "v1", "jobs", ("spec", "suspend"))
JOBSET: Final = WorkloadKind(
    "JobSet", "jobset.x-k8s.io", "v1alpha2", "jobsets", ("spec", "suspend")
)
#: ``runPolicy.suspend`` needs training-operator >= v1.7; older operators drop the field.
PYTORCHJOB: Final = WorkloadKind(
    "PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", ("spec", "runPolicy", "suspend")
)
#: Kubeflow Trainer v2: its pods come from a JobSet it controls (``Workload.runtime``);
#: trainguard restarts it through that JobSet and suspends/resizes it on the TrainJob.
TRAINJOB: Final = WorkloadKind(
    "TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", ("spec", "suspend")
)
KINDS: Final = (JOB, JOBSET, PYTORCHJOB, TRAINJOB)
#: The replicatedJob of a TrainJob's JobSet that runs the trainer (Kubeflow Trainer v2).
TRAINER_REPLICATED_JOB: Final = "node"


@dataclass(frozen=True, slots=True)
class Workload:
    kind: WorkloadKind
    name: str
    obj: dict[str, Any]
    #: A TrainJob's JobSet (the object that holds its pod template); ``None`` otherwise.
    runtime: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"{self.kind.kind} {self.name}"

    @property
    def annotations(self) -> dict[str, str]:
        return annotations_of(self.obj)

    @property
    def suspended(self) -> bool:
        return bool(dig(self.obj, self.kind.suspend_path))


def dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``("spec", "suspend"), True`` -> ``{"spec": {"suspend": True}}``."""
    out: dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out


def plain(value: Any) -> Any:
    """A model's ``to_dict`` output without its unset (``None``) fields."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%SZ")
    return value


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(what: str, exc: ApiException) -> KubernetesApiError:
    status = int(exc.status or 0)
    detail = exc.reason or ""
    with contextlib.suppress(ValueError, AttributeError):
        detail = json.loads(exc.body or "").get("message") or detail
    hint = {
        403: "; grant the rules listed in docs/kubernetes.md (RBAC_RULES)",
        404: "",
        409: "; someone changed it meanwhile, retry",
        422: "; the API server refused the change",
    }.get(status, "; retry later" if status == 429 or status >= 500 else "")
    return KubernetesApiError(
        f"{what}: HTTP {status} {detail}{hint}",
        status=status,
        retryable=status in (409, 429) or status >= 500,
    )


def controller_ref(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """``obj``'s controlling ownerReference if it is a ``kind``."""
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("controller") and r.get("kind") == kind), None)


#: The status conditions that end each kind of workload for good: its controller (Job,
#: JobSet, training operator, Trainer) acts on it no more, so suspending, resuming or
#: deleting its pods would restart nothing.
FINISHED_CONDITIONS: Final = {
    "Job": ("Complete", "Failed"),
    "JobSet": ("Completed", "Failed"),
    "PyTorchJob": ("Succeeded", "Failed"),
    "TrainJob": ("Complete", "Failed"),
}


def finished(kind: str, obj: dict[str, Any] | None) -> str | None:
    """How ``obj`` (a ``kind``) ended (``Completed``, ``Failed``...), ``None`` while it runs."""
    status = (obj or {}).get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") in FINISHED_CONDITIONS.get(kind, ()) and cond.get("status") == "True":
            return str(cond["type"])
    terminal = status.get("terminalState") if kind == "JobSet" else None
    return str(terminal) if terminal else None


def annotations_of(obj: dict[str, Any]) -> dict[str, str]:
    return cast(dict[str, str], obj["metadata"].get("annotations") or {})


def labels_of(obj: dict[str, Any]) -> dict[str, str]:
    return cast(dict[str, str], obj["metadata"].get("labels") or {})


def count_of(raw: object) -> int | None:
    """A non-negative count written into an annotation or label, else ``None``. Anyone who
    can edit the object can write an annotation: ASCII digits only (``str.isdigit`` also
    takes ``'\u00b2'``, which ``int`` refuses) and at most 18 of them."""
    text = str(raw) if raw is not None else ""
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        return None
    return int(text)


def pod_generation(pod: dict[str, Any]) -> int | None:
    return count_of(annotations_of(pod).get(ANN_GENERATION))


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def replicated_job(w: Workload) -> tuple[int, dict[str, Any]]:
    """The index and spec of the JobSet's replicatedJob that holds the ranks."""
    rjobs: list[dict[str, Any]] = w.obj.get("spec", {}).get("replicatedJobs") or []
    wanted = w.annotations.get(ANN_REPLICATED_JOB)
    if wanted is None and len(rjobs) == 1:
        return 0, rjobs[0]
    if wanted is None:
        wanted = TRAINER_REPLICATED_JOB  # a TrainJob's JobSet: the trainer's replicatedJob
    for i, rj in enumerate(rjobs):
        if rj.get("name") == wanted:
            return i, rj
    names = [rj.get("name") for rj in rjobs]
    raise ActuatorError(
        f"{w.label}: annotate it {ANN_REPLICATED_JOB}=<one of {names}> to say which "
        "replicatedJob holds the ranks"
    )


def pod_templates(w: Workload) -> list[dict[str, Any]]:
    if w.kind is TRAINJOB:
        if w.runtime is None:
            return []
        return pod_templates(Workload(JOBSET, w.runtime["metadata"]["name"], w.runtime))
    if w.kind is JOB:
        return [w.obj["spec"]["template"]]
    if w.kind is JOBSET:
        return [replicated_job(w)[1]["template"]["spec"]["template"]]
    specs = w.obj["spec"]["pytorchReplicaSpecs"]
    return [specs[r]["template"] for r in ("Worker", "Master") if r in specs]


def node_selector(w: Workload) -> dict[str, str]:
    templates = pod_templates(w) or [{}]
    return cast(dict[str, str], templates[0].get("spec", {}).get("nodeSelector") or {})


def tolerations(w: Workload) -> list[dict[str, Any]]:
    """The tolerations of the ranks' pod template."""
    templates = pod_templates(w) or [{}]
    return list(templates[0].get("spec", {}).get("tolerations") or [])


def tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint`` (Kubernetes' matching rules)."""
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists":
            if not tol.get("key") or tol["key"] == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def condition_status(node: dict[str, Any], kind: str) -> str | None:
    """The status ("True", "False", "Unknown") of the Node's first condition of type
    ``kind``, or None when it has none: the one reading of ``status.conditions``."""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            status = cond.get("status")
            return status if isinstance(status, str) else None
    return None


def node_ready(node: dict[str, Any]) -> bool | None:
    """The Node's ``Ready`` condition: True, False, or None (Unknown, or none reported yet)."""
    return {"True": True, "False": False}.get(condition_status(node, "Ready") or "")


def node_not_ready(node: dict[str, Any]) -> bool:
    """Whether the Node reports a ``Ready`` condition that is not True (False, Unknown);
    a Node with no Ready condition yet is not judged (as ``node_view`` reads it)."""
    status = condition_status(node, "Ready")
    return status is not None and status != "True"


def env_wired(w: Workload) -> bool:
    """Whether some container maps ``TRAINGUARD_GENERATION`` (from the annotation)."""
    for template in pod_templates(w):
        for container in template.get("spec", {}).get("containers") or []:
            if any(e.get("name") == ENV_GENERATION for e in container.get("env") or []):
                return True
    return False


def annotate(template: dict[str, Any], annotations: dict[str, Any]) -> None:
    """Set (``None``: remove) pod-template annotations in place, for list-replacing patches."""
    current = template.setdefault("metadata", {}).setdefault("annotations", {})
    for key, value in annotations.items():
        if value is None:
            current.pop(key, None)
        else:
            current[key] = value


def workload_size(w: Workload) -> int:
    """How many pods the workload's spec asks for now (its gang's size)."""
    spec = w.obj["spec"]
    if w.kind is JOB:
        return int(spec.get("parallelism") or 1)
    if w.kind is TRAINJOB:
        trainer = spec.get("trainer") or {}
        nodes: int = int(trainer.get("numNodes") or 0)
        if not nodes and w.runtime is not None:
            _, rj = replicated_job(Workload(JOBSET, w.runtime["metadata"]["name"], w.runtime))
            per = int((rj["template"].get("spec") or {}).get("parallelism") or 1)
            nodes = int(rj.get("replicas", 1)) * per
        return nodes or 1
    if w.kind is PYTORCHJOB:
        specs = spec["pytorchReplicaSpecs"]
        masters = int(specs["Master"].get("replicas", 1)) if "Master" in specs else 0
        workers = int(specs["Worker"].get("replicas", 1)) if "Worker" in specs else 0
        return max(1, masters + workers)
    _, rj = replicated_job(w)
    return int(rj.get("replicas", 1)) * int(rj["template"]["spec"].get("parallelism") or 1)


def restart_patch(
    w: Workload, world: int, annotations: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The merge patch that gives ``w`` ``world`` ranks and annotates its pod templates,
    and the workload's current world size."""
    spec = w.obj["spec"]
    meta = {"metadata": {"annotations": annotations}}
    old = workload_size(w)
    if w.kind is JOB:
        if world == old:  # completions is immutable on a non-indexed Job: leave it be
            return {"spec": {"template": meta}}, old
        if spec.get("completionMode") != "Indexed":
            raise ActuatorError(
                f"{w.label} is not an Indexed Job; only Indexed Jobs can change their size"
            )
        completions = int(spec.get("completions") or old)
        if completions != old:
            # Indexes past the new size would never run, and nothing would say so.
            raise ActuatorError(
                f"{w.label} runs {completions} completions {old} at a time; trainguard "
                "resizes only a Job whose completions equal its parallelism (a pod per index)"
            )
        return {"spec": {"parallelism": world, "completions": world, "template": meta}}, old
    if w.kind is TRAINJOB:
        # Its pods come from the runtime's JobSet, which the TrainJob controller owns: size
        # it through ``trainer.numNodes``; pod annotations cannot be set from a TrainJob.
        return {"spec": {"trainer": {"numNodes": world}}}, old
    if w.kind is PYTORCHJOB:
        specs = spec["pytorchReplicaSpecs"]
        masters = int(specs["Master"].get("replicas", 1)) if "Master" in specs else 0
        if ("Worker" not in specs and world != masters) or (world <= masters and "Worker" in specs):
            raise ActuatorError(
                f"{w.label}: cannot run {world} ranks with {masters} Master and "
                f"{'no' if 'Worker' not in specs else 'at least one'} Worker replica(s)"
            )
        replica_specs: dict[str, Any] = {role: {"template": meta} for role in specs}
        if "Worker" in specs:
            replica_specs["Worker"]["replicas"] = world - masters
        return {"spec": {"pytorchReplicaSpecs": replica_specs}}, old
    # JobSet: replicatedJobs is a list, which a merge patch replaces whole.
    rjobs = json.loads(json.dumps(spec["replicatedJobs"]))
    index, _ = replicated_job(w)
    rj = rjobs[index]
    job_spec = rj["template"]["spec"]
    per_job = int(job_spec.get("parallelism") or 1)
    if world % per_job == 0:
        rj["replicas"] = world // per_job
    elif int(rj.get("replicas", 1)) == 1:
        job_spec["parallelism"] = job_spec["completions"] = world
    else:
        raise ActuatorError(
            f"{w.label}: {world} ranks do not fill whole child Jobs of {per_job} pods"
        )
    annotate(job_spec["template"], annotations)
    return {"spec": {"replicatedJobs": rjobs}}, old


def placement_of(
    job: str, job_pods: list[dict[str, Any]], stale: str | None = None
) -> Placement | None:
    """The placement the job's ``trainguard.io/rank`` labels describe, used when its ranks'
    own reports are missing or ``stale`` (why, for the error). Every existing pod that has
    not Succeeded counts, whatever its phase: a Failed, Unknown or Terminating pod is still
    the gang's, and its node the one to move off; pods of an older generation than the
    newest are leftovers of a replaced gang. ``None`` when no pod of the job exists
    or none has started (all Pending); a gang pod not scheduled yet is an error, never a
    smaller gang."""
    pods = [p for p in job_pods if p.get("status", {}).get("phase") != "Succeeded"]
    newest = max((pod_generation(p) or 0 for p in pods), default=0)
    pods = [p for p in pods if (pod_generation(p) or 0) == newest]  # an older gang's leftovers
    if all(p.get("status", {}).get("phase", "Pending") == "Pending" for p in pods):
        return None
    unlabelled = sorted(
        p["metadata"]["name"] for p in pods if count_of(labels_of(p).get(LABEL_RANK)) is None
    )
    if unlabelled:
        why = f"; {stale}" if stale else ""
        raise ActuatorError(
            f"job {job!r}: its ranks have not reported from pods {unlabelled[:8]} yet (new pods "
            f"after a restart?{why}) and they carry no {LABEL_RANK} label"
        )
    ranks: dict[int, dict[str, Any]] = {}
    for pod in pods:
        if not pod["spec"].get("nodeName"):
            raise ActuatorError(
                f"job {job!r}: pod {pod['metadata']['name']} is not scheduled yet; its "
                "placement is not known until every pod of the gang has a node"
            )
        ranks[int(labels_of(pod)[LABEL_RANK])] = pod
    per_node: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        per_node.setdefault(ranks[rank]["spec"]["nodeName"], []).append(rank)
    counts = {len(r) for r in per_node.values()}
    if len(counts) != 1:
        raise ActuatorError(
            f"job {job!r} runs an uneven number of ranks per node "
            f"({ {n: len(r) for n, r in per_node.items()} }); no placement describes it"
        )
    first = ranks[min(ranks)]
    meta = {**annotations_of(first), **labels_of(first)}
    generations = [g for p in pods if (g := pod_generation(p)) is not None]
    step = meta.get(ANN_RESUME_STEP, "")
    try:
        return Placement(
            job=job,
            nodes=tuple(per_node),
            ranks_per_node=counts.pop(),
            tp=count_of(meta.get(LABEL_TP)) or 1,
            generation=max(generations, default=0),
            resume_step=count_of(step),
        )
    except ValueError as exc:
        raise ActuatorError(f"job {job!r}: {exc}") from exc
