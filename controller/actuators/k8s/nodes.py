"""Keep jobs off bad nodes the way Kubernetes tools do, and only undo what trainguard did.

Quarantine = cordon (``spec.unschedulable``) + taint ``trainguard.io/unhealthy=<reason>``
(``NoSchedule``; ``NoExecute`` only when the settings opt in, since it evicts every pod
without a toleration) + a Node condition ``TrainguardHealthy=False`` with a reason and a
message, like node-problem-detector writes, so schedulers, autoscalers and dashboards see
it. The annotation ``trainguard.io/cordoned-by`` records what trainguard changed (whether
the node was already cordoned by someone else, which taint trainguard added): release removes
exactly that and never uncordons a node that someone else cordoned. Another party's taint
with trainguard's key is never changed (see :meth:`NodeGuard._taint_plan`), and a retry of a
half-done quarantine (the status patch failed) writes only what is missing.

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

from controller.actuators import kube_objects as ko
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
#: How firmly a taint effect keeps pods off a node.
_EFFECT_RANK: Final = {"PreferNoSchedule": 0, "NoSchedule": 1, "NoExecute": 2}


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


def _taint_str(taint: dict[str, Any]) -> str:
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + value if value else ''}:{taint.get('effect')}"


def _recorded_taint(record: dict[str, Any], key: str, effect: str) -> dict[str, Any] | None:
    """The taint a quarantine record says trainguard added (``None``: it added none)."""
    if not record:
        return None
    if "taint" in record:
        taint: dict[str, Any] | None = record["taint"]
        return taint
    # Older records keep only ``tainted``: trainguard's taint had the settings' effect.
    return {"key": key, "effect": effect} if record.get("tainted", True) else None


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
        fence = ko.count_of(seen)
        if fence is not None and fence > mine:
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

    def _taint_plan(
        self, taints: list[dict[str, Any]], previous: dict[str, Any], value: str
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bool]:
        """(trainguard's taint to have, taints with its key found from others, add it now?).

        Another party's taint with trainguard's key is never changed. When its effect keeps
        pods off at least as firmly as trainguard's (``NoExecute`` >= ``NoSchedule`` >=
        ``PreferNoSchedule``) trainguard adds none; when it is weaker trainguard adds its
        own next to it (taints are unique by key *and* effect, so both are valid).
        """
        s = self.settings
        ours = _recorded_taint(previous, s.taint_key, s.taint_effect)
        keyed = [t for t in taints if t.get("key") == s.taint_key]
        present = [t for t in keyed if ours is not None and t.get("effect") == ours["effect"]]
        foreign = [t for t in keyed if t not in present]
        if present:
            return ours, foreign, False
        strongest = max((_EFFECT_RANK.get(t.get("effect", ""), 0) for t in foreign), default=-1)
        if strongest >= _EFFECT_RANK[s.taint_effect]:
            return None, foreign, False
        return {"key": s.taint_key, "value": value, "effect": s.taint_effect}, foreign, True

    def _condition_set(self, node: dict[str, Any]) -> bool:
        return ko.condition_status(node, self.settings.condition_type) == "False"

    async def quarantine(self, name: str, *, reason: str, message: str) -> ActuatorResult:
        """Cordon, taint and mark ``name`` unhealthy; idempotent, 409s retried.

        A retry after a half-done quarantine (the spec patched, the condition not) completes
        whatever part is missing; the first reason stays.
        """
        s = self.settings
        value = taint_value(reason)
        for _ in range(_CONFLICT_TRIES):
            node = await self._node(name)
            fence = self._fence_annotations(node)
            annotations = node["metadata"].get("annotations") or {}
            taints: list[dict[str, Any]] = list(node.get("spec", {}).get("taints") or [])
            cordoned = bool(node.get("spec", {}).get("unschedulable"))
            previous = json.loads(annotations.get(ANN_CORDONED_BY) or "{}")
            ours, foreign, add = self._taint_plan(taints, previous, value)
            condition_done = self._condition_set(node)
            spec_done = bool(previous) and cordoned and not add
            # Quarantined already (perhaps for another reason): the first reason stays, so
            # a repeated detection does not churn the Node and its watchers.
            if spec_done and condition_done:
                return ActuatorResult(
                    outcome=f"node {name} already quarantined", details={"already": True}
                )
            record = dict(previous) or {
                "by": "trainguard",
                "instance": self.events.instance,
                "reason": reason,
                "at": now_rfc3339(),
            }
            # What trainguard itself changed, kept from the first quarantine.
            record["cordoned"] = bool(previous.get("cordoned")) or not cordoned
            record["tainted"] = ours is not None
            record["taint"] = ours
            record["kept_taints"] = [_taint_str(t) for t in foreign]
            taint_desc = (
                f"tainted {_taint_str(ours)}"
                if ours is not None
                else "kept the existing taint " + ", ".join(record["kept_taints"])
            )
            patched = node
            if not spec_done:
                body = {
                    "metadata": {
                        "resourceVersion": node["metadata"]["resourceVersion"],
                        "annotations": {ANN_CORDONED_BY: json.dumps(record), **fence},
                    },
                    "spec": {
                        "unschedulable": True,
                        "taints": [*taints, ours] if add and ours is not None else taints,
                    },
                }
                try:
                    patched = await self._patch_spec(name, body, "quarantine")
                except KubernetesApiError as exc:
                    if exc.status == 409:
                        continue
                    raise
            try:
                if not condition_done:
                    await self._set_condition(name, False, reason, message)
            except KubernetesApiError as exc:
                what = "was already cordoned" if spec_done else "is now cordoned"
                raise KubernetesApiError(
                    f"quarantine node {name} half done: it {what} and {taint_desc}, but "
                    f"condition {s.condition_type}=False is not set ({exc}); a retry of the "
                    "isolation sets it",
                    status=exc.status,
                    retryable=exc.retryable,
                ) from exc
            details: dict[str, Any] = {
                "cordoned": record["cordoned"],
                "tainted": record["tainted"],
                "taint": _taint_str(ours) if ours is not None else None,
                "kept_taints": record["kept_taints"],
            }
            if spec_done:
                details["completed"] = ["condition"]
            error = await self.events.emit(
                patched, "TrainguardQuarantined", f"{reason}: {message}", warning=True
            )
            if error:
                details["event_error"] = error
            outcome = f"node {name} cordoned, {taint_desc}"
            if spec_done:
                outcome = (
                    f"node {name} quarantine completed: condition {s.condition_type}=False set "
                    f"(cordoned, {taint_desc} before)"
                )
            return ActuatorResult(outcome=outcome, details=details)
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
            ours = _recorded_taint(record, s.taint_key, s.taint_effect)
            taints = node.get("spec", {}).get("taints") or []
            if ours is not None and "taint" not in record:
                # A record from before "taint" was kept: trainguard replaced any taint with
                # its key then, so every taint with the key is its own.
                kept = [t for t in taints if t.get("key") != s.taint_key]
            elif ours is not None:
                # Only the taint trainguard added (key and effect): never another party's.
                kept = [
                    t
                    for t in taints
                    if not (t.get("key") == ours["key"] and t.get("effect") == ours["effect"])
                ]
            else:
                kept = taints
            if len(kept) != len(taints):
                spec["taints"] = kept or None
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
