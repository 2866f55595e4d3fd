"""How the local actuator starts ranks: the job spec, one rank's process, its process group.

Split out of :mod:`controller.actuators.local` (which re-exports :class:`LocalJobSpec` and
keeps the generations' bookkeeping): the spec and what checks it, starting one rank with
its environment, and peeking at, signalling and sweeping a rank's process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from controller.actuators.base import Placement
from trainguard import ports


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
        # What the kernel cannot take (execve strings are NUL-terminated) is refused here,
        # not half-way through starting a generation.
        checks: list[tuple[str, object]] = [
            ("name", self.name),
            ("argv", list(self.argv)),
            ("pool", list(self.pool)),
            ("env", dict(self.env)),
            ("node_env", {n: dict(e) for n, e in self.node_env.items()}),
            ("log_dir", self.log_dir),
            ("cwd", self.cwd),
        ]
        for what, value in checks:
            problem = field_problem(what, value)
            if problem:
                raise ValueError(f"job {self.name!r}: {problem}")


def field_problem(what: str, value: object) -> str | None:
    """Why ``value`` cannot be the job spec's field ``what``, in one line; ``None`` if it can.

    The one rule for what a rank's execve cannot take: a NUL byte anywhere (C strings end
    there), and for ``env`` / ``node_env`` a variable name that is empty or holds ``=``.
    :class:`LocalJobSpec` and the jobs file's model (``remediation.wiring.LocalJob``, which
    names the field in its error) both ask it.
    """
    if has_nul(value):
        return f"{what} contains a NUL byte"
    envs: list[Mapping[object, object]] = []
    if what == "env" and isinstance(value, Mapping):
        envs = [value]
    elif what == "node_env" and isinstance(value, Mapping):
        envs = [env for env in value.values() if isinstance(env, Mapping)]
    bad = [k for env in envs for k in env if not k or "=" in str(k)]
    return f"bad environment variable names: {bad}" if bad else None


@dataclass(slots=True)
class Rank:
    rank: int
    node: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


@dataclass(slots=True)
class Generation:
    placement: Placement
    port: int
    ranks: list[Rank]
    stopped: bool = False
    launched_unix_s: float = field(default_factory=time.time)
    #: A rank of this generation said "started" (its rendezvous completed): from then on a
    #: rank's exit is the job's, for the detectors, not a failed launch.
    joined: bool = False
    #: How many times this generation was relaunched after a failed launch.
    relaunches: int = 0
    #: When each rank was first seen exited with an error (:mod:`.local_watch`).
    failed_seen: dict[int, float] = field(default_factory=dict)
    #: The last relaunch was spent: the failure is reported once and left as it is.
    gave_up: bool = False


def has_nul(value: object) -> bool:
    """Whether a NUL byte hides in ``value`` (strings, paths, lists, dict keys and values)."""
    if isinstance(value, str | bytes | os.PathLike):
        text = os.fspath(value)
        return ("\0" if isinstance(text, str) else b"\0") in text
    if isinstance(value, Mapping):
        return any(has_nul(k) or has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_nul(v) for v in value)
    return False


def free_port(avoid: int | None) -> int:
    """A port free right now on 127.0.0.1, different from the previous generation's.

    Never the old port: the old rendezvous may still sit in TIME_WAIT, and a fresh port
    makes a late rank of the old generation unable to join the new one. Drawn outside the
    ephemeral range (``trainguard.ports``): rank 0 binds it only after importing torch.
    """
    return ports.free_port(avoid=() if avoid is None else (avoid,))


def spawn_rank(spec: LocalJobSpec, placement: Placement, rank: int, port: int) -> Rank:
    """Start rank ``rank`` of ``placement`` in its own process group, logging to its file."""
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
    except BaseException:
        log_file.close()
        raise
    return Rank(rank=rank, node=node, proc=proc, log_path=log_path, log_file=log_file)


def start_error(exc: Exception, spec: LocalJobSpec) -> str:
    """One line on why a rank did not start, naming the working directory when it is that."""
    if isinstance(exc, OSError):
        if spec.cwd is not None and exc.filename is not None and Path(exc.filename) == spec.cwd:
            return f"working directory {spec.cwd}: {exc.strerror}"
        return exc.strerror or str(exc)
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def peek(proc: subprocess.Popen[bytes]) -> int | None:
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


def signal_group(rank: Rank, sig: signal.Signals) -> None:
    """Signal the rank's process group, also when the rank itself already exited.

    Safe while the rank is not yet reaped (see :func:`peek`): until then its pid (= the
    group id) cannot be reused. Once reaped (``returncode`` set) the group is left alone.
    """
    if rank.proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rank.proc.pid, sig)
