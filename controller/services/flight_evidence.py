"""Flight Recorder evidence for hang incidents: ask the ranks, read their dumps, attach.

When a hang incident opens (``hang``: some ranks never entered a collective; ``comm_hang``:
all entered, none finished), every node that runs the job gets a ``JobDumpTrace`` command;
its agent relays it to the job's ranks, which answer with their PyTorch Flight Recorder
buffers (``FlightRecorderDump`` in ``JobRecords.traces``) even while their training threads
are stuck. Once every rank of the job has answered (or ``wait_s`` has passed when a later
dump arrives), :func:`trainguard.flight_recorder.analyze` finds where the ranks diverged and
the incident's evidence gets ``flight_recorder``: the collective (group, seq, op, sizes),
the ranks that entered it and those that never did, and whether that agrees with
trainguard's own verdict (the incident's ranks). When they disagree the summary says so.

Torch-free (the controller never imports torch); the analysis is shared with the job side.
Wiring (one line each in the composition root): ``on_incident_opened`` for every new
incident, ``on_report`` for every durable report that carries job records.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.logic.detection.c4d.job_evidence import (
    FlightDivergence,
    FlightRecorderEvidence,
    FlightRecorderUpdate,
)
from controller.logic.incident_kinds import IncidentKind
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService, IncidentSpec
from controller.state import ClusterState, IncidentState
from trainguard import wire
from trainguard.flight_recorder import Divergence, analyze

log = logging.getLogger("trainguard.controller")

HANG_KINDS = frozenset({"hang", "comm_hang"})


@dataclass(slots=True)
class _Request:
    incident_id: int
    job: str
    ranks: set[int]
    asked_unix_s: float
    dumps: dict[int, wire.FlightRecorderDump] = field(default_factory=dict)


class FlightEvidence:
    def __init__(
        self,
        state: ClusterState,
        incidents: IncidentService,
        commands: CommandService,
        *,
        wait_s: float = 30.0,
    ) -> None:
        self._state = state
        self._incidents = incidents
        self._commands = commands
        self.wait_s = wait_s
        #: Command id -> the request it belongs to (one command per node of the job).
        self._by_command: dict[str, _Request] = {}

    async def on_incident_opened(self, incident: IncidentState) -> None:
        """A new incident: ask for the dumps if it is a hang of a known job."""
        if incident.kind not in HANG_KINDS or not incident.job:
            return
        job = self._state.jobs.get(incident.job)
        if job is None or not job.ranks:
            return
        request = _Request(incident.id, incident.job, set(job.ranks), time.time())
        for node in sorted({r.node for r in job.ranks.values()}):
            ask = wire.JobDumpTrace(id="fr", job=incident.job, incident_id=str(incident.id))
            try:
                command = await self._commands.create(node, ask, by=f"incident:{incident.id}")
            except Exception:
                log.exception(
                    "flight recorder dump request failed", extra={"fields": {"node": node}}
                )
                continue
            self._by_command[command.id] = request

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        """A durable report: keep the dumps it carries for pending requests."""
        for dump in report.job.traces:
            request = self._by_command.get(dump.command_id)
            if request is None or dump.job != request.job or dump.rank not in request.ranks:
                continue  # a dump from a rank not asked (not of the job) says nothing
            request.dumps[dump.rank] = dump
            late = time.time() - request.asked_unix_s > self.wait_s
            if request.ranks <= set(request.dumps) or late:
                await self._attach(request)

    async def _attach(self, request: _Request) -> None:
        for key in [k for k, r in self._by_command.items() if r is request]:
            del self._by_command[key]
        incident = self._state.incidents.get(request.incident_id)
        if incident is None:  # resolved meanwhile
            return
        evidence = flight_evidence(request.dumps, request.ranks, incident)
        summary = incident.summary
        if evidence.agrees_with_trainguard is False and "Flight Recorder" not in summary:
            summary += f"; Flight Recorder disagrees: {evidence.verdict}"
        spec = IncidentSpec(
            kind=IncidentKind(incident.kind),  # one of HANG_KINDS (see above)
            severity=incident.severity,
            summary=summary,
            dedupe_key=incident.dedupe_key,
            node=incident.node,
            gpu_index=incident.gpu_index,
            job=incident.job,
            ranks=list(incident.ranks),
        )
        await self._incidents.open_or_bump(
            spec,
            count=0,
            refresh=True,
            evidence_update=FlightRecorderUpdate(flight_recorder=evidence),
        )


def flight_evidence(
    dumps: dict[int, wire.FlightRecorderDump], ranks: set[int], incident: IncidentState
) -> FlightRecorderEvidence:
    """What the dumps say, next to the incident's own verdict (pure).

    Only the job's ``ranks`` count: a dump from another rank is left out, and a group's
    members are the membership most dumps report, less any rank not of the job. A dump
    is what an agent relayed: one from rank 999 of an 8-rank job, or one that leaves a
    member out of its group, must not put a rank that does not exist in the incident's
    verdict, nor take the culprit out of it (the last dump's list used to win).
    """
    dumps = {r: d for r, d in dumps.items() if r in ranks}
    members = _members(dumps.values(), ranks)
    usable = {r: {"entries": d.entries} for r, d in dumps.items() if d.enabled and not d.error}
    errors = {str(r): d.error for r, d in dumps.items() if d.error}
    divergences = analyze(usable, members) if usable else []
    first: Divergence | None = divergences[0] if divergences else None
    agrees: bool | None = None
    verdict = "no dumps to read" if not usable else "the ranks' buffers agree: no divergence"
    if first is not None:
        verdict = (
            f"{first.op} seq {first.seq} on group {first.group}: ranks {first.missing} "
            f"never entered it"
            if first.missing
            else f"{first.op} seq {first.seq} on group "
            f"{first.group}: every rank entered it, none saw it finish"
        )
        if incident.kind == "hang":  # trainguard's culprits are the ranks that never entered
            agrees = sorted(first.missing) == sorted(incident.ranks)
        else:  # comm_hang: every member entered
            agrees = not first.missing
    return FlightRecorderEvidence(
        divergences=[FlightDivergence.model_validate(d.to_dict()) for d in divergences[:8]],
        verdict=verdict,
        agrees_with_trainguard=agrees,
        trainguard_ranks=sorted(incident.ranks),
        dumps_from=sorted(dumps),
        dumps_missing=sorted(ranks - set(dumps)),
        errors=errors,
        paths={str(r): d.path for r, d in dumps.items() if d.path},
    )


def _members(dumps: Iterable[wire.FlightRecorderDump], ranks: set[int]) -> dict[str, list[int]]:
    """Each group's members as most dumps report them, the job's ranks only (a tie: the
    longer list, so one dump cannot hide a member)."""
    said: dict[str, Counter[tuple[int, ...]]] = {}
    for dump in dumps:
        for group, listed in dump.pg_ranks.items():
            said.setdefault(group, Counter())[tuple(r for r in listed if r in ranks)] += 1
    return {
        group: list(min(counts.items(), key=lambda item: (-item[1], -len(item[0]), item[0]))[0])
        for group, counts in said.items()
    }


__all__ = ["HANG_KINDS", "FlightEvidence", "flight_evidence"]
