"""``KubernetesActuator.restart_job``: restart a job's whole gang the workload's own way.

Which way is :func:`~controller.actuators.k8s.workloads.plan_gang_restart`'s answer, read
from the workload itself:

* **fail-child-jobs** (JobSet, and a TrainJob through the JobSet it runs as): record the
  generation with a ``restart-pending`` mark, delete the gang's pods off the new placement,
  clear the mark; the JobSet's ``failurePolicy`` recreates every child Job from the pod
  template as it is (no new generation or resume step) and counts the restart against
  ``maxRestarts``. A retry that finds the mark finishes the deletes. A JobSet rollback (a
  resume step the template must carry, or drop) goes the suspend-resume way instead.
* **delete-pods** (PyTorchJob whose replicas restart: ``OnFailure``/``Always``/``ExitCode``):
  write the new size and generation into the spec, then remove every old-generation pod;
  the operator recreates each from the new spec (off the tainted node).
* **suspend-resume** (indexed batch/v1 Job, PyTorchJob ``Never``, a JobSet that does not
  restart itself, every resize of a Job/JobSet/TrainJob): suspend (the workload's
  controller deletes every pod), remove what is left, change size and template, resume (all
  pods recreated).

Never half a gang: a suspend-resume interrupted half-way leaves the workload suspended (no
pod of either generation runs; the error says so) and a retry resumes it; a delete-pods
restart interrupted half-way suspends the PyTorchJob before it reports the error, so old
and new pods never train side by side, and the retry goes the suspend-resume way. Pods
already carrying the new generation are never removed, so a retry finishes the job instead
of starting over.

A resize says what it did (``details["resize"]``, in the outcome): "shrunk from 4 to 3 pod(s)
within torchrun --nnodes=2:4", and is refused when the job does not allow the size
(:func:`~controller.actuators.k8s.workloads.resize_note`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from controller.actuators import kube_objects as ko
from controller.actuators.base import ActuatorError, ActuatorResult, JobLimits, Placement
from controller.actuators.k8s.api import Kube
from controller.actuators.k8s.nodes import NodeGuard
from controller.actuators.k8s.placement import JobLayout, PlacementBook
from controller.actuators.k8s.workloads import (
    GangPlan,
    PodsPartlyDeleted,
    delete_pods,
    elastic_bounds,
    fixed_nnodes,
    job_policy,
    plan_gang_restart,
    resize_note,
    restart_budget,
)
from controller.actuators.kube_objects import (
    ANN_GENERATION,
    ANN_RESUME_STEP,
    ENV_GENERATION,
    JOB,
    JOBSET,
    PYTORCHJOB,
    TRAINJOB,
    Workload,
    WorkloadKind,
)

#: On a JobSet/TrainJob restarted by its own failurePolicy, between the generation record
#: and the last deletion of an old-gang pod: the JobSet's ``status.restarts`` before it.
ANN_RESTART_PENDING = "trainguard.io/restart-pending"
#: The JobSet restart attempt a pod was created in (set by the JobSet controller).
LABEL_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"


class KubernetesActuator(Protocol):
    """What a restart uses of :class:`controller.actuators.kubernetes.KubernetesActuator`
    (a protocol, so this package does not import the module that imports it)."""

    book: PlacementBook
    kube: Kube
    nodes: NodeGuard
    settle_timeout_s: float
    poll_interval_s: float

    async def _job_pods(self, job: str) -> list[dict[str, Any]]: ...
    async def _resolve(self, job: str, pods: list[dict[str, Any]] | None = None) -> Workload: ...
    async def _get_workload(self, kind: WorkloadKind, name: str) -> Workload: ...
    async def _patch_workload(self, w: Workload, body: dict[str, Any], what: str) -> Workload: ...
    async def _remove_pods(self, pods: list[dict[str, Any]], details: dict[str, Any]) -> None: ...
    async def _event(self, obj: dict[str, Any], reason: str, msg: str, warning: bool) -> None: ...
    async def _try_event(self, coro: Awaitable[None], details: dict[str, Any]) -> None: ...


def _masters(w: Workload) -> int:
    if w.kind is not PYTORCHJOB:
        return 0
    specs = w.obj["spec"].get("pytorchReplicaSpecs") or {}
    return int(specs["Master"].get("replicas", 1)) if "Master" in specs else 0


def _size_source(w: Workload) -> tuple[str, dict[str, Any]]:
    """Where the job says which sizes it runs at: a TrainJob's trainer command, else (the
    runtime's own command) its JobSet; every other kind itself."""
    trainer = (w.obj.get("spec") or {}).get("trainer") or {}
    if w.kind is TRAINJOB and w.runtime is not None and not trainer.get("command"):
        return "JobSet", w.runtime
    return w.kind.kind, w.obj


