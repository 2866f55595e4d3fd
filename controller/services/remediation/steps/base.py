"""What every remediation step gets to work with, and the one way it records what it did.

A step is a module with one class implementing :class:`RemediationStep`: it reads the
cluster through :class:`StepContext`, acts only through ``ctx.actuator`` (the
:class:`~controller.actuators.base.Actuator` interface, never a concrete actuator), changes
node rows only through ``ctx.nodes`` and writes its action rows through ``ctx.recorder``.
It returns ``(ok, outcome)``; the engine's state machine (``engine.py``) decides what runs
next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Connection

from controller.actuators.base import Actuator
from controller.actuators.k8s.partition import PartitionSettings
from controller.logic.remediation import guards
from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.params import ActionParams, RestartParams, parse_params
from controller.logic.remediation.rules import Policy, Rule, Step
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService
from controller.services.nodes import NodeRecords
from controller.services.remediation.records import JobBook, Remediation
from controller.services.webhook import Webhook
from controller.state import ClusterState, IncidentState
from controller.store import Store

#: ``(ok, outcome)``: a failed restart or rollback fails its remediation; other steps
#: report and the next one runs.
StepResult = tuple[bool, str]


class ActionRecorder:
    """Action rows of remediation steps: who triggered them, and their parameters."""

    def __init__(self, actions: ActionService) -> None:
        self._actions = actions

    async def record(
        self,
        incident: IncidentState | None,
        rem: Remediation | None,
        kind: str,
        target: str,
        params: dict[str, Any],
        status: str,
        outcome: str,
    ) -> int:
        """One action row, triggered by ``incident`` or (grow-back) by ``rem`` alone.

        The parameters pass through their kind's model (:func:`parse_params`), the one the
        API reads them back with: a field of the wrong type fails here, at the writer.
        """
        typed = parse_params(kind, self.params(incident, rem, params))
        full = typed.to_params() if isinstance(typed, ActionParams) else typed
        if rem is not None and rem.trigger:
            trigger = rem.trigger
        elif incident is not None:
            trigger = f"incident:{incident.id}"
        else:
            raise ValueError("an action needs an incident or a remediation to name its trigger")
        return await self._actions.create(
            kind=kind,
            target=target,
            trigger=trigger,
            params=full,
            status=status,
            outcome=outcome,
        )

    @staticmethod
    def params(
        incident: IncidentState | None, rem: Remediation | None, params: dict[str, Any]
    ) -> dict[str, Any]:
        """An action row's parameters: its own, with what triggered it."""
        full = {} if incident is None else {"incident": incident.id, "incident_kind": incident.kind}
        full |= params
        if rem is not None:
            # The job too: a leader that finishes this remediation after a failover needs it.
            full |= {"remediation": rem.id, "job": rem.job}
        return full

    async def finish(self, action_id: int, status: str, outcome: str) -> None:
        await self._actions.update(
            action_id, status=status, outcome=outcome, finished_unix_s=time.time()
        )

    def finishing(self, action_id: int, status: str, outcome: str) -> Callable[[Connection], None]:
        """:meth:`finish` as a step of the caller's transaction (the change it records)."""
        return self._actions.updating(
            action_id, status=status, outcome=outcome, finished_unix_s=time.time()
        )

    async def update_params(
        self, action_id: int, params: RestartParams, *, outcome: str | None = None
    ) -> None:
        """Rewrite a restart row's parameters (the resume wait adds when the job resumed, or
        that it did not), and its outcome when given."""
        await self._actions.update(action_id, params=params.to_params(), outcome=outcome)


@dataclass(eq=False)
class StepContext:
    """The engine's collaborators and bookkeeping, shared by every step it runs.

    ``actuator`` and ``policy`` may be replaced while the controller runs (the policy by
    ``PUT /api/v1/remediation/policy``); steps read them here each time.
    """

    state: ClusterState
    store: Store
    commands: CommandService
    nodes: NodeRecords
    recorder: ActionRecorder
    actuator: Actuator | None
    policy: Policy
    jobs: dict[str, JobBook] = field(default_factory=dict)
    restarts: guards.RestartBudget = field(default_factory=guards.RestartBudget)
    #: Node count of each job's first placement (the size ``grow`` returns to).
    original_nodes: dict[str, int] = field(default_factory=dict)
    #: Where the ``webhook`` step POSTs (``remediation_webhook_url``; ``None``: not set).
    webhook: Webhook | None = None
    #: Opens the ``quarantine_budget`` incident when the budget refuses a quarantine.
    incidents: IncidentService | None = None
    #: Partition guard and quarantine budget settings (``services.remediation.partition``).
    partition: PartitionSettings = field(default_factory=PartitionSettings)
    #: Incident id -> what the engine decided ("acted", "absorbed" ...): the ``isolate``
    #: step batches only undecided incidents of the job (:mod:`.batch`).
    decided: dict[int, str] = field(default_factory=dict)

    def book(self, job: str) -> JobBook:
        book = self.jobs.get(job)
        if book is None:
            book = self.jobs[job] = JobBook(ledger=GoodputLedger(job))
        return book


class RemediationStep(Protocol):
    """One step of a rule (``Step``), run for one remediation."""

    #: The policy's name for the step.
    step: Step
    #: The action kind its rows carry (how a new leader finds where a remediation stopped).
    action_kind: str

    async def run(
        self,
        ctx: StepContext,
        rem: Remediation,
        incident: IncidentState | None,
        rule: Rule | None,
    ) -> StepResult: ...


__all__ = ["ActionRecorder", "RemediationStep", "StepContext", "StepResult"]
