"""Restart a training gang the workload's own way, never half of it.

A gang restart after a node fault must restart every rank (collectives cannot mix old and
new ranks) and must land on healthy nodes (the bad one is already cordoned and tainted by
:mod:`~controller.actuators.k8s.nodes`). Each workload has a way of its own:

* **JobSet, and TrainJob (whose runtime is a JobSet)**: fail it the way a crashed rank
  would, so *its* ``failurePolicy`` recreates every child Job and the restart counts
  against ``maxRestarts`` exactly as JobSet counts it. trainguard deletes the gang's pods
  on the bad nodes; with ``backoffLimit: 0`` their child Job fails and the JobSet
  controller restarts the whole set. A JobSet that has used all its restarts is not
  touched (failing it once more would end it): the incident goes to a human. One with
  ``maxRestarts: 0`` never restarts itself: it is suspended and resumed instead.
* **PyTorchJob**: its replicas' ``restartPolicy``: ``OnFailure``/``Always``/``ExitCode``
  make the operator recreate the deleted pods (elsewhere, the node being tainted) and
  torchrun's rendezvous restarts all workers; ``Never`` would end the job, so it is
  suspended and resumed instead.
* **Indexed batch/v1 Job**: suspend (the Job controller deletes every pod), then resume
  (all pods recreated): the existing suspend/resume path of the actuator.

With too few healthy nodes left the gang shrinks where the job says it may (PyTorchJob
``elasticPolicy.minReplicas``/``maxReplicas``, or torchrun ``--nnodes=MIN:MAX`` in a
container's command): the plan says so, for the incident. A resize needs the workload
suspended (JobSet and Job templates are immutable while running), so a shrink always goes
through suspend/resume.

Per-job policy: the workload's ``trainguard.io/policy`` annotation (JSON) may narrow what
trainguard does to this job: ``{"steps": [...], "dry_run": true, "max_restarts": 2}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.api import Kube, KubernetesApiError

ANN_POLICY: Final = "trainguard.io/policy"
_NNODES = re.compile(r"--nnodes[= ](\d+):(\d+)")
_FIXED_NNODES = re.compile(r"--nnodes[= ](\d+)(?![\d:])")
_RESTARTING_POLICIES: Final = {"OnFailure", "Always", "ExitCode"}

Mode = Literal["fail-child-jobs", "delete-pods", "suspend-resume", "refuse"]


@dataclass(frozen=True, slots=True)
class ElasticBounds:
    min_nodes: int
    max_nodes: int
    source: str


@dataclass(frozen=True, slots=True)
class GangPlan:
    mode: Mode
    nodes: int
    shrunk: bool
    note: str


@dataclass(frozen=True, slots=True)
class JobPolicy:
    """What the workload's annotation allows (``None``: the controller's policy applies)."""

    steps: tuple[str, ...] | None = None
    dry_run: bool = False
    max_restarts: int | None = None


def pod_templates(kind: str, obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    if kind == "Job":
        return [spec.get("template") or {}]
    if kind == "JobSet":
        return [
            ((rj.get("template") or {}).get("spec") or {}).get("template") or {}
            for rj in spec.get("replicatedJobs") or []
        ]
    if kind == "PyTorchJob":
        replicas = spec.get("pytorchReplicaSpecs") or {}
        return [r.get("template") or {} for r in replicas.values()]
    return []  # TrainJob: the pods come from its runtime's JobSet


def _command_lines(kind: str, obj: dict[str, Any]) -> list[str]:
    """Each container's command and args as one line (a TrainJob's: its ``trainer``)."""
    if kind == "TrainJob":
        containers = [(obj.get("spec") or {}).get("trainer") or {}]
    else:
        containers = [
            c
            for template in pod_templates(kind, obj)
            for c in (template.get("spec") or {}).get("containers") or []
        ]
    return [
        " ".join(str(x) for x in (c.get("command") or []) + (c.get("args") or []))
        for c in containers
    ]


def elastic_bounds(kind: str, obj: dict[str, Any]) -> ElasticBounds | None:
    """The node-count range the job accepts, from its own spec, or ``None`` (fixed)."""
    elastic = (obj.get("spec") or {}).get("elasticPolicy") or {}
    if kind == "PyTorchJob" and "minReplicas" in elastic and "maxReplicas" in elastic:
        return ElasticBounds(
            int(elastic["minReplicas"]), int(elastic["maxReplicas"]), "elasticPolicy"
        )
    for line in _command_lines(kind, obj):
        if m := _NNODES.search(line):
            low, high = int(m.group(1)), int(m.group(2))
            return ElasticBounds(low, high, f"torchrun --nnodes={low}:{high}")
    return None


def fixed_nnodes(kind: str, obj: dict[str, Any]) -> int | None:
    """A torchrun ``--nnodes=N`` without a range in the job's command (``None``: none)."""
    for line in _command_lines(kind, obj):
        if m := _FIXED_NNODES.search(line):
            return int(m.group(1))
    return None


