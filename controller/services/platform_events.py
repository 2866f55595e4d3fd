"""What the platform is told, through the actuator interface, beyond remediation's actions.

* :class:`DetectionEvents`: every *detection* becomes an event in the platform's own stream
  (Kubernetes Events on the Node and on the job's workload, so ``kubectl describe`` tells
  the story from the first sign, not only from the first action; the local actuator logs
  it). A consumer of :class:`~controller.services.events.IncidentOpened`, so whoever opens
  incidents needs no change.
* :class:`PreflightQuarantine`: a node whose last preflight failed is isolated on the
  platform (Kubernetes: cordoned and tainted ``trainguard.io/unhealthy=<the failing
  checks>``), so the scheduler keeps every workload off it, not only trainguard's placements
  (which already skip it, ``logic.remediation.preflight``). It looks at start and after each
  report that carries command acks, which is where a preflight's verdict arrives. A node is
  isolated once per failed verdict; a later passing preflight does not release it (the
  quarantine may also stand for other faults): an operator releases it
  (``POST /api/v1/nodes/{name}/release``).

Both are failures-tolerant: an actuator error is logged and the next event still comes.
Wiring (composition root): :func:`subscribe_platform_events`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping

from controller.actuators.base import Actuator, ActuatorError, ActuatorResult
from controller.logic.remediation.preflight import PreflightVerdict, failed_nodes
from controller.services.events import EventBus, IncidentOpened, NodeReported

log = logging.getLogger(__name__)

ActuatorRef = Callable[[], Actuator | None]


def event_reason(kind: str) -> str:
    """``xid_fatal`` -> ``TrainguardXidFatal``: an Event reason as Kubernetes spells them."""
    words = re.findall(r"[A-Za-z0-9]+", kind)
    return ("Trainguard" + "".join(w[:1].upper() + w[1:] for w in words))[:128]


class DetectionEvents:
    """One platform event per new incident, on its node and on its job."""

    def __init__(self, actuator: ActuatorRef) -> None:
        self._actuator = actuator

    async def on_incident_opened(self, event: IncidentOpened) -> None:
        act = self._actuator()
        if act is None:
            return
        inc = event.incident
        message = f"incident {inc.id} ({inc.severity}, {inc.kind}): {inc.summary}"
        if inc.gpu_index is not None:
            message += f" [GPU {inc.gpu_index}]"
        if inc.ranks:
            message += f" [ranks {', '.join(map(str, inc.ranks[:16]))}]"
        targets = ([f"node/{inc.node}"] if inc.node else []) + (
            [f"job/{inc.job}"] if inc.job else []
        )
        for target in targets:
            try:
                await act.record_event(
                    target=target,
                    reason=event_reason(inc.kind),
                    message=message,
                    warning=inc.severity != "info",
                )
            except ActuatorError as exc:
                log.warning(
                    "could not record the detection on the platform",
                    extra={"fields": {"incident": inc.id, "target": target, "error": str(exc)}},
                )


class PreflightQuarantine:
    """Isolate, through the actuator, each node whose last preflight failed (once per
    verdict)."""

    def __init__(
        self, verdicts: Callable[[], Mapping[str, PreflightVerdict]], actuator: ActuatorRef
    ) -> None:
        self._verdicts = verdicts
        self._actuator = actuator
        #: node -> ``finished_unix_s`` of the failed verdict already acted on.
        self._acted: dict[str, float] = {}
        #: Verdicts may be new: at start (loaded from the database) and after a report that
        #: carries command acks (a preflight's verdict is one). Every other report skips the
        #: scan of the commands, so the ingest path does not pay for it.
        self._due = True

    async def on_node_reported(self, event: NodeReported) -> None:
        if event.report.command_acks:
            self._due = True
        if self._due:
            await self.check()

    async def check(self) -> dict[str, ActuatorResult]:
        """Isolate the nodes with a failed verdict not acted on yet; node -> result."""
        act = self._actuator()
        if act is None:
            return {}  # a standby: looked at again once it leads
        self._due = False
        verdicts = self._verdicts()
        done: dict[str, ActuatorResult] = {}
        for node, checks in failed_nodes(verdicts).items():
            finished = verdicts[node].finished_unix_s
            if self._acted.get(node) == finished:
                continue
            try:
                done[node] = await act.isolate_node(
                    node, reason=f"preflight failed: {checks or 'no reason given'}"
                )
            except ActuatorError as exc:
                log.warning(
                    "could not isolate a node whose preflight failed",
                    extra={"fields": {"node": node, "error": str(exc)}},
                )
                self._due = True  # tried again after the next report
                continue
            self._acted[node] = finished
            log.info(
                "node isolated after a failed preflight",
                extra={"fields": {"node": node, "outcome": done[node].outcome}},
            )
        return done


def subscribe_platform_events(
    bus: EventBus,
    actuator: ActuatorRef,
    verdicts: Callable[[], Mapping[str, PreflightVerdict]],
) -> tuple[DetectionEvents, PreflightQuarantine]:
    """Subscribe both to ``bus`` (the composition root calls this once)."""
    detections = DetectionEvents(actuator)
    preflight = PreflightQuarantine(verdicts, actuator)
    bus.subscribe(IncidentOpened, detections.on_incident_opened, name="platform-events")
    bus.subscribe(NodeReported, preflight.on_node_reported, name="preflight-quarantine")
    return detections, preflight


__all__ = [
    "DetectionEvents",
    "PreflightQuarantine",
    "event_reason",
    "subscribe_platform_events",
]
