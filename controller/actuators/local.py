"""The local-process actuator: a job's ranks as processes on this machine, in simulated nodes.

This is what ``trainguard demo`` and the end-to-end tests act through. A job is declared
once with a :class:`LocalJobSpec` (command, node pool, layout, environment); every
:class:`~controller.actuators.base.Placement` the engine hands over becomes one
*generation* of rank processes started with the environment ``torchrun`` would give them
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` …) plus trainguard's own
(``TRAINGUARD_JOB``, ``TRAINGUARD_NODE``, ``TRAINGUARD_GENERATION``,
``TRAINGUARD_RESUME_STEP``, ``TG_TP``) and the per-node extras (each simulated node's agent
socket). Each rank runs in its own process group, so stopping a rank also stops whatever it
spawned (data-loader workers), and logs to its own file per generation.

Stopping is graceful first: SIGTERM lets a rank finish its checkpoint write; after
``grace_s`` the rest get SIGKILL, because a hung rank (the very fault being remediated)
ignores SIGTERM while stuck in a collective. Generations only move forward: a restart to a
generation that is not newer than the last one started is refused, so a retried restart
never starts the job twice.

Errors: :class:`~controller.actuators.base.ActuatorError` with a one-line message (unknown
job, node outside the pool, layout that does not match the spec, stale generation, a
command, log directory or working directory that cannot be used). A generation is recorded
only once all its ranks started: when one cannot start, the ranks already started are
killed and reaped, the previous generation stays the last one started, and the same
generation may be tried again.

A generation whose rank exits with an error before the ranks met (rank 0 could not bind
its port, an import failed) is relaunched on a fresh port, at most ``launch_retries``
times, by a watch that :meth:`LocalActuator.start` starts (:mod:`.local_watch`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.actuators.base import (
    ActuatorError,
    ActuatorResult,
    JobLimits,
    JobPolicy,
    NodeView,
    Placement,
)
from controller.actuators.local_launch import (
    Generation,
    LocalJobSpec,
    Rank,
    free_port,
    peek,
    signal_group,
    spawn_rank,
    start_error,
)
from controller.actuators.local_watch import describe_exit, last_line, launch_failure
from trainguard.wire import RankEvent

__all__ = ["JobStatus", "LocalJobSpec", "LocalProcessActuator", "RankStatus"]

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStatus:
    rank: int
    node: str
    pid: int
    running: bool
    #: ``None`` while running; negative: killed by that signal (as in :mod:`subprocess`).
    exit_code: int | None
    log_path: Path


@dataclass(frozen=True, kw_only=True, slots=True)
class JobStatus:
    """What the ranks of the last generation are doing, for the engine's job watcher."""

    placement: Placement
    ranks: list[RankStatus]

    @property
    def finished(self) -> bool:
        """Every rank has exited."""
        return all(not r.running for r in self.ranks)

    @property
    def succeeded(self) -> bool:
        """Every rank exited with status 0 (the job completed its training); never for no ranks."""
        return bool(self.ranks) and all(r.exit_code == 0 for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "job": self.placement.job,
            "generation": self.placement.generation,
            "finished": self.finished,
            "succeeded": self.succeeded,
            "ranks": [
                {
                    "rank": r.rank,
                    "node": r.node,
                    "pid": r.pid,
                    "running": r.running,
                    "exit_code": r.exit_code,
                    "log": str(r.log_path),
                }
                for r in self.ranks
            ],
        }


