"""Chaos drills: inject faults into a running job's ranks through their agents.

The same deterministic faults the tests use (``collectives.faults``) can be added to a live
job, so an operator can check, on the real cluster, that a straggler, a hang or a crash is
detected, localized and acted on. One ``job_inject_faults`` command goes to every node that
hosts a rank of the job; each agent relays it to its local ranks, which add the faults at
their next step. The controller checks what it can (the job exists and all its ranks have
reported, fault kinds, ranks in range); each rank validates the remaining fields and logs a refusal.
"""

from __future__ import annotations

from controller.errors import Conflict, InvalidInput, NotFound
from controller.services.commands import CommandService
from controller.state import ClusterState, CommandState
from trainguard import wire


def _ranks_of(fault: wire.FaultSpec) -> list[int]:
    extra = fault.model_extra or {}
    out: list[int] = []
    for key in ("rank", "ranks"):
        value = extra.get(key)
        if isinstance(value, int):
            out.append(value)
        elif isinstance(value, list):
            out.extend(v for v in value if isinstance(v, int))
    return out


def _span(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return f"[{shown}{', …' if len(ranks) > 8 else ''}]"


async def inject_faults(
    state: ClusterState,
    commands: CommandService,
    job: str,
    faults: list[wire.FaultSpec],
    *,
    reason: str,
    by: str,
) -> list[CommandState]:
    job_state = state.jobs.get(job)
    if job_state is None:
        raise NotFound(f"job {job!r} not found; it appears once its ranks report")
    for i, fault in enumerate(faults):
        bad = [r for r in _ranks_of(fault) if not 0 <= r < max(job_state.world_size, 1)]
        if bad:
            raise InvalidInput(
                f"body.faults.{i}: rank {bad[0]} is not in job {job!r} "
                f"(world size {job_state.world_size})"
            )
    running = {rank: r.node for rank, r in job_state.ranks.items() if r.state == "running"}
    if not running:
        raise Conflict(f"job {job!r} has no running ranks to inject faults into")
    # Every rank must be reachable: a fault names ranks, and the ranks apply faults in
    # lock step, so a drill sent while part of the job has not reported yet would reach
    # only some nodes and silently miss its target.
    missing = [r for r in range(job_state.world_size) if r not in running]
    if missing:
        raise Conflict(
            f"job {job!r}: rank(s) {_span(missing)} have not reported as running yet; "
            "retry once the whole job reports"
        )
    nodes = sorted(set(running.values()))
    created = []
    for node in nodes:
        request = wire.JobInjectFaults(
            id="assigned-by-server", job=job, faults=faults, reason=reason or "chaos drill"
        )
        created.append(await commands.create(node, request, by=by))
    return created
