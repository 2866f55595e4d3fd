"""Keep jobs off bad nodes the way Kubernetes tools do, and only undo what trainguard did.

Quarantine = cordon (``spec.unschedulable``) + taint ``trainguard.io/unhealthy=<reason>``
(``NoSchedule``; ``NoExecute`` only when the settings opt in, since it evicts every pod
without a toleration) + a Node condition ``TrainguardHealthy=False`` with a reason and a
message, like node-problem-detector writes, so schedulers, autoscalers and dashboards see
it. The annotation ``trainguard.io/cordoned-by`` records what trainguard changed (whether
the node was already cordoned by someone else, whether the taint was new): release removes
exactly that and never uncordons a node that someone else cordoned.

Writes use the node's ``resourceVersion`` as a precondition (a concurrent writer makes the
API answer 409; the guard re-reads and tries again) and carry the leader's fence
generation in ``trainguard.io/fence``: a deposed leader that still holds an older
generation finds a newer one on the node and stops (:class:`~.api.Fenced`).

Drain evicts the node's pods through the eviction API so PodDisruptionBudgets hold: a 429
is retried with exponential backoff for up to ``drain_timeout_s`` of waiting; DaemonSet
pods, mirror pods and pods already terminating are left alone, as ``kubectl drain`` does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kubernetes import client

from controller.actuators.base import ActuatorError, ActuatorResult
from controller.actuators.k8s.api import (
    MERGE_PATCH,
    STRATEGIC_PATCH,
    Fenced,
    Kube,
    KubernetesApiError,
    now_rfc3339,
)
from controller.actuators.k8s.events import EventRecorder

TAINT_KEY: Final = "trainguard.io/unhealthy"
CONDITION_TYPE: Final = "TrainguardHealthy"
ANN_CORDONED_BY: Final = "trainguard.io/cordoned-by"
ANN_FENCE: Final = "trainguard.io/fence"
MIRROR_ANNOTATION: Final = "kubernetes.io/config.mirror"
_CONFLICT_TRIES: Final = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantineSettings:
    taint_key: str = TAINT_KEY
    #: ``NoExecute`` also evicts running pods that do not tolerate the taint; opt-in.
    taint_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    allow_no_execute: bool = False
    condition_type: str = CONDITION_TYPE
    #: Namespaces whose pods :meth:`NodeGuard.drain` evicts (trainguard's RBAC is there).
    drain_namespaces: tuple[str, ...] = ("default",)
    drain_timeout_s: float = 120.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.taint_effect == "NoExecute" and not self.allow_no_execute:
            raise ValueError(
                "taint effect NoExecute evicts every pod without a toleration; set "
                "allow_no_execute to opt in"
            )


def taint_value(reason: str) -> str:
    """``reason`` as a valid label value (63 chars of ``[A-Za-z0-9._-]``, alnum at ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", reason).strip("-._")[:63].strip("-._")
    return value or "unhealthy"


def condition_reason(reason: str) -> str:
    """``xid-79 fatal`` -> ``Xid79Fatal``: the CamelCase Kubernetes condition reasons use."""
    words = re.findall(r"[A-Za-z0-9]+", reason)
    return "".join(w[:1].upper() + w[1:] for w in words)[:128] or "Unhealthy"


@dataclass(slots=True)
class DrainReport:
    evicted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    retries: int = 0


class NodeGuard:
    def __init__(
        self,
        kube: Kube,
        events: EventRecorder,
        settings: QuarantineSettings | None = None,
        *,
        fence_generation: Callable[[], int | None] = lambda: None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.kube = kube
        self.events = events
        self.settings = settings or QuarantineSettings()
        self.fence_generation = fence_generation
        self.sleep = sleep

    # -- helpers -----------------------------------------------------------------------

    async def _node(self, name: str) -> dict[str, Any]:
        node: dict[str, Any] = await self.kube.read(
            f"get node {name}", self.kube.core.read_node, name
        )
        return node

    def _fence_annotations(self, node: dict[str, Any]) -> dict[str, str]:
        """Refuse to write over a newer leader's mark; return ours to write."""
        mine = self.fence_generation()
        if mine is None:
            return {}
        seen = (node["metadata"].get("annotations") or {}).get(ANN_FENCE, "")
        if seen.isdigit() and int(seen) > mine:
            raise Fenced(
                f"node {node['metadata']['name']} was written by leader generation {seen}; "
                f"this replica holds {mine} and stops acting"
            )
        return {ANN_FENCE: str(mine)}

    async def _patch_spec(self, name: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        patched: dict[str, Any] = await self.kube.write(
            f"{what} node {name}",
            self.kube.core.patch_node,
            name,
            body,
            _content_type=MERGE_PATCH,
        )
        return patched

    async def _set_condition(self, name: str, healthy: bool, reason: str, message: str) -> None:
        now = now_rfc3339()
        condition = {
            "type": self.settings.condition_type,
            "status": "True" if healthy else "False",
            "reason": condition_reason(reason),
            "message": message[:1024],
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        await self.kube.write(
            f"set condition {self.settings.condition_type} on node {name}",
            self.kube.core.patch_node_status,
            name,
            {"status": {"conditions": [condition]}},
            _content_type=STRATEGIC_PATCH,
        )

    # -- quarantine / release ------------------------------------------------------------

    async def quarantine(self, name: str, *, reason: str, message: str) -> ActuatorResult:
        """Cordon, taint and mark ``name`` unhealthy; idempotent, 409s retried."""
        s = self.settings
        value = taint_value(reason)
        for _ in range(_CONFLICT_TRIES):
            node = await self._node(name)
            fence = self._fence_annotations(node)
            annotations = node["metadata"].get("annotations") or {}
            taints: list[dict[str, Any]] = list(node.get("spec", {}).get("taints") or [])
            mine = [t for t in taints if t.get("key") == s.taint_key]
            cordoned = bool(node.get("spec", {}).get("unschedulable"))
            previous = json.loads(annotations.get(ANN_CORDONED_BY) or "{}")
            want = {"key": s.taint_key, "value": value, "effect": s.taint_effect}
            # Quarantined already (perhaps for another reason): the first reason stays, so
            # a repeated detection does not churn the Node and its watchers.
            if previous and cordoned and [t.get("effect") for t in mine] == [s.taint_effect]:
                return ActuatorResult(
                    outcome=f"node {name} already quarantined", details={"already": True}
                )
            record = {
                "by": "trainguard",
                "instance": self.events.instance,
                "reason": reason,
                "at": now_rfc3339(),
                # Kept from the first quarantine: what trainguard itself changed.
                "cordoned": bool(previous.get("cordoned")) or not cordoned,
                "tainted": bool(previous.get("tainted")) or not mine,
            }
            taints = [t for t in taints if t.get("key") != s.taint_key] + [want]
            body = {
                "metadata": {
                    "resourceVersion": node["metadata"]["resourceVersion"],
                    "annotations": {ANN_CORDONED_BY: json.dumps(record), **fence},
                },
                "spec": {"unschedulable": True, "taints": taints},
            }
            try:
                patched = await self._patch_spec(name, body, "quarantine")
            except KubernetesApiError as exc:
                if exc.status == 409:
                    continue
                raise
            await self._set_condition(name, False, reason, message)
            details: dict[str, Any] = {
                "cordoned": record["cordoned"],
                "tainted": record["tainted"],
                "taint": f"{s.taint_key}={value}:{s.taint_effect}",
            }
            error = await self.events.emit(
                patched, "TrainguardQuarantined", f"{reason}: {message}", warning=True
            )
            if error:
                details["event_error"] = error
            return ActuatorResult(
                outcome=f"node {name} cordoned, tainted {details['taint']}", details=details
            )
        raise ActuatorError(
            f"quarantine node {name}: kept changing under us; retry", retryable=True
        )

    async def release(self, name: str, *, reason: str) -> ActuatorResult:
        """Undo :meth:`quarantine`: only the cordon and taint trainguard itself added."""
        s = self.settings
        for _ in range(_CONFLICT_TRIES):
            node = await self._node(name)
            raw = (node["metadata"].get("annotations") or {}).get(ANN_CORDONED_BY)
            if raw is None:
                return ActuatorResult(
                    outcome=f"node {name} was not cordoned by trainguard; left as it is",
                    details={"already": True},
                )
            fence = self._fence_annotations(node)
            record = json.loads(raw)
            spec: dict[str, Any] = {}
            if record.get("tainted", True):
                taints = node.get("spec", {}).get("taints") or []
                spec["taints"] = [t for t in taints if t.get("key") != s.taint_key] or None
            if record.get("cordoned", True):
                spec["unschedulable"] = None
            body = {
                "metadata": {
                    "resourceVersion": node["metadata"]["resourceVersion"],
                    "annotations": {ANN_CORDONED_BY: None, **fence},
                },
                "spec": spec,
            }
            try:
                patched = await self._patch_spec(name, body, "release")
            except KubernetesApiError as exc:
                if exc.status == 409:
                    continue
                raise
            await self._set_condition(name, True, "Released", reason)
            details: dict[str, Any] = {
                "uncordoned": "unschedulable" in spec,
                "untainted": "taints" in spec,
            }
            error = await self.events.emit(patched, "TrainguardReleased", reason)
            if error:
                details["event_error"] = error
            return ActuatorResult(outcome=f"node {name} released", details=details)
        raise ActuatorError(f"release node {name}: kept changing under us; retry", retryable=True)

    # -- drain ---------------------------------------------------------------------------

    async def drain(self, name: str, *, reason: str) -> ActuatorResult:
        """Evict the node's pods (in ``drain_namespaces``), PDBs respected, 429 retried."""
        s = self.settings
        report = DrainReport()
        pending: list[dict[str, Any]] = []
        for ns in s.drain_namespaces:
            pods = await self.kube.read(
                f"list pods on node {name} in {ns}",
                self.kube.core.list_namespaced_pod,
                ns,
                field_selector=f"spec.nodeName={name}",
            )
            for pod in pods.get("items") or []:
                meta = pod["metadata"]
                label = f"{meta['namespace']}/{meta['name']}"
                owners = {r.get("kind") for r in meta.get("ownerReferences") or []}
                if (
                    "DaemonSet" in owners
                    or MIRROR_ANNOTATION in (meta.get("annotations") or {})
                    or meta.get("deletionTimestamp")
                ):
                    report.skipped.append(label)
                else:
                    pending.append(pod)
        waited, delay = 0.0, s.backoff_initial_s
        while pending:
            blocked = []
            for pod in pending:
                if not await self._evict(pod):
                    blocked.append(pod)
                else:
                    meta = pod["metadata"]
                    report.evicted.append(f"{meta['namespace']}/{meta['name']}")
            pending = blocked
            if not pending or waited + delay > s.drain_timeout_s:
                break
            report.retries += 1
            waited += delay
            await self.sleep(delay)
            delay = min(delay * 2, s.backoff_max_s)
        report.blocked = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pending]
        details: dict[str, Any] = {
            "evicted": report.evicted,
            "skipped": report.skipped,
            "blocked_by_pdb": report.blocked,
            "retries": report.retries,
        }
        outcome = f"node {name} drained: {len(report.evicted)} pod(s) evicted"
        if report.blocked:
            outcome += f", {len(report.blocked)} kept by a PodDisruptionBudget"
        node = await self._node(name)
        error = await self.events.emit(
            node, "TrainguardDrained", f"{outcome}: {reason}", warning=bool(report.blocked)
        )
        if error:
            details["event_error"] = error
        return ActuatorResult(outcome=outcome, details=details)

    async def _evict(self, pod: dict[str, Any]) -> bool:
        """True once the pod is gone (evicted now or already); False when a PDB refuses."""
        meta = pod["metadata"]
        body = client.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=client.V1ObjectMeta(name=meta["name"], namespace=meta["namespace"]),
        )
        try:
            await self.kube.write(
                f"evict pod {meta['namespace']}/{meta['name']}",
                self.kube.core.create_namespaced_pod_eviction,
                meta["name"],
                meta["namespace"],
                body,
            )
        except KubernetesApiError as exc:
            if exc.status == 404:
                return True
            if exc.status == 429:
                return False
            raise
        return True


__all__ = [
    "ANN_CORDONED_BY",
    "ANN_FENCE",
    "CONDITION_TYPE",
    "TAINT_KEY",
    "DrainReport",
    "NodeGuard",
    "QuarantineSettings",
    "condition_reason",
    "taint_value",
]
