"""Silence is not death, in the engine: ``node_lost`` is acted on only when confirmed, and a
quarantine budget caps how much of the fleet trainguard takes out per window.

The decisions are :mod:`controller.actuators.k8s.partition`'s (pure): this module feeds
them. For a ``node_lost`` incident it counts the silent agents of the whole fleet (the
controller's own clock: ``last_seen_unix_s``; silent for half of ``node_lost_after_s``
counts, since agents that fall silent together cross the limit a report apart); if
``partition_mass_silence_share`` of the fleet (at least ``_min_nodes``) is, it holds every
``node_lost`` (the fault is most likely the controller's: its network, DNS, ingress) and
asks nothing else. Otherwise it asks the actuator for the platform's own view of the silent
node (``Actuator.node_view``: on Kubernetes the Node's ``Ready`` condition and its pods) and
looks at the controller's own evidence that the node's ranks fail (open incidents of a job
naming the node, ranks there no longer running). Silence plus one of those is *lost*, acted
on; silence alone is *unreachable*, held and looked at again every tick.

The quarantine budget (:func:`quarantine_refusal`) is counted from the node rows
(``isolated_unix_s``) and remediation's isolation rows within its window (released nodes
too, so a flapping fleet cannot drain more than its share), so it survives a failover like
the policy's circuit breaker does.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

from controller.actuators.base import ActuatorError, NodeView
from controller.actuators.k8s.partition import (
    NodeSignals,
    PartitionSettings,
    Verdict,
    classify,
    quarantine_limit,
)
from controller.logic.detection.incident_evidence import QuarantineBudgetEvidence
from controller.logic.incident_kinds import IncidentKind
from controller.logic.remediation.guards import isolated_in_window, released_note
from controller.services.incidents import IncidentService, IncidentSpec
from controller.settings import ControllerSettings
from controller.state import ClusterState, IncidentState

#: ``Actuator.node_view``, or (no actuator) a source that knows nothing.
NodeViewSource = Callable[[str], Awaitable[NodeView]]

#: Incident kinds raised by a node's *job* that count as the job's ranks failing there.
_RANK_FAILURES = frozenset({"rank_crash", "comm_failure", "comm_hang", "hang"})


def partition_settings(settings: ControllerSettings) -> PartitionSettings:
    return PartitionSettings(
        silent_after_s=settings.node_lost_after_s,
        mass_silence_share=settings.partition_mass_silence_share,
        mass_silence_min_nodes=settings.partition_mass_silence_min_nodes,
        max_quarantine_share=settings.quarantine_budget_share,
        window_s=settings.quarantine_budget_window_s,
    )


def ranks_failing(state: ClusterState, node: str) -> bool:
    """The controller's own second signal: the node's ranks are reported failing by others
    (an open job incident naming the node) or one of them exited with an error."""
    for incident in state.incidents.values():
        if incident.node == node and incident.job is not None and incident.kind in _RANK_FAILURES:
            return True
    return any(
        rank.node == node and rank.state == "failed"
        for job in state.jobs.values()
        for rank in job.ranks.values()
    )


async def judge_silence(
    state: ClusterState,
    incident: IncidentState,
    settings: PartitionSettings,
    view: NodeViewSource,
    *,
    now: float | None = None,
) -> Verdict:
    """The verdict on the silent node of a ``node_lost`` incident, in the whole fleet's
    light. The actuator is asked about that node only, and not at all on mass silence."""
    now = time.time() if now is None else now
    node = incident.node or ""
    silence = {n.name: now - n.last_seen_unix_s for n in state.nodes.values() if n.last_seen_unix_s}
    silence[node] = max(silence.get(node, 0.0), settings.silent_after_s)  # the incident says so
    # Agents that fall silent together cross ``silent_after_s`` a report apart: count every
    # node silent for half of it as going silent with this one.
    going = sorted(n for n, s in silence.items() if s >= settings.silent_after_s / 2)
    fleet_size = max(len(state.nodes), len(silence))
    threshold = max(settings.mass_silence_min_nodes, settings.mass_silence_share * fleet_size)
    if len(going) >= threshold:
        return Verdict(
            {n: "unreachable" for n in going},
            True,
            [],
            f"{len(going)} of {fleet_size} agents silent at once ({', '.join(going)}): "
            "assuming the fault is on the controller's side (network, DNS, ingress); "
            "acting on no node",
        )
    try:
        seen = await view(node)
    except ActuatorError:
        seen = NodeView()  # the platform cannot be asked: not a second signal
    fleet = [NodeSignals(name=n, silent_for_s=s) for n, s in silence.items() if n != node]
    fleet.append(
        NodeSignals(
            name=node,
            silent_for_s=silence[node],
            node_ready=seen.ready,
            pods_running=seen.pods_running,
            ranks_failing=ranks_failing(state, node),
        )
    )
    return classify(fleet, settings)


def quarantine_refusal(
    state: ClusterState,
    node: str,
    settings: PartitionSettings,
    *,
    now: float,
    history: Iterable[tuple[str, float]] = (),
) -> tuple[str, QuarantineBudgetEvidence] | None:
    """Why quarantining ``node`` would overspend the budget (and the evidence for the
    human's incident), or ``None``. Counted like the policy's circuit breaker
    (:func:`~controller.logic.remediation.guards.isolated_in_window`): nodes quarantined
    now and, from ``history`` (:func:`.history.policy_isolations`), nodes remediation
    quarantined within the window and released since, each once."""
    fleet = max(len(state.nodes), 1)
    limit = quarantine_limit(settings, fleet)
    counted, released = isolated_in_window(
        {n.name: n.isolated_unix_s for n in state.nodes.values()},
        history,
        now_unix_s=now,
        window_s=settings.window_s,
    )
    recent = len(counted - {node})
    if recent + 1 <= limit:
        return None
    message = (
        f"quarantine budget spent: quarantining {node} would make {recent + 1} of {fleet} "
        f"nodes quarantined within {settings.window_s:.0f} s (limit {limit}, "
        f"{settings.max_quarantine_share:.0%} of the fleet); a human decides on more"
        + released_note(released)
    )
    evidence = QuarantineBudgetEvidence(
        refused_node=node,
        quarantined_in_window=recent,
        limit=limit,
        fleet=fleet,
        window_s=settings.window_s,
    )
    return message, evidence


async def raise_budget_incident(
    incidents: IncidentService, message: str, evidence: QuarantineBudgetEvidence
) -> None:
    """One open ``quarantine_budget`` incident (bumped while it stays open) for a human."""
    await incidents.open_or_bump(
        IncidentSpec(
            kind=IncidentKind.QUARANTINE_BUDGET,
            severity="critical",
            summary=message[:500],
            dedupe_key="quarantine_budget",
            node=None,
            job=None,
            evidence=evidence,
        )
    )


__all__ = [
    "judge_silence",
    "partition_settings",
    "quarantine_refusal",
    "raise_budget_incident",
    "ranks_failing",
]
