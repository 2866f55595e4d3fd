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
command that cannot start).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from controller.actuators.base import (
    ActuatorError,
    ActuatorResult,
    JobLimits,
    JobPolicy,
    NodeView,
    Placement,
)
from trainguard.wire import RankEvent

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalJobSpec:
    """How to run one job's ranks locally, whatever placement the engine picks."""

    name: str
    #: The command every rank runs, e.g. ``[sys.executable, "-m", "demojob.train"]``.
    argv: Sequence[str]
    #: Simulated node names the job may use, in the order spares should be preferred.
    pool: Sequence[str]
    ranks_per_node: int
    #: Tensor-parallel size; must divide ``ranks_per_node`` so a TP group stays on one node.
    tp: int = 1
    #: Extra environment for every rank (on top of this process's environment).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Extra environment per node, e.g. ``{"node-a": {"TRAINGUARD_AGENT_SOCKET": "/…/a.sock"}}``.
    node_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: One log file per rank per generation lands here: ``<job>.g<gen>.rank<rank>.log``.
    log_dir: Path = Path(".")
    #: Smallest data-parallel size worth running (the planner's ``min_dp``).
    min_dp: int = 1
    #: The global batch; dp must divide it (the planner's ``dp_must_divide``).
    dp_must_divide: int | None = None
    #: Working directory of the ranks (``None``: this process's).
    cwd: Path | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"job {self.name!r}: argv is empty")
        if not self.pool or len(set(self.pool)) != len(self.pool):
            raise ValueError(f"job {self.name!r}: pool must be non-empty without repeats")
        if self.ranks_per_node < 1 or self.tp < 1 or self.ranks_per_node % self.tp:
            raise ValueError(
                f"job {self.name!r}: tp={self.tp} must divide ranks_per_node={self.ranks_per_node}"
            )
        unknown = set(self.node_env) - set(self.pool)
        if unknown:
            raise ValueError(f"job {self.name!r}: node_env names nodes outside the pool: {unknown}")


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
        """Every rank exited with status 0 (the job completed its training)."""
        return all(r.exit_code == 0 for r in self.ranks)

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


@dataclass(slots=True)
class _Rank:
    rank: int
    node: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


@dataclass(slots=True)
class _Generation:
    placement: Placement
    port: int
    ranks: list[_Rank]
    stopped: bool = False