def job_limits(w: Workload, ranks_per_pod: int, tp: int) -> JobLimits | None:
    """The smallest data-parallel size ``w`` runs at, from its elastic range (a fixed
    torchrun ``--nnodes=N``: N pods, so no shrink), so the engine plans no restart that
    :func:`restart_job` would refuse; ``None`` when the job declares nothing."""
    kind, obj = _size_source(w)
    bounds = elastic_bounds(kind, obj)
    if bounds is not None:
        pods = bounds.min_nodes + (_masters(w) if bounds.source == "elasticPolicy" else 0)
    elif (fixed := fixed_nnodes(kind, obj)) is not None:
        pods = fixed
    else:
        return None
    return JobLimits(min_dp=max(1, pods * ranks_per_pod // max(1, tp)))


def gang_plan(w: Workload, *, same_size: bool, recorded_restarts: int) -> GangPlan:
    """How to restart ``w``'s gang; raises when the workload must not be failed again.

    ``recorded_restarts``: the generation trainguard last recorded on ``w`` (0 before its
    first restart), what its policy's ``max_restarts`` caps where ``w`` has no JobSet
    counting restarts (``status.restarts``)."""
    if w.suspended:
        return GangPlan("suspend-resume", 0, False, "the workload is suspended: resumed")
    policy = job_policy(w.obj)  # a bad annotation is an error, a resize's included
    if w.kind in (JOBSET, TRAINJOB) and not same_size:
        return GangPlan("suspend-resume", 0, False, "every pod deleted and recreated")
    plan = plan_gang_restart(
        w.kind.kind,
        w.obj,
        current_nodes=1,
        healthy_nodes=1,
        jobset=w.runtime,
        policy=policy,
        recorded_restarts=recorded_restarts,
    )
    if plan.mode == "refuse":
        raise ActuatorError(f"restart {w.label}: {plan.note}")
    return plan


def ranks_per_pod(layout: JobLayout | None, world_size: int, pods_now: int) -> int:
    """Ranks each pod of the gang runs, from the ranks' own reports.

    A restart at the job's present world size keeps the workload's present pod count
    whatever the reports say (they may be partial: a job failing while it starts). A
    resize needs every rank's pod and the same number of ranks in each: sized from a
    partial or uneven layout, a gang of 2 pods x 8 ranks could come back as 5 pods.
    """
    if layout is None:
        return 1
    if world_size == layout.world_size and world_size % pods_now == 0:
        return world_size // pods_now
    if not layout.complete:
        missing = sorted(set(range(layout.world_size)) - set(layout.seats))
        raise ActuatorError(
            f"job {layout.job!r}: ranks {missing[:8]} have not reported their pod yet, "
            f"so a gang of {world_size} ranks cannot be sized in pods"
        )
    counts = sorted({len(ranks) for ranks in layout.pods().values()})
    if len(counts) != 1 or world_size % counts[0]:
        raise ActuatorError(
            f"job {layout.job!r}: its pods run {counts} ranks each; {world_size} ranks "
            "do not make a whole number of equal pods"
        )
    return counts[0]


async def restart_job(act: KubernetesActuator, placement: Placement, reason: str) -> ActuatorResult:
    job, gen = placement.job, placement.generation
    pods = await act._job_pods(job)
    w = await act._resolve(job, pods)
    done = ko.pod_generation(w.obj)  # the generation annotation, a pod's or a workload's
    if done == gen and ANN_RESTART_PENDING in w.annotations:
        # A JobSet's own restart recorded, its old gang's pods not all deleted yet.
        return await _finish_fail_gang(act, w, pods, placement, reason)
    if done is not None and done >= gen:
        return ActuatorResult(
            outcome=f"job {job} generation {done} already started; nothing to do",
            details={"already": True, "workload": w.label},
        )
    # A finished workload (or a TrainJob's finished JobSet) is left alone by its controller:
    # suspend/resume or deleted pods would start nothing, and the restart would have
    # reported a success that did nothing (found by the layout sweep).
    ended = ko.finished(w.kind.kind, w.obj) or ko.finished("JobSet", w.runtime)
    if ended is not None:
        raise ActuatorError(
            f"job {job}: {w.label} has finished ({ended}); its controller does not act on a "
            "finished workload, so a restart would start nothing: resubmit the job"
        )
    annotations = {
        ANN_GENERATION: str(gen),
        ANN_RESUME_STEP: None if placement.resume_step is None else str(placement.resume_step),
    }
    # Pods, not ranks: torchrun runs several ranks per pod (as the ranks reported).
    per_pod = ranks_per_pod(act.book.layout(job), placement.world_size, ko.workload_size(w))
    size = placement.world_size // per_pod
    _, old_size = ko.restart_patch(w, size, annotations)
    resize = resize_note(*_size_source(w), old_size, size, masters=_masters(w))
    plan = gang_plan(w, same_size=old_size == size, recorded_restarts=done or 0)
    plan = _carrying_plan(w, plan, placement)
    # What the new pods get: a JobSet's own restart (and every TrainJob restart) recreates
    # them from the pod template as it is, without this restart's annotations.
    written = plan.mode != "fail-child-jobs" and w.kind is not TRAINJOB
    details: dict[str, Any] = {
        "workload": w.label,
        "generation": gen,
        "world_size": placement.world_size,
        "previous_world_size": old_size * per_pod,
        "ranks_per_pod": per_pod,
        "env_wired": written and ko.env_wired(w),
        "template_written": written,
        "resume_step_carried": written or placement.resume_step is None,
        "mode": plan.mode,
    }
    if resize:
        details["resize"] = resize
    # Pods created from the new template carry the new generation: a retried restart
    # leaves them alone and removes only what is left of older generations.
    stale = [p for p in pods if ko.pod_generation(p) != gen]
    if plan.mode == "fail-child-jobs":
        return await _fail_gang(act, w, pods, placement, plan, details, reason)
    if plan.mode == "delete-pods":
        w = await _recreate_pods(act, w, size, annotations, stale, details)
    else:
        w = await _suspend_resume(act, w, size, annotations, stale, details)
    outcome = (
        f"job {job} restarted as generation {gen} with {placement.world_size} ranks "
        f"({w.label}, was {old_size * per_pod}; {plan.note})"
    )
    if resize:
        outcome += f"; {resize}"
    if not written:
        outcome += f"; {_template_note(w, gen, placement.resume_step)}"
    elif not details["env_wired"]:
        outcome += f"; its pod template does not map {ENV_GENERATION} from the annotation"
    await act._try_event(act._event(w.obj, "JobRestarted", f"{outcome}: {reason}", False), details)
    return ActuatorResult(outcome=outcome, details=details)


def _record(gen: int, pending: int | None = None) -> dict[str, Any]:
    """The workload's generation record; ``pending`` (a JobSet restart's count before it)
    marks a ``fail-child-jobs`` restart whose pods are not all deleted yet, and every other
    record clears that mark."""
    marks = {ANN_GENERATION: str(gen), ANN_RESTART_PENDING: None}
    if pending is not None:
        marks[ANN_RESTART_PENDING] = str(pending)
    return {"metadata": {"annotations": marks}}


def _template_step(w: Workload) -> str | None:
    """The resume-step bound the pod template carries now (what new pods would inherit)."""
    for template in ko.pod_templates(w):
        step = ((template.get("metadata") or {}).get("annotations") or {}).get(ANN_RESUME_STEP)
        if step is not None:
            return str(step)
    return None


def _carrying_plan(w: Workload, plan: GangPlan, placement: Placement) -> GangPlan:
    """A plan whose new pods get the restart's resume-step bound (a rollback's), or lose the
    one the template still carries: a JobSet's own restart keeps the pod template, so it
    goes the suspend/resume way instead. (A TrainJob's pods cannot be annotated in any
    mode: its outcome says what they get.)"""
    if plan.mode != "fail-child-jobs" or w.kind is TRAINJOB:
        return plan
    step, inherited = placement.resume_step, _template_step(w)
    if step is None and inherited is None:
        return plan
    why = (
        f"the rollback bound {ANN_RESUME_STEP}={step}"
        if step is not None
        else f"no {ANN_RESUME_STEP} (the template still says {inherited})"
    )
    return GangPlan(
        "suspend-resume",
        0,
        False,
        "suspended and resumed, not failed: the JobSet's own restart keeps the pod "
        f"template, which must give the new pods {why}",
    )


def _template_note(w: Workload, gen: int, resume_step: int | None = None) -> str:
    who = "a TrainJob's cannot be annotated" if w.kind is TRAINJOB else "the JobSet's own restart"
    step = _template_step(w)
    resume = f"step {step} or before (the template's bound)" if step else "the newest checkpoint"
    note = (
        f"its pod template is left as it is ({who}), so the new pods do not get "
        f"{ANN_GENERATION}={gen} (nor {ENV_GENERATION} from it) and resume from {resume}"
    )
    if resume_step is not None:
        note += f", not from the rollback bound step {resume_step}"
    return note


async def _recreate_pods(
    act: KubernetesActuator,
    w: Workload,
    size: int,
    annotations: dict[str, Any],
    stale: list[dict[str, Any]],
    details: dict[str, Any],
) -> Workload:
    """PyTorchJob with restarting replicas: new spec first, then every old pod goes (the
    operator recreates it from the new spec); half-way failures suspend the job."""
    patch, _ = ko.restart_patch(w, size, annotations)
    w = await act._patch_workload(w, patch, "resize")
    try:
        await act._remove_pods(stale, details)
        if details.get("blocked_by_pdb"):
            raise ActuatorError(
                f"a PodDisruptionBudget kept {len(details['blocked_by_pdb'])} old pod(s)"
            )
    except ActuatorError as exc:
        removed = len(details.get("evicted", [])) + len(details.get("deleted_despite_pdb", []))
        what = f"restart {w.label} interrupted after {removed} of {len(stale)} old pod(s) ({exc})"
        try:
            await act._patch_workload(w, ko.nest(w.kind.suspend_path, True), "suspend")
        except ActuatorError as again:
            raise ActuatorError(
                f"{what}; suspending it to stop the half gang failed too ({again}); "
                "retry the restart",
                retryable=True,
            ) from exc
        raise ActuatorError(
            f"{what}; suspended so that no half gang trains; retry the restart", retryable=True
        ) from exc
    record = _record(int(annotations[ANN_GENERATION]))
    return await act._patch_workload(w, record, "record generation of")


async def _suspend_resume(
    act: KubernetesActuator,
    w: Workload,
    size: int,
    annotations: dict[str, Any],
    stale: list[dict[str, Any]],
    details: dict[str, Any],
) -> Workload:
    """Suspend (every pod goes), change size and template, resume: one patch at the end,
    so an interruption leaves the workload suspended, never half restarted."""
    if not w.suspended:
        w = await act._patch_workload(w, ko.nest(w.kind.suspend_path, True), "suspend")
    try:
        await act._remove_pods(stale, details)
        if w.kind is JOB:
            w = await _wait_job_settled(act, w)
        patch, _ = ko.restart_patch(w, size, annotations)
        version = {"metadata": {"resourceVersion": w.obj["metadata"].get("resourceVersion")}}
        for part in (_record(int(annotations[ANN_GENERATION])), version):
            patch = ko.merge(patch, part)
        patch = ko.merge(patch, ko.nest(w.kind.suspend_path, False))
        return await act._patch_workload(w, patch, "resize and resume")
    except ActuatorError as exc:
        removed = len(details.get("evicted", [])) + len(details.get("deleted_despite_pdb", []))
        raise ActuatorError(
            f"restart {w.label} interrupted after suspending it and removing {removed} of "
            f"{len(stale)} old pod(s) ({exc}); it is left suspended, so no pod of either "
            "generation runs, and a retry of the restart resumes it",
            retryable=exc.retryable,
        ) from exc


async def _fail_gang(
    act: KubernetesActuator,
    w: Workload,
    pods: list[dict[str, Any]],
    placement: Placement,
    plan: GangPlan,
    details: dict[str, Any],
    reason: str,
) -> ActuatorResult:
    """Fail the JobSet (a TrainJob's: its runtime) the way a crashed rank would: record the
    generation with a mark that its pods are not deleted yet (and how many restarts the
    JobSet had counted), delete the gang's pods off the placement (all of them if none is),
    then clear the mark. Interrupted in between, a retry finds the mark and finishes."""
    used, allowed = restart_budget(w.runtime if w.runtime is not None else w.obj)
    w = await act._patch_workload(w, _record(placement.generation, used), "record generation of")
    deleted = await _delete_old_gang(act, w, pods, placement, used)
    details.update(mode=plan.mode, deleted=deleted, note=plan.note)
    details.update(restarts_used=used + 1, max_restarts=allowed)
    label = f"{w.obj.get('kind')} {w.name}"
    outcome = f"{label}: gang restart by its own controller ({plan.note}); deleted {deleted}"
    await _clear_pending(act, w, placement.generation, f"deleted {deleted}")
    await act._try_event(
        act._event(w.obj, "TrainguardGangRestart", f"{outcome}: {reason}", True), details
    )
    outcome = (
        f"job {placement.job} generation {placement.generation}: {outcome} "
        f"(restart {used + 1} of {allowed}); "
        f"{_template_note(w, placement.generation, placement.resume_step)}"
    )
    return ActuatorResult(outcome=outcome, details=details)


async def _delete_old_gang(
    act: KubernetesActuator,
    w: Workload,
    pods: list[dict[str, Any]],
    placement: Placement,
    used: int,
) -> list[str]:
    """Delete the old gang's pods off the placement (all of them if none is), those of the
    JobSet's restart attempt ``used`` or before (not the new gang's); a failure says what
    was done and that a retry finishes it."""
    gen = placement.generation
    off = [p for p in pods if p.get("spec", {}).get("nodeName") not in placement.nodes]
    old = [pod for pod in off or pods if _restart_attempt(pod) <= used]
    try:
        return await delete_pods(act.kube, old)
    except PodsPartlyDeleted as exc:
        raise ActuatorError(
            f"restart {w.label} to generation {gen} half done: generation recorded "
            f"({ANN_RESTART_PENDING} set), deleted {exc.deleted} of {len(old)} pod(s) of the "
            f"old gang, then {exc.cause}; the old gang may still run: a retry of the restart "
            "finishes it",
            retryable=exc.cause.retryable,
        ) from exc


def _restart_attempt(pod: dict[str, Any]) -> int:
    """The JobSet restart attempt that created ``pod`` (its label; 0 when absent)."""
    return ko.count_of(ko.labels_of(pod).get(LABEL_RESTART_ATTEMPT)) or 0


async def _clear_pending(act: KubernetesActuator, w: Workload, gen: int, done: str) -> None:
    try:
        await act._patch_workload(w, _record(gen), "record generation of")
    except ActuatorError as exc:
        raise ActuatorError(
            f"restart {w.label} to generation {gen}: {done} (its JobSet restarts the gang), "
            f"but clearing {ANN_RESTART_PENDING} failed ({exc}); a retry of the restart "
            "finishes it",
            retryable=exc.retryable,
        ) from exc


async def _finish_fail_gang(
    act: KubernetesActuator,
    w: Workload,
    pods: list[dict[str, Any]],
    placement: Placement,
    reason: str,
) -> ActuatorResult:
    """A retry of a ``fail-child-jobs`` restart that was interrupted: if the JobSet has not
    restarted since (its restart count is still the one recorded), delete what is left of
    the old gang; then clear the mark."""
    gen = placement.generation
    raw = w.annotations.get(ANN_RESTART_PENDING, "")
    before = ko.count_of(raw) or 0
    used, allowed = restart_budget(w.runtime if w.runtime is not None else w.obj)
    details: dict[str, Any] = {"workload": w.label, "generation": gen, "finished": True}
    details.update(mode="fail-child-jobs", restarts_used=max(used, before + 1))
    details.update(max_restarts=allowed, template_written=False, env_wired=False)
    if used > before:
        done = f"its JobSet already restarted the gang (restart {used} of {allowed})"
        details["deleted"] = []
    else:
        deleted = await _delete_old_gang(act, w, pods, placement, before)
        details["deleted"] = deleted
        done = f"deleted {deleted} (restart {before + 1} of {allowed})"
    await _clear_pending(act, w, gen, done)
    outcome = (
        f"job {placement.job} generation {gen}: finished the interrupted restart of "
        f"{w.label}: {done}; {_template_note(w, gen)}"
    )
    await act._try_event(
        act._event(w.obj, "TrainguardGangRestart", f"{outcome}: {reason}", True), details
    )
    return ActuatorResult(outcome=outcome, details=details)


async def _wait_job_settled(act: KubernetesActuator, w: Workload) -> Workload:
    """A suspended Job's pod template becomes mutable once the Job controller has removed
    its pods and cleared ``status.startTime``."""
    deadline = time.monotonic() + act.settle_timeout_s
    while True:
        status = w.obj.get("status") or {}
        if not status.get("active") and not status.get("startTime"):
            return w
        if time.monotonic() >= deadline:
            raise ActuatorError(
                f"{w.label} still has {status.get('active') or 0} active pod(s) "
                f"{act.settle_timeout_s:.0f}s after suspension; retry the restart",
                retryable=True,
            )
        await asyncio.sleep(act.poll_interval_s)
        w = await act._get_workload(w.kind, w.name)


__all__ = ["gang_plan", "job_limits", "restart_job"]
