"""A recording actuator: the engine's boundary to the world, faked with state, not mocks.

It keeps each job's placement and node pool as a real actuator would (a restart moves the
job to the new placement; a generation is never started twice) and records every call, so
an engine test can assert what was done, in which order, and on which placement.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from controller.actuators.base import (
    ActuatorError,
    ActuatorResult,
    JobLimits,
    JobPolicy,
    NodeView,
    Placement,
)


@dataclass
class RecordingActuator:
    #: Job -> the placement it runs on now.
    placements: dict[str, Placement]
    #: Job -> the nodes it may use (``candidate_nodes``), spares included.
    pools: dict[str, list[str]]
    name: str = "recording"
    #: (method, argument) of every call, oldest first.
    calls: list[tuple[str, Any]] = field(default_factory=list)
    #: Job -> its own policy (a workload annotation on Kubernetes), or the error it raises.
    policies: dict[str, JobPolicy | ActuatorError] = field(default_factory=dict)
    #: Node -> what the platform says about it (``node_view``); unknown when absent.
    views: dict[str, NodeView] = field(default_factory=dict)

    def acts(self) -> list[tuple[str, Any]]:
        """The calls made on the remediation engine's behalf: node and job actions and the
        restart's Event. Left out: reads, and the detection Events every new incident gets
        from ``services.platform_events`` (another subscriber, tested on its own)."""
        acting = ("isolate_node", "release_node", "stop_job", "restart_job")
        restart_event = ("record_event", "TrainguardRestart")
        return [(m, a) for m, a in self.calls if m in acting or (m, a) == restart_event]

    def restarts(self) -> list[Placement]:
        return [arg for method, arg in self.calls if method == "restart_job"]

    def observe_ranks(self, node: str, events: Any) -> None:
        self.calls.append(("observe_ranks", node))

    async def candidate_nodes(self, job: str) -> list[str]:
        return list(self.pools.get(job, []))

    async def current_placement(self, job: str) -> Placement | None:
        return self.placements.get(job)

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        self.calls.append(("isolate_node", node))
        return ActuatorResult(outcome=f"{node} isolated")

    async def release_node(self, node: str, *, reason: str) -> ActuatorResult:
        self.calls.append(("release_node", node))
        return ActuatorResult(outcome=f"{node} released")

    async def stop_job(self, job: str, *, reason: str) -> ActuatorResult:
        self.calls.append(("stop_job", job))
        return ActuatorResult(outcome=f"job {job} stopped")

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        current = self.placements.get(placement.job)
        if current is not None and placement.generation <= current.generation:
            raise ActuatorError(f"generation {placement.generation} of {placement.job} is old")
        self.calls.append(("restart_job", placement))
        self.placements[placement.job] = placement
        return ActuatorResult(outcome=f"generation {placement.generation} started")

    async def record_event(
        self, *, target: str, reason: str, message: str, warning: bool = False
    ) -> None:
        self.calls.append(("record_event", reason))

    async def start(self) -> list[Placement]:
        return []

    def limits(self, job: str) -> JobLimits | None:
        return None

    async def node_view(self, node: str) -> NodeView:
        self.calls.append(("node_view", node))
        return self.views.get(node, NodeView())

    async def job_policy(self, job: str) -> JobPolicy | None:
        policy = self.policies.get(job)
        if isinstance(policy, ActuatorError):
            raise policy
        return policy

    async def close(self) -> None:
        return None


class GatedIsolation(RecordingActuator):
    """An isolation that waits for the test (``gate``): the remediation stays inside the
    actuator call, so a test can act while one isolation is under way."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        self.calls.append(("isolate_node", node))
        await asyncio.to_thread(self.gate.wait, 30)
        return ActuatorResult(outcome=f"{node} isolated")
