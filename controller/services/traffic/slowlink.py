"""Reacting to ``slow_link`` incidents: suspect fabric links marked slow, plans re-made.

The job detectors' probe round localizes slow communication to rank pairs; this consumer
of :class:`~controller.services.events.IncidentOpened` maps the pairs to links
(:func:`.placement.slow_link_suspects`), marks them slow at the measured bandwidth ratio and
re-plans through the service, off the detector's path (in its own event-bus task). Each
outcome, good or bad, is recorded as a ``traffic_replan`` action so an operator can see what
was done and why; a re-plan's action row is written in the re-plan's own transaction.

NIC evidence counts too: a ``slow_link`` or ``comm_slow`` incident whose evidence names NICs
with recent errors or flaps (``evidence["nic"]``, from
:mod:`controller.logic.detection.nic_evidence`) degrades those NICs' fabric links
(:func:`controller.logic.traffic.nic_links.nic_link_factors`), so the planner moves flows
off them even when the probe could not single out a link, or before a probe ran. A NIC's own
incident (``hw_degraded`` / ``nic_errors`` with a NIC signal: gone, port down or flapping,
bond member down, errors rising) degrades its links as soon as it opens, before any job
slows down. Links stay degraded until an operator restores them
(``POST /api/v1/topology/links/{link}/state``),
as for probe-found slow links: a port that flapped once is not trusted again by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection

from controller.logic.detection.c4d.job_evidence import CommSlowEvidence, SlowLinkEvidence
from controller.logic.detection.incident_evidence import HwEvidence
from controller.logic.detection.nic_evidence import NicPort, device_order
from controller.logic.traffic.nic_links import (
    NIC_SIGNAL_FACTOR,
    merge_link_factors,
    nic_link_factors,
)
from controller.services.actions import ActionService
from controller.services.events import IncidentOpened
from controller.services.traffic import placement
from controller.services.traffic.service import TrafficService
from controller.state import ClusterState, IncidentState

log = logging.getLogger(__name__)


#: Incidents about one NIC (``controller.logic.detection.hw_rules``).
NIC_INCIDENT_KINDS = ("hw_degraded", "nic_errors")


class SlowLinkReaction:
    def __init__(
        self,
        service: TrafficService,
        state: ClusterState,
        actions: ActionService,
        nic_ports: Callable[[str], Sequence[NicPort]] = lambda _node: (),
    ) -> None:
        self._service = service
        self._state = state
        self._actions = actions
        #: A node's RDMA ports as its agent last reported them (the fabric's nic<k> order).
        self._nic_ports = nic_ports

    async def on_incident_opened(self, event: IncidentOpened) -> None:
        """Re-plan around a slow-link, slow-communication or NIC incident when planning is
        on (a fabric is known)."""
        incident = event.incident
        if self._service.planner is None:
            return
        if incident.kind in ("slow_link", "comm_slow") or self._nic_suspect(incident):
            await self.react(incident)

    def _nic_suspect(self, incident: IncidentState) -> tuple[str, int, str] | None:
        """(node, nic index, signal) of a NIC's own incident; ``None`` for other incidents,
        signals that are not about a NIC, or a device the node never reported."""
        evidence = incident.evidence
        if incident.kind not in NIC_INCIDENT_KINDS or not isinstance(evidence, HwEvidence):
            return None
        signal, device = evidence.signal, evidence.device
        if signal not in NIC_SIGNAL_FACTOR or incident.node is None or not device:
            return None
        order = device_order(list(self._nic_ports(incident.node)))
        if device not in order:
            return None
        return incident.node, order.index(device), signal

    def suspects(self, incident: IncidentState) -> tuple[list[str], float]:
        live = self._service.plan_of(incident.job or "")
        job = self._state.jobs.get(incident.job or "")
        evidence = incident.evidence
        if live is None or job is None or incident.kind != "slow_link":
            return [], 1.0
        if not isinstance(evidence, SlowLinkEvidence):
            return [], 1.0  # a row that does not fit its kind's model names no pairs
        return placement.slow_link_suspects(live.plan, job, evidence)

    def nic_changes(self, incident: IncidentState) -> list[tuple[str, float]]:
        """(link, factor) for the links of the NICs the incident's NIC evidence suspects."""
        topo = self._service.topology
        if topo is None:
            return []
        own = self._nic_suspect(incident)
        if own is not None:
            return nic_link_factors(topo, [own])
        evidence = incident.evidence
        nic = evidence.nic if isinstance(evidence, CommSlowEvidence | SlowLinkEvidence) else None
        if nic is None:
            return []
        suspects = [
            (s.node, s.nic_index, s.signal) for s in nic.suspects if s.nic_index is not None
        ]
        return nic_link_factors(topo, suspects)

    async def react(self, incident: IncidentState) -> None:
        """Mark the suspect links slow and re-plan; the outcome is an audited action."""
        trigger = f"incident:{incident.id}"
        try:
            links, factor = self.suspects(incident)
            nic_links = self.nic_changes(incident)
            changes = merge_link_factors([(n, factor) for n in links], nic_links)
            if not changes:
                log.info(
                    "slow-link incident: no planned flows on the slow pairs and no suspect "
                    "NIC in the fabric; nothing to re-plan",
                    extra={"fields": {"incident": incident.id, "job": incident.job}},
                )
                return
            parts = (
                [f"marked {len(links)} link(s) slow at {factor:.2f} of capacity"] if links else []
            )
            if nic_links:
                parts.append(f"{len(nic_links)} link(s) of suspect NICs degraded")

            def audit(result: dict[str, Any]) -> Callable[[Connection], int]:
                # Written with the new versions and link states: one transaction.
                moved = sum(p["moved_flows"] for p in result["plans"])
                return self._actions.inserting(
                    kind="traffic_replan",
                    target=f"job:{incident.job}",
                    trigger=trigger,
                    params=result,
                    status="succeeded",
                    outcome=(
                        f"{' and '.join(parts)}; re-planned {len(result['plans'])} plan(s), "
                        f"{moved} flow(s) moved in {result['replan_ms']:.1f} ms"
                    ),
                )

            await self._service.set_links(changes, reason=trigger, audit=audit)
        except Exception as exc:
            # Nothing of the re-plan was stored or shown (a database failure included).
            log.exception("slow-link re-plan failed", extra={"fields": {"incident": incident.id}})
            await self._record(incident, trigger, {}, "failed", f"{type(exc).__name__}: {exc}")

    async def _record(
        self,
        incident: IncidentState,
        trigger: str,
        params: dict[str, Any],
        status: str,
        outcome: str,
    ) -> None:
        try:
            await self._actions.create(
                kind="traffic_replan",
                target=f"job:{incident.job}",
                trigger=trigger,
                params=params,
                status=status,
                outcome=outcome,
            )
        except Exception:
            log.exception("could not record the re-plan action")


__all__ = ["SlowLinkReaction"]