def resize_note(kind: str, obj: dict[str, Any], old: int, new: int, *, masters: int = 0) -> str:
    """What a restart from ``old`` to ``new`` pods does to the job's size, for the action's
    outcome and the incident ("" when the size stays). Raises when the job does not allow
    it: outside its elastic range, or a fixed ``torchrun --nnodes=N`` (its agents would wait
    for N nodes forever). ``masters``: PyTorchJob Master pods, which ``elasticPolicy``'s
    replica bounds do not count."""
    if new == old:
        return ""
    name = f"{kind} {(obj.get('metadata') or {}).get('name')}"
    verb = "shrunk" if new < old else "grown"
    bounds = elastic_bounds(kind, obj)
    if bounds is not None:
        count = new - masters if bounds.source == "elasticPolicy" else new
        if not bounds.min_nodes <= count <= bounds.max_nodes:
            raise ActuatorError(
                f"{name}: {count} node(s) is outside its {bounds.source} "
                f"({bounds.min_nodes}..{bounds.max_nodes}); the job does not allow that size"
            )
        return f"{verb} from {old} to {new} pod(s) within {bounds.source}"
    fixed = fixed_nnodes(kind, obj)
    if fixed is not None:
        raise ActuatorError(
            f"{name}: its torchrun --nnodes={fixed} is fixed, so {new} pod(s) would wait for "
            f"{fixed} forever; declare --nnodes=MIN:MAX to let trainguard resize it"
        )
    return f"{verb} from {old} to {new} pod(s) (the job declares no elastic range)"


