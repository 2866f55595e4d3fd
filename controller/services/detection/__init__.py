"""Detectors turn accepted reports and the passage of time into incidents.

A detector plugs in without touching ingest: it is a :class:`ReportObserver` (called with
every report once it is durable) and/or a :class:`Ticker` (called periodically). Ingest
calls observers in registration order; an observer that raises is logged and skipped, since
the report is already stored and acknowledged work must not be undone by a detector bug.
"""

from __future__ import annotations

from typing import Protocol

from trainguard import wire


class ReportObserver(Protocol):
    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        """Look at one stored report. ``received_unix_s`` is the controller's clock."""


class Ticker(Protocol):
    #: Seconds between two ticks.
    tick_interval_s: float

    async def tick(self, now_unix_s: float) -> None:
        """Periodic work; an exception is logged and the next tick still runs."""


__all__ = ["ReportObserver", "Ticker"]