def _free_port(avoid: int | None) -> int:
    """A port free right now on 127.0.0.1, different from the previous generation's.

    Never the old port: the old rendezvous may still sit in TIME_WAIT, and a fresh port
    makes a late rank of the old generation unable to join the new one.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port


class LocalProcessActuator:
    """Runs registered jobs as local rank processes; see the module docstring."""

    name = "local"

    def __init__(
        self,
        *,
        grace_s: float = 10.0,
        max_events: int = 1000,
        jobs: Sequence[tuple[LocalJobSpec, Placement]] = (),
    ) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        #: Seconds between SIGTERM and SIGKILL when stopping ranks.
        self.grace_s = grace_s
        self._specs: dict[str, LocalJobSpec] = {}
        self._gens: dict[str, _Generation] = {}
        self._isolated: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: The last events recorded (newest last), for the demo summary and tests.
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)
        #: Jobs launched at :meth:`start` (the ``local_jobs_file``), with their first placement.
        self._configured = list(jobs)

    async def start(self) -> list[Placement]:
        """Register the configured jobs and launch those not running yet."""
        launched = []
        for spec, placement in self._configured:
            self.register(spec)
            if await self.current_placement(spec.name) is None:
                result = await self.launch(placement)
                launched.append(placement)
                log.info(
                    "local job launched",
                    extra={"fields": {"job": spec.name, "outcome": result.outcome}},
                )
        return launched

    def observe_ranks(self, node: str, events: Sequence[RankEvent]) -> None:
        """Nothing to learn: this actuator placed every rank itself."""

    async def node_view(self, node: str) -> NodeView:
        """No node health of its own to ask (``ready`` unknown); whether the ranks it runs on
        ``node`` are still alive is what it knows."""
        alive = [
            _peek(r.proc) is None
            for gen in self._gens.values()
            for r in gen.ranks
            if r.node == node
        ]
        return NodeView(pods_running=any(alive) if alive else None)

    async def job_policy(self, job: str) -> JobPolicy | None:
        """Local jobs carry no policy of their own: the controller's rule applies."""
        return None

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
            code = _peek(r.proc)
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
        """Start ``placement`` as a new generation; refused while a generation still runs."""
        async with self._lock(placement.job):
            gen = self._gens.get(placement.job)
            if (
                gen is not None
                and not gen.stopped
                and any(_peek(r.proc) is None for r in gen.ranks)
            ):
                raise ActuatorError(
                    f"job {placement.job!r} generation {gen.placement.generation} is still "
                    "running; use restart_job"
                )
            return self._launch(placement)

    async def restart_job(self, placement: Placement, *, reason: str) -> ActuatorResult:
        """Stop the running generation and start ``placement``; refused unless it is newer."""
        async with self._lock(placement.job):
            self._check(placement)
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

    def _launch(self, placement: Placement) -> ActuatorResult:
        self._check(placement)
        spec = self.spec(placement.job)
        old = self._gens.get(placement.job)
        port = _free_port(old.port if old is not None else None)
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        ranks: list[_Rank] = []
        try:
            for rank in range(placement.world_size):
                ranks.append(self._spawn(spec, placement, rank, port))
        except OSError as exc:
            self._gens[placement.job] = _Generation(placement=placement, port=port, ranks=ranks)
            for r in ranks:
                _signal_group(r, signal.SIGKILL)
                r.proc.wait()
                r.log_file.close()
            self._gens[placement.job].stopped = True
            raise ActuatorError(
                f"job {placement.job!r}: cannot start {spec.argv[0]}: {exc}"
            ) from exc
        self._gens[placement.job] = _Generation(placement=placement, port=port, ranks=ranks)
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

    def _spawn(self, spec: LocalJobSpec, placement: Placement, rank: int, port: int) -> _Rank:
        node = placement.node_of(rank)
        # Nothing of the controller's own configuration (its tokens above all) reaches a rank.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update(spec.env)
        env.update(spec.node_env.get(node, {}))
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(placement.world_size),
                "LOCAL_RANK": str(rank % placement.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(placement.ranks_per_node),
                "GROUP_RANK": str(rank // placement.ranks_per_node),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TRAINGUARD_JOB": placement.job,
                "TRAINGUARD_NODE": node,
                "TRAINGUARD_GENERATION": str(placement.generation),
                # One GPU per rank: local rank k uses the node's GPU k.
                "TRAINGUARD_GPU_INDEX": str(rank % placement.ranks_per_node),
                "TG_TP": str(placement.tp),
            }
        )
        if placement.resume_step is not None:
            env["TRAINGUARD_RESUME_STEP"] = str(placement.resume_step)
        log_path = spec.log_dir / f"{placement.job}.g{placement.generation}.rank{rank}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - lives as long as the rank
        try:
            proc = subprocess.Popen(
                list(spec.argv),
                env=env,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: signal the rank and its children
            )
        except OSError:
            log_file.close()
            raise
        return _Rank(rank=rank, node=node, proc=proc, log_path=log_path, log_file=log_file)

    async def _stop(self, gen: _Generation) -> ActuatorResult:
        # Ranks are only reaped at the very end, so every group id stays ours until the
        # SIGKILL sweep: children of a rank that exited on SIGTERM are not left behind.
        started = time.monotonic()
        for r in gen.ranks:
            _signal_group(r, signal.SIGTERM)
        deadline = started + self.grace_s
        while any(_peek(r.proc) is None for r in gen.ranks) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        killed = [r.rank for r in gen.ranks if _peek(r.proc) is None]
        for r in gen.ranks:
            _signal_group(r, signal.SIGKILL)
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


def _peek(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status of ``proc`` without reaping it (``None``: still running).

    Negative for a signal, as :mod:`subprocess` reports it. Not reaping keeps the pid,
    hence the process group id, reserved until the actuator has swept the group.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(rank: _Rank, sig: signal.Signals) -> None:
    """Signal the rank's process group, also when the rank itself already exited.

    Safe while the rank is not yet reaped (see :func:`_peek`): until then its pid (= the
    group id) cannot be reused. Once reaped (``returncode`` set) the group is left alone.
    """
    if rank.proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rank.proc.pid, sig)