def restart_budget(jobset: dict[str, Any]) -> tuple[int, int]:
    """(restarts used, ``failurePolicy.maxRestarts``) as the JobSet controller counts them."""
    used = int((jobset.get("status") or {}).get("restarts") or 0)
    allowed = int(((jobset.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts", 0))
    return used, allowed


def plan_gang_restart(
    kind: str,
    obj: dict[str, Any],
    *,
    current_nodes: int,
    healthy_nodes: int,
    jobset: dict[str, Any] | None = None,
    policy: JobPolicy | None = None,
    recorded_restarts: int = 0,
) -> GangPlan:
    """How to restart ``obj``'s gang given how many healthy nodes can take it.

    ``jobset``: for a TrainJob, the JobSet it runs as (for JobSets, ``obj`` itself).
    ``recorded_restarts``: the restarts trainguard recorded on a workload without a restart
    counter of its own (no JobSet's ``status.restarts``), which ``policy.max_restarts`` caps."""
    target, shrunk, note = current_nodes, False, ""
    if healthy_nodes < current_nodes:
        bounds = elastic_bounds(kind, obj)
        if bounds is None or healthy_nodes < bounds.min_nodes:
            why = "declares no elastic range" if bounds is None else f"needs {bounds.source}"
            return GangPlan(
                "refuse",
                current_nodes,
                False,
                f"only {healthy_nodes} healthy node(s) for {current_nodes} and the job {why}",
            )
        target, shrunk = healthy_nodes, True
        note = f"shrunk from {current_nodes} to {target} node(s) within {bounds.source}"
    js = obj if kind == "JobSet" else jobset
    used, allowed = restart_budget(js) if js is not None else (0, 0)
    cap = None if policy is None else policy.max_restarts
    if js is not None and cap is not None and used >= cap:
        return GangPlan(
            "refuse",
            target,
            shrunk,
            f"{js['metadata']['name']} has used {used} of {cap} restarts "
            "its trainguard.io/policy allows",
        )
    if js is None and cap is not None and recorded_restarts >= cap:
        return GangPlan(
            "refuse",
            target,
            shrunk,
            f"trainguard has restarted it {recorded_restarts} time(s), the {cap} "
            "its trainguard.io/policy allows",
        )
    if js is not None and allowed > 0 and used >= allowed:
        return GangPlan(
            "refuse",
            target,
            shrunk,
            f"JobSet {js['metadata']['name']} has used {used} of {allowed} restarts "
            "(failurePolicy.maxRestarts); one more failure would end it",
        )
    if shrunk:
        return GangPlan("suspend-resume", target, True, note)
    if kind in ("JobSet", "TrainJob"):
        limits = [
            int(((rj.get("template") or {}).get("spec") or {}).get("backoffLimit", 6))
            for rj in ((js or {}).get("spec") or {}).get("replicatedJobs") or []
        ]
        if allowed == 0:
            return GangPlan(
                "suspend-resume",
                target,
                False,
                "failurePolicy.maxRestarts is 0 (the JobSet never restarts itself): "
                "suspended and resumed instead",
            )
        if limits and all(limit == 0 for limit in limits):
            return GangPlan(
                "fail-child-jobs", target, False, "failurePolicy restarts every child Job"
            )
        return GangPlan(
            "suspend-resume",
            target,
            False,
            "child Jobs have backoffLimit > 0 (a lost pod would be replaced alone): "
            "suspended and resumed instead",
        )
    if kind == "PyTorchJob":
        replicas = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        policies = {r.get("restartPolicy", "Never") for r in replicas.values()}
        if policies and policies <= _RESTARTING_POLICIES:
            return GangPlan(
                "delete-pods", target, False, f"the operator recreates pods ({sorted(policies)})"
            )
        return GangPlan("suspend-resume", target, False, "restartPolicy Never: suspend/resume")
    return GangPlan("suspend-resume", target, False, "every pod deleted and recreated")


def job_policy(obj: dict[str, Any]) -> JobPolicy:
    """The workload's ``trainguard.io/policy`` annotation; a bad one is a one-line error."""
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANN_POLICY)
    if not raw:
        return JobPolicy()
    name = obj["metadata"].get("name")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ActuatorError(f"{ANN_POLICY} on {name}: not JSON ({exc.args[0]})") from exc
    if not isinstance(data, dict) or set(data) - {"steps", "dry_run", "max_restarts"}:
        raise ActuatorError(
            f"{ANN_POLICY} on {name}: expected an object with steps, dry_run, max_restarts"
        )
    steps = data.get("steps")
    if steps is not None and (
        not isinstance(steps, list) or not all(isinstance(s, str) and s for s in steps)
    ):
        raise ActuatorError(f"{ANN_POLICY} on {name}: steps must be a list of step names")
    max_restarts = data.get("max_restarts")
    if max_restarts is not None and (
        not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0
    ):
        raise ActuatorError(f"{ANN_POLICY} on {name}: max_restarts must be an integer >= 0")
    if not isinstance(data.get("dry_run", False), bool):
        raise ActuatorError(f"{ANN_POLICY} on {name}: dry_run must be true or false")
    return JobPolicy(
        tuple(steps) if steps is not None else None, bool(data.get("dry_run")), max_restarts
    )


class PodsPartlyDeleted(Exception):
    """:func:`delete_pods` stopped at an API error: ``deleted`` went, ``cause`` says why
    the rest did not."""

    def __init__(self, deleted: list[str], cause: KubernetesApiError) -> None:
        super().__init__(str(cause))
        self.deleted, self.cause = deleted, cause


async def delete_pods(kube: Kube, pods: list[dict[str, Any]]) -> list[str]:
    """Delete ``pods`` in order (one already gone counts as deleted); the names deleted.
    The first other API error stops it (:class:`PodsPartlyDeleted`)."""
    deleted: list[str] = []
    for pod in pods:
        meta = pod["metadata"]
        try:
            await kube.write(
                f"delete pod {meta['namespace']}/{meta['name']}",
                kube.core.delete_namespaced_pod,
                meta["name"],
                meta["namespace"],
            )
        except KubernetesApiError as exc:
            if exc.status != 404:
                raise PodsPartlyDeleted(deleted, exc) from exc
        deleted.append(meta["name"])
    return deleted


__all__ = [
    "ANN_POLICY",
    "ElasticBounds",
    "GangPlan",
    "JobPolicy",
    "PodsPartlyDeleted",
    "delete_pods",
    "elastic_bounds",
    "fixed_nnodes",
    "job_policy",
    "plan_gang_restart",
    "pod_templates",
    "resize_note",
    "restart_budget",
]
