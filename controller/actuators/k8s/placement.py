"""A job's placement learned from its own ranks, and its workload found from its pods.

Real training workloads (JobSet, Kubeflow TrainJob, PyTorchJob, indexed Jobs) stamp one pod
template for every worker and run several ranks per pod (torchrun), so no per-pod
``trainguard.io/rank`` label can say where rank 13 runs. Each instrumented rank says it
instead: its hello and rank events carry the global rank, local rank, world size, pod and
namespace (downward API, ``trainguard.podinfo``), and the node agent that forwards them is
the node. :class:`PlacementBook` keeps the latest seat of every rank and answers the
layout: rank -> pod -> node. Labels stay optional overrides (``trainguard.io/rank`` on a pod
that runs exactly one rank).

:func:`workload_hint` names a pod's workload from its labels and owner references without
a call; :func:`resolve_workload` follows the ``ownerReferences`` chain through the API (pod
-> Job -> JobSet -> TrainJob) to the object that owns the whole gang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.api import Kube
from controller.actuators.kube_objects import count_of, pod_generation
from controller.logic.remediation.placement import Placement
from trainguard.wire import RankEvent

LABEL_RANK: Final = "trainguard.io/rank"
LABEL_TP: Final = "trainguard.io/tp"
ANN_GENERATION: Final = "trainguard.io/generation"
ANN_RESUME_STEP: Final = "trainguard.io/resume-step"
JOBSET_NAME: Final = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB: Final = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_JOB_INDEX: Final = "jobset.sigs.k8s.io/job-index"
TRAINJOB_NAME: Final = "trainer.kubeflow.org/trainjob-name"
KUBEFLOW_JOB_NAME: Final = "training.kubeflow.org/job-name"
KUBEFLOW_REPLICA_TYPE: Final = "training.kubeflow.org/replica-type"
KUBEFLOW_REPLICA_INDEX: Final = "training.kubeflow.org/replica-index"
JOB_NAME: Final = "batch.kubernetes.io/job-name"
JOB_COMPLETION_INDEX: Final = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True, slots=True)
class Seat:
    rank: int
    local_rank: int | None
    pod: str
    namespace: str
    node: str


@dataclass(frozen=True, slots=True)
class JobLayout:
    job: str
    world_size: int
    seats: dict[int, Seat]

    @property
    def complete(self) -> bool:
        return sorted(self.seats) == list(range(self.world_size))

    @property
    def namespace(self) -> str:
        spaces = {s.namespace for s in self.seats.values() if s.namespace}
        if len(spaces) > 1:
            raise ActuatorError(f"job {self.job!r} has ranks in several namespaces: {spaces}")
        return spaces.pop() if spaces else ""

    def pods(self) -> dict[str, list[int]]:
        """Pod -> its ranks, pods in the order of their lowest rank."""
        out: dict[str, list[int]] = {}
        for rank in sorted(self.seats):
            out.setdefault(self.seats[rank].pod, []).append(rank)
        return out

    def nodes(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank in sorted(self.seats):
            out.setdefault(self.seats[rank].node, []).append(rank)
        return out

    def pods_on(self, node: str) -> list[str]:
        return sorted({s.pod for s in self.seats.values() if s.node == node and s.pod})

    def placement(
        self, *, generation: int = 0, tp: int = 1, resume_step: int | None = None
    ) -> Placement:
        """The engine's :class:`Placement`: nodes by lowest rank, ranks contiguous per node."""
        if not self.complete:
            missing = sorted(set(range(self.world_size)) - set(self.seats))
            raise ActuatorError(
                f"job {self.job!r}: ranks {missing[:8]} have not reported their pod yet"
            )
        per_node = self.nodes()
        counts = {len(r) for r in per_node.values()}
        contiguous = all(r == list(range(r[0], r[0] + len(r))) for r in per_node.values())
        if len(counts) != 1 or not contiguous:
            shape = {n: len(r) for n, r in per_node.items()}
            raise ActuatorError(
                f"job {self.job!r} runs ranks unevenly or interleaved across nodes ({shape}); "
                "no placement describes it"
            )
        try:
            return Placement(
                job=self.job,
                nodes=tuple(per_node),
                ranks_per_node=counts.pop(),
                tp=tp,
                generation=generation,
                resume_step=resume_step,
            )
        except ValueError as exc:
            raise ActuatorError(f"job {self.job!r}: {exc}") from exc


class PlacementBook:
    """Every job's seats, from the rank events the node agents forward."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[int, dict[int, Seat]]] = {}

    def observe(self, node: str, event: RankEvent) -> None:
        """A rank event that ``node``'s agent forwarded; a new world size starts over."""
        if event.kind == "exited" or not event.pod or event.world_size is None:
            return
        world, seats = self._jobs.get(event.job, (event.world_size, {}))
        if world != event.world_size:
            world, seats = event.world_size, {}
        seats[event.rank] = Seat(
            event.rank, event.local_rank, event.pod, event.namespace or "", node
        )
        self._jobs[event.job] = (world, seats)

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def layout(self, job: str, pods: list[dict[str, Any]] | None = None) -> JobLayout | None:
        """The job's layout; ``pods`` (API objects) add label overrides and fill ranks that
        have not spoken yet from ``trainguard.io/rank`` labels."""
        world, seats = self._jobs.get(job, (0, {}))
        seats = dict(seats)
        for pod in pods or []:
            raw = (pod["metadata"].get("labels") or {}).get(LABEL_RANK, "")
            node = (pod.get("spec") or {}).get("nodeName") or ""
            rank = count_of(raw)
            if rank is not None and node:
                meta = pod["metadata"]
                seats[rank] = Seat(rank, None, meta["name"], meta.get("namespace", ""), node)
        if not seats:
            return None
        return JobLayout(job, max(world, max(seats) + 1), seats)


