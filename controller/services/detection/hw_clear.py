"""Resolve a GPU's ``hw_degraded`` warning once its standing conditions cleared.

The health detector (:mod:`.health`) hands every report here after its findings are acted
on (so a warning the same report opened is seen open). The decision is the pure
:class:`~controller.logic.detection.hw_clearing.HwClearing`'s; this module only looks up
the open warnings and resolves through the incident service, like ``gpu_unreachable`` and
``node_lost``. Ingest is the hot path: a report costs one in-memory look-up per GPU, and
the database is written only when a warning resolves.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from controller.logic.detection.hw_clearing import (
    HwClearing,
    hw_degraded_key,
    incident_signals,
)
from controller.services.incidents import IncidentService
from controller.state import IncidentState
from trainguard import wire

log = logging.getLogger(__name__)


class HwClearer:
    """Counts clear reports per GPU with an open warning and resolves it when they suffice."""

    def __init__(self, incidents: IncidentService, clearing: HwClearing | None = None) -> None:
        self._incidents = incidents
        self._clearing = clearing if clearing is not None else HwClearing()

    async def check(self, report: wire.Report) -> None:
        """Resolve the warnings this report shows cleared (for the required count).

        The open incident, not a memo, says what stood: a warning loaded from the database
        by a new leader is judged the same way. Every GPU is tried; the first failure is
        raised at the end (the caller logs it) and the next report tries again."""
        if not report.samples:
            return
        node = report.node.name
        found: dict[int, IncidentState] = {}
        for g in report.samples[-1].gpus:
            incident = self._incidents.find_open(hw_degraded_key(node, g.index))
            if incident is not None:
                found[g.index] = incident
        signals: dict[int, Collection[str]] = {}
        for index, incident in found.items():
            recorded = incident_signals(incident.evidence)
            if recorded is not None:
                signals[index] = recorded
        first: Exception | None = None
        for cleared in self._clearing.observe(report, signals):
            try:
                await self._incidents.resolve(found[cleared.gpu_index], note=cleared.note)
            except Exception as exc:  # memory unchanged: the next report retries
                first = first or exc
        if first is not None:
            raise first


__all__ = ["HwClearer"]
