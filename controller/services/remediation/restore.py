"""What a new leader reads back from the action history, the job books it restores, and
the configured jobs it starts.

The engine keeps its per-job state in memory; after a failover or a controller restart it
is rebuilt from the ``actions`` rows the earlier leader wrote: which open incidents were
already acted on, the restarts that count against each job's rate limit and feed its
goodput ledger, and, per job, what its newest restart left behind (when it was remediated,
restarted and resumed, and the wait for its first step while it has not stepped again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from controller.actuators.base import Actuator, ActuatorError
from controller.logic.remediation.params import RestartParams
from controller.logic.remediation.rules import Step
from controller.services.remediation import history
from controller.services.remediation.records import JobBook, Remediation

log = logging.getLogger(__name__)


async def start_configured(actuator: Actuator | None, original_nodes: dict[str, int]) -> None:
    """Let the actuator start what it was configured to run, noting each job's size. A job
    that does not start is logged, and leading goes on: the actuator has started the others,
    and an error here used to end the new leader's start (no writer, no tickers)."""
    if actuator is None:
        return
    try:
        started = await actuator.start()
    except ActuatorError as exc:
        log.error("remediation: configured jobs: %s", exc)
        return
    for placement in started:
        original_nodes[placement.job] = len(placement.nodes)


@dataclass(frozen=True, slots=True)
class History:
    """The rows a new leader needs, read in one session."""

    actions: list[history.IncidentAction]
    restarts: list[history.RestartRow]
    grows: list[int]
    starts: dict[str, float]
    #: Per job: its newest restart row and when that remediation began.
    newest: dict[str, tuple[history.RestartRow, float]]


def read_history(session: Session, incident_ids: list[int], since: float) -> History:
    """Only open incidents are ever considered, so only their actions are read (``since``:
    how far back interrupted grow-backs are looked for): those under their own triggers,
    then a budget's refusals of companion nodes naming them (``steps/batch.py``), which
    decide them too (after a trigger's own rows: a ``pending`` row is resumed as its own)."""
    restarts = history.restarts(session)
    jobs = sorted({r.job for r in restarts if "goodput" in r.params})
    newest: dict[str, tuple[history.RestartRow, float]] = {}
    for job in sorted({r.job for r in restarts}):
        row = history.newest_restart(restarts, job)
        if row is not None:
            newest[job] = (row, history.remediation_started(session, row))
    return History(
        actions=history.incident_actions(session, incident_ids)
        + history.refused_companions(session, incident_ids),
        restarts=restarts,
        grows=history.interrupted_grows(session, since),
        starts=history.job_starts(session, jobs),
        newest=newest,
    )


def restore_wait(
    book: JobBook,
    job: str,
    row: history.RestartRow,
    began: float,
    resume_timeout_s: float,
    now: float,
) -> Remediation | None:
    """Put back what ``book`` said after the job's newest restart (``row``, of a remediation
    begun at ``began``): when it was remediated and restarted, when it resumed, and, while
    it had not stepped again yet, the wait for its first step (returned; ``None``: nothing
    to wait for). Without it, what the restart itself causes (ranks stopped, peers timing
    out) would be acted on as a new fault (a second restart), and the resume timeout would
    never fire."""
    book.last_remediation_unix_s = max(book.last_remediation_unix_s or began, began)
    book.last_restart_unix_s = max(book.last_restart_unix_s or row.at_unix_s, row.at_unix_s)
    raw = row.params.get("goodput")
    resumed = raw.get("resumed_unix_s") if isinstance(raw, dict) else None
    if isinstance(resumed, int | float):
        book.resumed_unix_s = float(resumed)
    try:
        params = RestartParams.model_validate(row.params)
    except ValueError:  # a row written by another version: no wait to restore
        return None
    incident = params.incident
    rem = Remediation(
        id=params.remediation or f"action-{row.id}",
        incident_id=incident,
        incident_kind=params.incident_kind or ("grow" if incident is None else ""),
        job=job,
        node=None,
        steps=[str(Step.RESTART)],
        started_unix_s=began,
        dry_run=False,
        trigger=row.trigger,
        grow=row.trigger.startswith("grow:"),
        state="done",
        outcome="restored by this leader: waiting for the job's first step",
        finished_unix_s=row.at_unix_s,
        generation=params.generation,
        restarted_unix_s=row.at_unix_s,
        resume_step=params.resume_step,
        restart_action=row.id,
        restart_params=params,
    )
    if isinstance(resumed, int | float):
        rem.resumed_unix_s = float(resumed)
    newest = book.last_restart
    if newest is None or (newest.restarted_unix_s or 0.0) <= row.at_unix_s:
        book.last_restart = rem  # where the job was put, resumed or not (``JobBook.left``)
    if not history.awaiting_resume(row) or now - row.at_unix_s > resume_timeout_s:
        return None
    if book.awaiting_resume is not None or book.running is not None:
        return None
    book.awaiting_resume = rem
    log.warning(
        "waiting for a job restarted before this leader to resume",
        extra={"fields": {"job": job, "action": row.id, "generation": rem.generation}},
    )
    return rem


__all__ = ["History", "read_history", "restore_wait"]
