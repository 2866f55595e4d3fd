"""Reacting to ``slow_link`` incidents: suspect fabric links marked slow, plans re-made.

The job detectors' probe round localizes slow communication to rank pairs; this consumer
of :class:`~controller.services.events.IncidentOpened` maps the pairs to links
(:func:`.placement.slow_link_suspects`), marks them slow at the measured bandwidth ratio and
re-plans through the service, off the detector's path (in its own event-bus task). Each
outcome, good or bad, is recorded as a ``traffic_replan`` action so an operator can see what
was done and why.

NIC evidence counts too: a ``slow_link`` or ``comm_slow`` incident whose evidence names NICs
with recent errors or flaps (``evidence["nic"]``, from
:mod:`controller.logic.detection.nic_evidence`) degrades those NICs' fabric links
(:func:`controller.logic.traffic.nic_links.nic_link_factors`), so the planner moves flows
off them even when the probe could not single out a link, or before a probe ran.
"""

from __future__ import annotations

import logging
from typing import Any

from controller.logic.traffic.nic_links import merge_link_factors, nic_link_factors
from controller.services.actions import ActionService
from controller.services.events import IncidentOpened
from controller.services.traffic import placement
from controller.services.traffic.service import TrafficService
from controller.state import ClusterState, IncidentState

log = logging.getLogger(__name__)


class SlowLinkReaction:
    def __init__(
        self, service: TrafficService, state: ClusterState, actions: ActionService
    ) -> None:
        self._service = service
        self._state = state
        self._actions = actions

    async def on_incident_opened(self, event: IncidentOpened) -> None:
        """Re-plan around a ``slow_link`` incident when planning is on (a fabric is known)."""
        kind = event.incident.kind
        if kind in ("slow_link", "comm_slow") and self._service.planner is not None:
            await self.react(event.incident)

    def suspects(self, incident: IncidentState) -> tuple[list[str], float]:
        live = self._service.plan_of(incident.job or "")
        job = self._state.jobs.get(incident.job or "")
        if live is None or job is None or incident.kind != "slow_link":
            return [], 1.0
        return placement.slow_link_suspects(live.plan, job, incident.evidence)

    def nic_changes(self, incident: IncidentState) -> list[tuple[str, float]]:
        """(link, factor) for the links of the NICs the incident's NIC evidence suspects."""
        topo = self._service.topology
        nic = incident.evidence.get("nic")
        if topo is None or not isinstance(nic, dict):
            return []
        suspects = [
            (str(s["node"]), int(s["nic_index"]), str(s["signal"]))
            for s in nic.get("suspects") or []
            if isinstance(s, dict) and s.get("nic_index") is not None
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
            result = await self._service.set_links(changes, reason=trigger)
        except Exception as exc:
            log.exception("slow-link re-plan failed", extra={"fields": {"incident": incident.id}})
            await self._record(incident, trigger, {}, "failed", f"{type(exc).__name__}: {exc}")
            return
        moved = sum(p["moved_flows"] for p in result["plans"])
        nic_part = f" and {len(nic_links)} link(s) of suspect NICs degraded" if nic_links else ""
        outcome = (
            f"marked {len(links)} link(s) slow at {factor:.2f} of capacity{nic_part}; re-planned "
            f"{len(result['plans'])} plan(s), {moved} flow(s) moved in {result['replan_ms']:.1f} ms"
        )
        await self._record(incident, trigger, result, "succeeded", outcome)

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