class LocalProcessActuator:
    """Runs registered jobs as local rank processes; see the module docstring."""

    name = "local"

    def __init__(
        self,
        *,
        grace_s: float = 10.0,
        max_events: int = 1000,
        jobs: Sequence[tuple[LocalJobSpec, Placement]] = (),
        launch_retries: int = 2,
        launch_window_s: float = 300.0,
        launch_grace_s: float = 10.0,
        watch_interval_s: float = 0.5,
    ) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        if launch_retries < 0:
            raise ValueError(f"launch_retries must be >= 0, got {launch_retries}")
        #: Relaunches of a generation whose ranks never met (:mod:`.local_watch`); how long
        #: after a launch an error exit can count as one, and how long it is watched first.
        self.launch_retries = launch_retries
        self.launch_window_s = launch_window_s
        self.launch_grace_s = launch_grace_s
        self.watch_interval_s = watch_interval_s
        self._watch: asyncio.Task[None] | None = None
        #: Seconds between SIGTERM and SIGKILL when stopping ranks.
        self.grace_s = grace_s
        self._specs: dict[str, LocalJobSpec] = {}
        self._gens: dict[str, Generation] = {}
        self._isolated: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: The last events recorded (newest last), for the demo summary and tests.
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)
        #: Jobs launched at :meth:`start` (the ``local_jobs_file``), with their first placement.
        self._configured = list(jobs)

    async def start(self) -> list[Placement]:
        """Register the configured jobs and launch those not running yet.

        One job that cannot start does not keep the others from starting: every job is
        tried, then one :class:`ActuatorError` names each that failed.
        """
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_launches(), name="local-launch-watch")
        launched = []
        failed: list[str] = []
        for spec, placement in self._configured:
            self.register(spec)
            if await self.current_placement(spec.name) is not None:
                continue
            try:
                result = await self.launch(placement)
            except ActuatorError as exc:
                failed.append(str(exc))
                log.error("local job not launched: %s", exc, extra={"fields": {"job": spec.name}})
                continue
            launched.append(placement)
            log.info(
                "local job launched",
                extra={"fields": {"job": spec.name, "outcome": result.outcome}},
            )
        if failed:
            raise ActuatorError(
                f"{len(failed)} of {len(self._configured)} configured local jobs did not "
                f"start: {'; '.join(failed)}"
            )
        return launched

    def observe_ranks(self, node: str, events: Sequence[RankEvent]) -> None:
        """This actuator placed every rank itself; what it learns is that a generation's
        ranks met (a ``started`` event after its launch), which ends its launch watch."""
        for event in events:
            gen = self._gens.get(event.job)
            if (
                event.kind == "started"
                and gen is not None
                and event.time_unix_s >= gen.launched_unix_s
            ):
                gen.joined = True

    async def node_view(self, node: str) -> NodeView:
        """No node health of its own to ask (``ready`` unknown); whether the ranks it runs on
        ``node`` are still alive is what it knows."""
        alive = [
            peek(r.proc) is None for gen in self._gens.values() for r in gen.ranks if r.node == node
        ]
        return NodeView(pods_running=any(alive) if alive else None)

    async def job_policy(self, job: str) -> JobPolicy | None:
        """Local jobs carry no policy of their own: the controller's rule applies."""
        return None

    def forget_job(self, job: str) -> None:
        """A job the controller forgot (``job_retention_s``). What this actuator keeps of a
        registered job (its spec, its last generation's processes and logs) is bounded by
        its configuration and is its own to stop at :meth:`close`, so it stays; only the
        lock a stop or restart of a job it never registered left behind goes."""
        lock = self._locks.get(job)
        unknown = job not in self._specs and job not in self._gens
        if unknown and lock is not None and not lock.locked():
            del self._locks[job]

    def limits(self, job: str) -> JobLimits | None:
        """A registered job's own ``min_dp`` and batch divisor."""
        spec = self._specs.get(job)
        if spec is None:
            return None
        return JobLimits(min_dp=spec.min_dp, dp_must_divide=spec.dp_must_divide)

    # -- registration and queries -------------------------------------------------------

    def register(self, spec: LocalJobSpec) -> None:
        """Declare a job; re-registering replaces the spec for the next launch."""
        self._specs[spec.name] = spec

    def spec(self, job: str) -> LocalJobSpec:
        try:
            return self._specs[job]
        except KeyError:
            raise ActuatorError(f"job {job!r} is not registered with the local actuator") from None

    @property
    def isolated_nodes(self) -> dict[str, str]:
        """Isolated node -> reason. Nothing is cordoned locally; this is bookkeeping."""
        return dict(self._isolated)

    async def candidate_nodes(self, job: str) -> list[str]:
        """The job's declared pool, as is: the engine subtracts isolated and unhealthy nodes."""
        return list(self.spec(job).pool)

    async def current_placement(self, job: str) -> Placement | None:
        gen = self._gens.get(job)
        return gen.placement if gen is not None else None

    def status(self, job: str) -> JobStatus | None:
        """Per-rank pid, node and exit code of the last generation (``None``: never launched)."""
        gen = self._gens.get(job)
        if gen is None:
            return None
        ranks = []
        for r in gen.ranks:
            code = peek(r.proc)
            ranks.append(
                RankStatus(
                    rank=r.rank,
                    node=r.node,
                    pid=r.proc.pid,
                    running=code is None,
                    exit_code=code,
                    log_path=r.log_path,
                )
            )
        return JobStatus(placement=gen.placement, ranks=ranks)

    async def wait_finished(self, job: str, *, timeout_s: float | None = None) -> JobStatus:
        """Wait until every rank of the last generation exited; on timeout return as is.

        The caller checks :attr:`JobStatus.finished`; a timeout is not an error because the
        engine polls this alongside its other work.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = self.status(job)
            if st is None:
                raise ActuatorError(f"job {job!r} was never launched")
            if st.finished or (deadline is not None and time.monotonic() >= deadline):
                return st
            await asyncio.sleep(_POLL_S * 5)

    # -- nodes --------------------------------------------------------------------------

    async def isolate_node(self, node: str, *, reason: str) -> ActuatorResult:
        if node in self._isolated:
            return ActuatorResult(outcome=f"node {node} already isolated", details={"node": node})
        self._isolated[node] = reason
        await self.record_event(target=node, reason="Isolated", message=reason, warning=True)
        return ActuatorResult(outcome=f"node {node} isolated", details={"node": node})

    async def release_node(self, node: str, *, reason: str) -> ActuatorResult:
        if self._isolated.pop(node, None) is None:
            return ActuatorResult(outcome=f"node {node} was not isolated", details={"node": node})
        await self.record_event(target=node, reason="Released", message=reason)
        return ActuatorResult(outcome=f"node {node} released", details={"node": node})

    # -- launching and stopping ---------------------------------------------------------

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    async def launch(self, placement: Placement) -> ActuatorResult:
        """Start ``placement`` as a new generation; refused while a generation still runs.

        A previous generation whose ranks all exited on their own is swept first (its
        process groups get SIGKILL), as a restart would: their children do not outlive it.
        """
        async with self._lock(placement.job):
            gen = self._gens.get(placement.job)
            if gen is not None and not gen.stopped and any(peek(r.proc) is None for r in gen.ranks):
                raise ActuatorError(
                    f"job {placement.job!r} generation {gen.placement.generation} is still "
                    "running; use restart_job"
                )
            self._prepare(placement)
            if gen is not None and not gen.stopped:
                await self._stop(gen)
            return self._launch(placement)

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        """Stop the running generation and start ``placement``; refused unless it is newer."""
        async with self._lock(placement.job):
            # Everything that can be checked is, before the running generation is stopped.
            self._prepare(placement)
            gen = self._gens.get(placement.job)
            stopped: dict[str, Any] = {}
            if gen is not None:
                stopped = (await self._stop(gen)).details
            result = self._launch(placement)
            await self.record_event(
                target=placement.job,
                reason="Restarted",
                message=f"generation {placement.generation} on {','.join(placement.nodes)}: "
                f"{reason}",
            )
            return ActuatorResult(
                outcome=f"job {placement.job} restarted as generation {placement.generation} "
                f"on {len(placement.nodes)} nodes (world {placement.world_size})",
                details={**result.details, "stopped": stopped},
            )

    async def stop_job(self, job: str, *, reason: str) -> ActuatorResult:
        """SIGTERM every rank, SIGKILL what is left after ``grace_s``; idempotent."""
        async with self._lock(job):
            gen = self._gens.get(job)
            if gen is None or gen.stopped:
                return ActuatorResult(outcome=f"job {job} not running", details={"job": job})
            result = await self._stop(gen)
        await self.record_event(target=job, reason="Stopped", message=reason)
        return result

    async def close(self) -> None:
        """Stop every job this actuator started (graceful, then forced)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        for job in list(self._gens):
            await self.stop_job(job, reason="local actuator closing")

    async def record_event(
        self, *, target: str, reason: str, message: str, warning: bool = False
    ) -> None:
        """One structured log line (and a bounded in-memory list): the local event stream."""
        event = {"target": target, "reason": reason, "message": message, "warning": warning}
        self.events.append({**event, "ts": time.time()})
        log.log(
            logging.WARNING if warning else logging.INFO,
            "%s %s: %s",
            reason,
            target,
            message,
            extra={"fields": {"event": event}},
        )

    # -- the launch watch ----------------------------------------------------------------

    async def _watch_launches(self) -> None:
        while True:
            await asyncio.sleep(self.watch_interval_s)
            for job in list(self._gens):
                try:
                    await self.check_launch(job)
                except Exception:  # one bad check must not end the watch of every job
                    log.exception("local launch watch failed", extra={"fields": {"job": job}})

    async def check_launch(self, job: str) -> None:
        """Relaunch ``job``'s generation if a rank failed before the ranks met; see
        :mod:`.local_watch`."""
        gen = self._gens.get(job)
        if gen is None or self._failed_launch(gen) is None:
            return
        async with self._lock(job):
            failed = self._failed_launch(gen) if self._gens.get(job) is gen else None
            if failed is None:
                return  # restarted or stopped meanwhile
            rank, code = failed
            said = last_line(rank.log_path)
            what = (
                f"generation {gen.placement.generation}: rank {rank.rank} exited with "
                f"{describe_exit(code)} before the ranks met" + (f" ({said})" if said else "")
            )
            reason, message = await self._relaunch(gen, rank, what)
            await self.record_event(target=job, reason=reason, message=message, warning=True)

    async def _relaunch(self, gen: Generation, rank: Rank, what: str) -> tuple[str, str]:
        """Relaunch ``gen`` if a retry is left; the event that says what was done."""
        if gen.relaunches >= self.launch_retries:
            gen.gave_up = True
            return "LaunchFailed", (
                f"{what}; not relaunched again after {gen.relaunches} relaunch(es); "
                f"see {rank.log_path}"
            )
        await self._stop(gen)
        try:
            self._launch(gen.placement)
        except ActuatorError as exc:
            gen.gave_up = True
            return "LaunchFailed", f"{what}; {exc}"
        new = self._gens[gen.placement.job]
        new.relaunches = gen.relaunches + 1
        return "LaunchRetried", (
            f"{what}; relaunched on port {new.port} "
            f"(retry {new.relaunches} of {self.launch_retries})"
        )

    def _failed_launch(self, gen: Generation) -> tuple[Rank, int] | None:
        return launch_failure(
            gen, time.time(), window_s=self.launch_window_s, grace_s=self.launch_grace_s
        )

    # -- machinery ----------------------------------------------------------------------

    def _check(self, placement: Placement) -> None:
        spec = self.spec(placement.job)
        if (placement.ranks_per_node, placement.tp) != (spec.ranks_per_node, spec.tp):
            raise ActuatorError(
                f"placement of job {placement.job!r} has ranks_per_node="
                f"{placement.ranks_per_node}, tp={placement.tp}; the spec says "
                f"{spec.ranks_per_node}, {spec.tp}"
            )
        outside = [n for n in placement.nodes if n not in spec.pool]
        if outside:
            raise ActuatorError(
                f"placement of job {placement.job!r} uses nodes outside its pool: "
                f"{', '.join(outside)}"
            )
        gen = self._gens.get(placement.job)
        if gen is not None and placement.generation <= gen.placement.generation:
            raise ActuatorError(
                f"job {placement.job!r} generation {placement.generation} is not newer than "
                f"generation {gen.placement.generation}, already started"
            )

    def _prepare(self, placement: Placement) -> None:
        """Refuse ``placement`` if it cannot be started: layout, pool, generation, directories."""
        self._check(placement)
        spec = self.spec(placement.job)
        try:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ActuatorError(
                f"job {placement.job!r}: cannot create log_dir {spec.log_dir}: "
                f"{exc.strerror or exc}"
            ) from None
        if spec.cwd is not None and not spec.cwd.is_dir():
            raise ActuatorError(
                f"job {placement.job!r}: working directory {spec.cwd} does not exist "
                "or is not a directory"
            )

    def _launch(self, placement: Placement) -> ActuatorResult:
        """Start every rank, or none: the generation is recorded only once all started.
        The callers have run :meth:`_prepare` (before stopping anything)."""
        spec = self.spec(placement.job)
        old = self._gens.get(placement.job)
        port = free_port(old.port if old is not None else None)
        ranks: list[Rank] = []
        try:
            for rank in range(placement.world_size):
                ranks.append(spawn_rank(spec, placement, rank, port))
        except Exception as exc:
            for r in ranks:
                signal_group(r, signal.SIGKILL)
                r.proc.wait()
                r.log_file.close()
            raise ActuatorError(
                f"job {placement.job!r}: cannot start rank {len(ranks)} "
                f"({spec.argv[0]}): {start_error(exc, spec)}"
            ) from exc
        self._gens[placement.job] = Generation(placement=placement, port=port, ranks=ranks)
        return ActuatorResult(
            outcome=f"job {placement.job} generation {placement.generation} started "
            f"({placement.world_size} ranks on {len(placement.nodes)} nodes)",
            details={
                "generation": placement.generation,
                "nodes": list(placement.nodes),
                "world_size": placement.world_size,
                "master_port": port,
                "pids": [r.proc.pid for r in ranks],
            },
        )

    async def _stop(self, gen: Generation) -> ActuatorResult:
        # Ranks are only reaped at the very end, so every group id stays ours until the
        # SIGKILL sweep: children of a rank that exited on SIGTERM are not left behind.
        started = time.monotonic()
        for r in gen.ranks:
            signal_group(r, signal.SIGTERM)
        deadline = started + self.grace_s
        while any(peek(r.proc) is None for r in gen.ranks) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        killed = [r.rank for r in gen.ranks if peek(r.proc) is None]
        for r in gen.ranks:
            signal_group(r, signal.SIGKILL)
        while any(r.proc.poll() is None for r in gen.ranks):
            await asyncio.sleep(_POLL_S)
        for r in gen.ranks:
            r.log_file.close()
        gen.stopped = True
        p = gen.placement
        return ActuatorResult(
            outcome=f"job {p.job} generation {p.generation} stopped"
            + (f" ({len(killed)} ranks needed SIGKILL)" if killed else ""),
            details={
                "generation": p.generation,
                "killed_ranks": killed,
                "exit_codes": [r.proc.returncode for r in gen.ranks],
                "stop_s": round(time.monotonic() - started, 3),
            },
        )
