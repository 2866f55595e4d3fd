"""Every service of one controller replica, as the composition root built them.

``controller.runtime.compose`` fills it; the API's dependencies (``controller.api.deps``)
hand each route the service it uses from it, so no router imports the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.auth import Authenticator
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.dashboard import DashboardFeed
from controller.services.detection import Ticker
from controller.services.detection.degraded import DegradedGpuDetector
from controller.services.detection.health import HealthDetector
from controller.services.detection.jobs import JobDetector
from controller.services.events import EventBus
from controller.services.flight_evidence import FlightEvidence
from controller.services.incidents import IncidentService
from controller.services.ingest import IngestService
from controller.services.leader import LeaderElector
from controller.services.metrics import ControllerMetrics
from controller.services.nodes import NodeRecords
from controller.services.power import PowerService
from controller.services.remediation.engine import RemediationEngine
from controller.services.traffic.service import TrafficService
from controller.services.traffic.slowlink import SlowLinkReaction
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store
from controller.writer import GroupCommitWriter


@dataclass(frozen=True, kw_only=True, slots=True)
class Services:
    settings: ControllerSettings
    store: Store
    state: ClusterState
    events: EventBus
    auth: Authenticator
    leader: LeaderElector
    metrics: ControllerMetrics
    writer: GroupCommitWriter
    incidents: IncidentService
    commands: CommandService
    nodes: NodeRecords
    actions: ActionService
    health: HealthDetector
    degraded: DegradedGpuDetector
    jobs: JobDetector
    flight: FlightEvidence
    traffic: TrafficService
    slow_links: SlowLinkReaction
    power: PowerService
    remediation: RemediationEngine
    ingest: IngestService
    dashboard: DashboardFeed
    #: Periodic work the leader runs (each at its ``tick_interval_s``).
    tickers: tuple[Ticker, ...]


__all__ = ["Services"]
