"""The Kubernetes actuator: cordon and taint nodes, stop and restart training workloads.

Everything goes through the official ``kubernetes`` client (synchronous, so each call runs
in :func:`asyncio.to_thread`). The contract with the cluster, in short (the full version,
with examples, is docs/kubernetes.md):

* Each rank reports its pod and node (``k8s.placement``); ``trainguard.io/job=<job>`` on
  the pods and ``trainguard.io/rank=<n>`` are optional overrides, ``trainguard.io/tp=<n>``
  optional (label or annotation).
* The pods' controlling ``ownerReference`` leads to the workload: a batch/v1 ``Job``
  (itself possibly owned by a ``jobset.x-k8s.io/v1alpha2`` ``JobSet``, itself possibly
  owned by a ``trainer.kubeflow.org/v1alpha1`` ``TrainJob``) or a ``kubeflow.org/v1``
  ``PyTorchJob``. When no pod exists (a stopped job), the workload is found by the same
  ``trainguard.io/job`` label on the workload object itself.
* Restarts go the workload's own way (``k8s.restart``): a JobSet's failurePolicy, a
  PyTorchJob's restartPolicy, suspend/resume otherwise; never half a gang.
* Ranks read the restart generation and resume step from their pod's annotations
  ``trainguard.io/generation`` / ``trainguard.io/resume-step``, which trainguard writes into
  the pod template; the pod template maps them to ``TRAINGUARD_GENERATION`` /
  ``TRAINGUARD_RESUME_STEP`` with the downward API. trainguard never edits containers:
  batch Jobs and JobSets refuse container changes, and the downward API works for all three.

Errors: every API failure becomes a :class:`KubernetesApiError` (an
:class:`~controller.actuators.base.ActuatorError` carrying the HTTP status), retryable for
409/429/5xx and an unreachable API server, permanent otherwise (403 names the missing RBAC
rule). Every patch is a JSON merge patch; those that rewrite a list (taints, a JobSet's
``replicatedJobs``) carry ``metadata.resourceVersion`` so a concurrent writer makes the API
answer 409 instead of being overwritten. A Node patch that gets 409 is re-read and tried
again at once; a workload's 409 (the JobSet controller writing its status between the
suspend and the resize-and-resume) is a retryable error, and the engine's next attempt
finishes the restart (the workload is left suspended, and the annotations say how far it got).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.actuators import kube_objects as ko
from controller.actuators.base import (
    ActuatorError,
    ActuatorResult,
    JobLimits,
    JobPolicy,
    NodeView,
    Placement,
)
from controller.actuators.k8s.api import Kube, load_api_client
from controller.actuators.k8s.events import EventRecorder
from controller.actuators.k8s.lease import LeaseElector
from controller.actuators.k8s.nodes import ANN_CORDONED_BY, NodeGuard, QuarantineSettings
from controller.actuators.k8s.placement import PlacementBook, running_placement, stale_reason
from controller.actuators.k8s.restart import job_limits
from controller.actuators.k8s.restart import restart_job as gang_restart
from controller.actuators.kube_objects import (
    ANN_GENERATION,
    ANN_ISOLATED,
    ANN_REPLICATED_JOB,
    ANN_RESUME_STEP,
    COMPONENT,
    ENV_GENERATION,
    JOB,
    JOBSET,
    KINDS,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_TP,
    MERGE_PATCH,
    PYTORCHJOB,
    RBAC_RULES,
    TAINT_KEY,
    TRAINJOB,
    KubernetesApiError,
    PolicyRule,
    Workload,
    WorkloadKind,
    rbac_rules_yaml,
)
from trainguard.wire import RankEvent

#: Client methods that change the cluster; each is fenced by the leader lease.
_WRITES = ("patch_", "create_", "delete_", "replace_")


class KubernetesActuator:
    """Acts on one namespace's training workloads and on the cluster's nodes."""

    name = "kubernetes"

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        *,
        delete_on_pdb_block: bool = True,
        node_event_namespace: str = "default",
        settle_timeout_s: float = 60.0,
        poll_interval_s: float = 0.5,
        quarantine: QuarantineSettings | None = None,
        book: PlacementBook | None = None,
    ) -> None:
        """``delete_on_pdb_block``: when stopping a job, delete a pod whose eviction a
        PodDisruptionBudget refuses (the job is being stopped as a whole, so the budget
        protects nothing). ``node_event_namespace``: where Events about Nodes go; the API
        accepts cluster-scoped objects' Events only in ``default``. ``settle_timeout_s``:
        how long a restart waits for a suspended batch Job's pods to be gone before it may
        change the pod template (the API refuses earlier). ``quarantine``: taint key and
        effect, condition type, drain scope (``k8s.nodes``). ``book``: the placements the
        ranks reported (``k8s.placement``), preferred over ``trainguard.io/rank`` labels."""
        self._api = api_client
        self.namespace = namespace
        self.delete_on_pdb_block = delete_on_pdb_block
        self.node_event_namespace = node_event_namespace
        self.settle_timeout_s = settle_timeout_s
        self.poll_interval_s = poll_interval_s
        self._core = client.CoreV1Api(api_client)
        self._batch = client.BatchV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self.kube = Kube(api_client)
        self.book = book if book is not None else PlacementBook()
        self.nodes = NodeGuard(
            self.kube,
            EventRecorder(self.kube, node_event_namespace=node_event_namespace),
            quarantine or QuarantineSettings(drain_namespaces=(namespace,)),
            fence_generation=lambda: self._elector.fence_generation() if self._elector else None,
        )
        self._elector: LeaseElector | None = None
        #: Per job: what its workload allows (``limits``) and its tp (``current_placement``).
        self._limits: dict[str, JobLimits] = {}
        self._tp: dict[str, int] = {}

    def fence_with(self, elector: LeaseElector) -> None:
        """Cluster mode: every write this actuator makes first asks ``elector`` whether this
        replica still surely leads, and Nodes carry its generation (``k8s.lease``)."""
        self._elector = elector
        self.kube.fence = elector.check

    @classmethod
    def from_environment(cls, namespace: str, **options: Any) -> KubernetesActuator:
        """In-cluster ServiceAccount credentials when running in a pod, else kubeconfig."""
        return cls(load_api_client(), namespace, **options)

    async def start(self) -> list[Placement]:
        """Nothing to launch: the workloads are the platform's, started by their owners."""
        return []

    def observe_ranks(self, node: str, events: Sequence[RankEvent]) -> None:
        """Learn each job's rank -> pod -> node placement from its ranks (``PlacementBook``)."""
        for event in events:
            self.book.observe(node, event)

    def forget_job(self, job: str) -> None:
        """A job the controller forgot (``job_retention_s``): its seats, limits and tp go, so
        the actuator does not grow with every job ever run; learned again if it reports."""
        self.book.forget(job)
        self._limits.pop(job, None)
        self._tp.pop(job, None)

    def limits(self, job: str) -> JobLimits | None:
        """The smallest data-parallel size the workload's own spec allows (elastic range or
        fixed torchrun ``--nnodes``), as read at the last :meth:`candidate_nodes` (which
        the engine calls just before); ``None``: nothing declared, the policy's apply."""
        return self._limits.get(job)

    async def node_view(self, node: str) -> NodeView:
        """The Node's ``Ready`` condition (a deleted Node: not ready) and whether the job
        namespace's pods on it still run: the engine's second signal before it quarantines a
        node whose agent went silent (``k8s.partition``)."""
        ready: bool | None = None
        try:
            obj = await self._call(f"get node {node}", self._core.read_node, node)
        except KubernetesApiError as exc:
            if exc.status != 404:
                raise
            ready = False
        else:
            ready = ko.node_ready(obj)
        pods = await self._call(
            f"list pods on node {node}",
            self._core.list_namespaced_pod,
            self.namespace,
            field_selector=f"spec.nodeName={node}",
        )
        live = [p for p in pods.get("items") or [] if not p["metadata"].get("deletionTimestamp")]
        running = (
            any((p.get("status") or {}).get("phase") == "Running" for p in live) if live else None
        )
        return NodeView(ready=ready, pods_running=running)

    async def job_policy(self, job: str) -> JobPolicy | None:
        """The workload's ``trainguard.io/policy`` annotation (``k8s.workloads.job_policy``;
        a bad one is a one-line :class:`ActuatorError`); ``None`` when it has none."""
        from controller.actuators.k8s.workloads import ANN_POLICY, job_policy

        w = await self._resolve(job)
        if not w.annotations.get(ANN_POLICY):
            return None
        p = job_policy(w.obj)
        return JobPolicy(p.steps, p.dry_run, p.max_restarts)

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)

    # -- API plumbing ------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run one client call in a thread; answer plain camelCase dicts, as the API sent.
        A write (patch, create, delete, replace) is fenced first: a deposed leader raises."""
        name = getattr(getattr(fn, "func", fn), "__name__", "")
        if self.kube.fence is not None and name.startswith(_WRITES):
            self.kube.fence()
        try:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            raise ko.api_error(what, exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise KubernetesApiError(
                f"{what}: Kubernetes API unreachable ({exc}); retry", status=0, retryable=True
            ) from exc
        except ValueError as exc:  # the client could not parse the answer into its models
            raise KubernetesApiError(
                f"{what}: unexpected answer from the Kubernetes API ({exc})",
                status=0,
                retryable=False,
            ) from exc
        return ko.plain(result.to_dict(serialize=True)) if hasattr(result, "to_dict") else result

    def _workload_api(self, kind: WorkloadKind) -> tuple[Callable[..., Any], ...]:
        """(get(name), patch(name, body), list(selector)) for ``kind`` in our namespace."""
        ns = self.namespace
        if kind is JOB:
            return (
                partial(self._batch.read_namespaced_job, namespace=ns),
                partial(self._batch.patch_namespaced_job, namespace=ns, _content_type=MERGE_PATCH),
                partial(self._batch.list_namespaced_job, ns),
            )
        g, v, pl = kind.group, kind.version, kind.plural
        custom = self._custom
        return (
            partial(custom.get_namespaced_custom_object, g, v, ns, pl),
            partial(custom.patch_namespaced_custom_object, g, v, ns, pl, _content_type=MERGE_PATCH),
            partial(custom.list_namespaced_custom_object, g, v, ns, pl),
        )

    async def _get_workload(self, kind: WorkloadKind, name: str) -> Workload:
        get = self._workload_api(kind)[0]
        obj = await self._call(f"get {kind.kind} {self.namespace}/{name}", get, name=name)
        return Workload(kind, name, obj)

    async def _patch_workload(self, w: Workload, body: dict[str, Any], what: str) -> Workload:
        patch = self._workload_api(w.kind)[1]
        obj = await self._call(f"{what} {w.label}", patch, name=w.name, body=body)
        return Workload(w.kind, w.name, obj, w.runtime)

    async def _list_workloads(self, kind: WorkloadKind, job: str) -> list[Workload]:
        list_ = self._workload_api(kind)[2]
        try:
            items = (
                await self._call(f"list {kind.plural}", list_, label_selector=f"{LABEL_JOB}={job}")
            )["items"]
        except KubernetesApiError as exc:
            if exc.status == 404:  # the CRD is not installed: no workloads of that kind
                return []
            if exc.status == 403 and kind is not JOB:
                # Its rule dropped (rbac.jobsets / rbac.pytorchjobs / a custom Role): the site
                # runs no such workloads; every other lookup still finds its own kind.
                return []
            raise
        found = [Workload(kind, item["metadata"]["name"], item) for item in items or []]
        if kind is TRAINJOB:  # its JobSet has its name (Kubeflow Trainer v2)
            for i, w in enumerate(found):
                try:
                    runtime = await self._get_workload(JOBSET, w.name)
                except KubernetesApiError as exc:
                    if exc.status != 404:
                        raise
                else:
                    found[i] = Workload(TRAINJOB, w.name, w.obj, runtime.obj)
        return found

    async def _above_jobset(self, w: Workload) -> Workload:
        """A JobSet a TrainJob controls is restarted and resized through that TrainJob
        (its controller would undo changes made to the JobSet directly)."""
        owner = ko.controller_ref(w.obj, "TrainJob")
        if owner is None:
            return w
        trainjob = await self._get_workload(TRAINJOB, owner["name"])
        return Workload(TRAINJOB, trainjob.name, trainjob.obj, w.obj)

    async def _job_pods(self, job: str) -> list[dict[str, Any]]:
        """The job's pods: labelled ``trainguard.io/job``, or named by its ranks' reports."""
        labelled = await self._labelled_pods(job)
        layout = self.book.layout(job)
        if layout is None:
            return labelled
        # Only pods the ranks reported in this namespace: a same-named pod here (two teams
        # deploying one example) belongs to another job, and taking it would act on the
        # wrong workload (found by the layout sweep).
        here = {s.pod for s in layout.seats.values() if s.namespace in ("", self.namespace)}
        names = here - {p["metadata"]["name"] for p in labelled}
        if not names:
            return labelled
        every = await self._call(
            f"list pods of job {job}", self._core.list_namespaced_pod, self.namespace
        )
        return labelled + [p for p in every.get("items") or [] if p["metadata"]["name"] in names]

    async def _labelled_pods(self, job: str) -> list[dict[str, Any]]:
        pods = await self._call(
            f"list pods of job {job}",
            self._core.list_namespaced_pod,
            self.namespace,
            label_selector=f"{LABEL_JOB}={job}",
        )
        return list(pods.get("items") or [])

    async def _resolve(self, job: str, pods: list[dict[str, Any]] | None = None) -> Workload:
        """The workload that owns ``job``'s pods (ownerReferences), else the labelled one."""
        pods = await self._job_pods(job) if pods is None else pods
        owners: set[tuple[str, str]] = set()
        for pod in pods:
            for ref in pod["metadata"].get("ownerReferences") or []:
                if ref.get("controller"):
                    owners.add((ref["kind"], ref["name"]))
        found: list[Workload] = []
        for kind_name, name in sorted(owners):
            if kind_name == "Job":
                w = await self._get_workload(JOB, name)
                parent = ko.controller_ref(w.obj, "JobSet")
                if parent:
                    w = await self._get_workload(JOBSET, parent["name"])
                    w = await self._above_jobset(w)
            elif kind_name == "PyTorchJob":
                w = await self._get_workload(PYTORCHJOB, name)
            else:
                raise ActuatorError(
                    f"pods of job {job!r} are owned by {kind_name} {name}; trainguard stops "
                    "and restarts only Job, JobSet, TrainJob and PyTorchJob workloads"
                )
            if all(x.label != w.label for x in found):
                found.append(w)
        if not owners:
            for kind in KINDS:
                for w in await self._list_workloads(kind, job):
                    found.append(await self._above_jobset(w) if w.kind is JOBSET else w)
            found = list({w.label: w for w in found}.values())
        if not found:
            pods_said = f"{len(pods)} pod(s) but none owned by a workload" if pods else "no pods"
            raise ActuatorError(
                f"job {job!r} not found in namespace {self.namespace}: {pods_said}, and no "
                f"Job/JobSet/PyTorchJob/TrainJob labelled {LABEL_JOB}={job}"
            )
        if len(found) > 1:
            names = ", ".join(w.label for w in found)
            raise ActuatorError(f"job {job!r} maps to several workloads ({names}); label one")
        return found[0]

    # -- events ------------------------------------------------------------------------

    async def _event(self, obj: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        """A core/v1 Event about ``obj`` (``k8s.events``; a Node's goes to
        ``node_event_namespace``); raises when it could not be written."""
        error = await self.nodes.events.emit(obj, reason, message, warning=warning)
        if error:
            raise ActuatorError(error)

    async def _try_event(self, coro: Awaitable[None], details: dict[str, Any]) -> None:
        """An Event is a courtesy: failing to write one must not fail the action."""
        try:
            await coro
        except ActuatorError as exc:
            details["event_error"] = str(exc)

    async def record_event(
        self, *, target: str, reason: str, message: str, warning: bool = False
    ) -> None:
        """``target``: ``node/<name>``, ``job/<name>``, or a bare name (a Node if one is
        called so, else a job)."""
        kind, _, name = target.rpartition("/")
        if kind not in ("", "node", "job"):
            raise ActuatorError(f"event target {target!r}: use node/<name> or job/<name>")
        if kind in ("", "node"):
            try:
                node = await self._call(f"get node {name}", self._core.read_node, name)
            except KubernetesApiError as exc:
                if exc.status != 404 or kind == "node":
                    raise
            else:
                await self._event(node, reason, message, warning)
                return
        await self._event((await self._resolve(name)).obj, reason, message, warning)

    # -- nodes -------------------------------------------------------------------------

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        """Cordon, taint, condition TrainguardHealthy=False: :meth:`NodeGuard.quarantine`."""
        return await self.nodes.quarantine(node, reason=reason, message=f"trainguard: {reason}")

    async def release_node(self, node: str, *, reason: str) -> ActuatorResult:
        """Undo only what trainguard did: :meth:`NodeGuard.release`."""
        return await self.nodes.release(node, reason=f"trainguard: {reason}")

    async def drain_node(self, node: str, *, reason: str) -> ActuatorResult:
        """Evict the node's pods through the eviction API: :meth:`NodeGuard.drain`."""
        return await self.nodes.drain(node, reason=reason)

    async def candidate_nodes(self, job: str) -> list[str]:
        w = await self._resolve(job)
        layout = self.book.layout(job)
        per_pod = len(next(iter(layout.pods().values()))) if layout is not None else 1
        own = job_limits(w, per_pod, self._tp.get(job, 1))
        if own is None:
            self._limits.pop(job, None)
        else:
            self._limits[job] = own
        selector = ko.node_selector(w)
        nodes = await self._call(
            "list nodes",
            self._core.list_node,
            label_selector=",".join(f"{k}={v}" for k, v in sorted(selector.items())) or None,
        )
        tolerations = ko.tolerations(w)
        out = []
        for n in nodes.get("items") or []:
            ours = ANN_CORDONED_BY in ko.annotations_of(n)
            if n.get("spec", {}).get("unschedulable") and not ours:
                continue  # cordoned by someone else: not ours to use
            if ko.node_not_ready(n):
                continue  # Ready False or Unknown: no pod would start there
            if any(
                not (ours and t.get("key") == TAINT_KEY) and not ko.tolerated(t, tolerations)
                for t in n.get("spec", {}).get("taints") or []
                if t.get("effect") in ("NoSchedule", "NoExecute")
            ):
                continue  # someone else's taint the job's pods do not tolerate
            out.append(n["metadata"]["name"])
        return sorted(out)

    # -- pods --------------------------------------------------------------------------

    async def _remove_pods(self, pods: list[dict[str, Any]], details: dict[str, Any]) -> None:
        """Evict each pod (graceful, honours PDBs); delete it when a PDB refuses and
        ``delete_on_pdb_block`` allows, else report it blocked."""
        for pod in pods:
            name = pod["metadata"]["name"]
            if pod["metadata"].get("deletionTimestamp"):
                continue
            eviction = client.V1Eviction(
                api_version="policy/v1",
                kind="Eviction",
                metadata=client.V1ObjectMeta(name=name, namespace=self.namespace),
            )
            try:
                await self._call(
                    f"evict pod {name}",
                    self._core.create_namespaced_pod_eviction,
                    name,
                    self.namespace,
                    eviction,
                )
                details.setdefault("evicted", []).append(name)
                continue
            except KubernetesApiError as exc:
                if exc.status == 404:
                    continue
                if exc.status != 429 or "disruption budget" not in str(exc).lower():
                    raise
                if not self.delete_on_pdb_block:
                    details.setdefault("blocked_by_pdb", []).append(name)
                    continue
            try:
                await self._call(
                    f"delete pod {name}",
                    self._core.delete_namespaced_pod,
                    name,
                    self.namespace,
                )
            except KubernetesApiError as exc:
                if exc.status != 404:
                    raise
            details.setdefault("deleted_despite_pdb", []).append(name)

    async def stop_job(self, job: str, *, reason: str) -> ActuatorResult:
        pods = await self._job_pods(job)
        w = await self._resolve(job, pods)
        details: dict[str, Any] = {"workload": w.label}
        suspended_now = False
        if not w.suspended:
            w = await self._patch_workload(w, ko.nest(w.kind.suspend_path, True), "suspend")
            suspended_now = True
        await self._remove_pods(pods, details)
        removed = len(details.get("evicted", [])) + len(details.get("deleted_despite_pdb", []))
        if not suspended_now and not removed and not details.get("blocked_by_pdb"):
            details["already"] = True
            return ActuatorResult(
                outcome=f"job {job} already stopped ({w.label} suspended, no pods left)",
                details=details,
            )
        outcome = f"job {job} stopped: {w.label} suspended, {removed} pod(s) removed"
        if details.get("blocked_by_pdb"):
            outcome += f", {len(details['blocked_by_pdb'])} kept by a PodDisruptionBudget"
        await self._try_event(
            self._event(w.obj, "JobStopped", f"trainguard: {reason}", True), details
        )
        return ActuatorResult(outcome=outcome, details=details)

    async def current_placement(self, job: str) -> Placement | None:
        """From what the ranks reported (pod, node per rank) while those pods exist, in any
        phase, else ``trainguard.io/rank`` labels; generation and resume step from the
        gang's pods' annotations."""
        pods = await self._job_pods(job)
        layout = self.book.layout(job)
        learned = None if layout is None else running_placement(layout, pods)
        stale = None if layout is None else stale_reason(layout, pods)
        placement = learned if learned is not None else ko.placement_of(job, pods, stale)
        if placement is not None:
            self._tp[job] = placement.tp
        return placement

    # -- restart -----------------------------------------------------------------------

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        """Restart the whole gang the workload's own way (``k8s.restart``)."""
        return await gang_restart(self, placement, reason)


# -- per-kind spec surgery (pure functions of the workload object) ---------------------


__all__ = [
    "ANN_GENERATION",
    "ANN_ISOLATED",
    "ANN_REPLICATED_JOB",
    "ANN_RESUME_STEP",
    "COMPONENT",
    "ENV_GENERATION",
    "JOB",
    "JOBSET",
    "KINDS",
    "LABEL_JOB",
    "LABEL_RANK",
    "LABEL_TP",
    "MERGE_PATCH",
    "PYTORCHJOB",
    "RBAC_RULES",
    "TAINT_KEY",
    "KubernetesActuator",
    "KubernetesApiError",
    "PolicyRule",
    "Workload",
    "WorkloadKind",
    "rbac_rules_yaml",
]