def stale_reason(layout: JobLayout, pods: list[dict[str, Any]]) -> str | None:
    """Why the ranks' reports no longer describe the job's gang (``None``: they do).

    A pod the ranks reported that still exists is part of the current gang whatever its
    phase (Running, Pending on its node, Unknown, Failed after a rank crash, Terminating on
    a node that stopped answering): its node is exactly the one to move off. The reports
    are stale only when a reported pod no longer exists (the workload's controller or a
    restart replaced the gang and the new pods have not reported yet), or when other pods
    of the job carry a newer ``trainguard.io/generation`` (a new generation is starting)."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    reported = list(layout.pods())
    gone = [name for name in reported if name not in by_name]
    if gone:
        return f"the pods its ranks reported from are gone ({sorted(gone)[:8]})"
    gens = {name: pod_generation(p) for name, p in by_name.items()}
    ours = max((g for n in reported if (g := gens[n]) is not None), default=-1)
    newer = sorted(
        name for name, g in gens.items() if name not in reported and g is not None and g > ours
    )
    if newer:
        return f"pods {newer[:8]} of a newer generation have not reported yet"
    return None


def running_placement(layout: JobLayout, pods: list[dict[str, Any]]) -> Placement | None:
    """``layout``'s placement while the pods the ranks named still exist (``None``: the
    reports are stale or incomplete, see :func:`stale_reason`); generation (the newest
    among the gang's pods), resume step and tp from the pods' annotations and labels."""
    if not layout.complete or stale_reason(layout, pods) is not None:
        return None
    by_name = {p["metadata"]["name"]: p for p in pods}
    gang = [by_name[name] for name in layout.pods()]
    first = gang[0]
    meta = {
        **(first["metadata"].get("annotations") or {}),
        **(first["metadata"].get("labels") or {}),
    }
    return layout.placement(
        generation=max((g for p in gang if (g := pod_generation(p)) is not None), default=0),
        tp=count_of(meta.get(LABEL_TP)) or 1,
        resume_step=count_of(meta.get(ANN_RESUME_STEP)),
    )


# -- the workload that owns a pod ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    kind: str  # "JobSet", "TrainJob", "PyTorchJob" or "Job"
    group: str
    version: str
    plural: str
    name: str
    namespace: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


KIND_API: Final = {
    "Job": ("batch", "v1", "jobs"),
    "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
}


def ref(kind: str, name: str, namespace: str) -> WorkloadRef:
    group, version, plural = KIND_API[kind]
    return WorkloadRef(kind, group, version, plural, name, namespace)


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def workload_hint(pod: dict[str, Any]) -> WorkloadRef | None:
    """The pod's workload from its labels and controller reference alone (no API call).
    A TrainJob shows only through its JobSet's owner: :func:`resolve_workload` finds it."""
    meta = pod["metadata"]
    labels, ns = meta.get("labels") or {}, meta.get("namespace", "")
    owner = _controller(pod) or {}
    if TRAINJOB_NAME in labels:
        return ref("TrainJob", labels[TRAINJOB_NAME], ns)
    if JOBSET_NAME in labels:
        return ref("JobSet", labels[JOBSET_NAME], ns)
    if owner.get("kind") == "PyTorchJob" or KUBEFLOW_JOB_NAME in labels:
        return ref("PyTorchJob", owner.get("name") or labels[KUBEFLOW_JOB_NAME], ns)
    if owner.get("kind") == "Job":
        return ref("Job", owner["name"], ns)
    if JOB_NAME in labels:
        return ref("Job", labels[JOB_NAME], ns)
    return None


async def resolve_workload(kube: Kube, pod: dict[str, Any]) -> WorkloadRef:
    """Follow controller references up from ``pod`` to the object that owns the gang."""
    ns = pod["metadata"].get("namespace", "")
    obj, found = pod, None
    for _ in range(4):  # pod -> Job -> JobSet -> TrainJob at most
        owner = _controller(obj)
        if owner is None or owner.get("kind") not in KIND_API:
            break
        found = ref(owner["kind"], owner["name"], ns)
        obj = await read_workload(kube, found)
    if found is None:
        hint = workload_hint(pod)
        if hint is None:
            raise ActuatorError(
                f"pod {ns}/{pod['metadata']['name']} belongs to no Job, JobSet, TrainJob or "
                "PyTorchJob; trainguard restarts only those"
            )
        found = hint
    return found


async def read_workload(kube: Kube, w: WorkloadRef) -> dict[str, Any]:
    what = f"get {w.label}"
    if w.kind == "Job":
        job: dict[str, Any] = await kube.read(
            what, kube.batch.read_namespaced_job, w.name, w.namespace
        )
        return job
    obj: dict[str, Any] = await kube.read(
        what,
        kube.custom.get_namespaced_custom_object,
        w.group,
        w.version,
        w.namespace,
        w.plural,
        w.name,
    )
    return obj


__all__ = [
    "JobLayout",
    "PlacementBook",
    "Seat",
    "WorkloadRef",
    "read_workload",
    "resolve_workload",
    "running_placement",
    "stale_reason",
    "workload_hint",
]
