"""Knobs of the job-side instrumentation, and how the launcher sets them through env vars.

A training script passes at most a job name; everything else has a default that suits a
real job and can be overridden by the launcher (``TRAINGUARD_*`` env vars), so the two-line
change in the script never needs editing when operators tune the watchdog.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from trainguard.wire import NAME_PATTERN

from .errors import CollectivesConfigError


def default_agent_socket() -> str:
    """Where the node agent listens by default (the same rule as ``agents.settings``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no XDG_RUNTIME_DIR: /tmp/runtime-<uid> is fine
        runtime = platformdirs.user_runtime_dir("trainguard")
    return str(Path(runtime) / "trainguard-agent.sock")


#: Where the node agent listens unless the launcher says otherwise.
DEFAULT_AGENT_SOCKET = default_agent_socket()

ENV_JOB = "TRAINGUARD_JOB"
ENV_SOCKET = "TRAINGUARD_AGENT_SOCKET"
ENV_ADDR = "TRAINGUARD_AGENT_ADDR"
ENV_TOKEN_FILE = "TRAINGUARD_AGENT_TOKEN_FILE"
ENV_FAULTS = "TRAINGUARD_FAULTS"
ENV_PREFIX = "TRAINGUARD_COLLECTIVES_"

_NAME_RE = re.compile(NAME_PATTERN)


@dataclass(kw_only=True, slots=True)
class InstrumentConfig:
    """Settings of one instrumented rank. Every ``*_s`` field is in seconds."""

    job: str
    """Job name (RFC 1123, as the controller knows the job)."""
    agent_socket: str = DEFAULT_AGENT_SOCKET
    """Path of the node agent's Unix socket (used when ``agent_addr`` is empty)."""
    agent_addr: str = ""
    """``HOST:PORT`` of the node agent's TCP endpoint (on Kubernetes: the node IP from the
    downward API's ``status.hostIP`` and the agent's hostPort); takes precedence over the
    socket. Needs ``agent_token_file``: the agent refuses a hello without its job token."""
    agent_token_file: str = ""
    """File holding the job token sent in the hello over TCP (a mounted Secret's key); read
    at each connection, so a rotated Secret is picked up on the next reconnect."""
    ship_interval_s: float = 0.15
    """How often the background thread ships a batch and polls for commands: well under a
    second so hangs and commands travel fast, well above the cost of one local frame."""
    watchdog_interval_s: float = 0.25
    """How often the watchdog looks at in-flight calls."""
    watchdog_multiplier: float = 5.0
    """A call is stuck after this many times the median duration of recent calls of its op."""
    watchdog_floor_s: float = 2.0
    """...but never before this: short collectives jitter by milliseconds, not seconds."""
    watchdog_repeat_s: float = 1.0
    """A stuck call is re-reported this often while it stays stuck."""
    report_compute_stalls: bool = False
    """Also report a training thread stuck *outside* any collective within a step (as
    ``op="compute"``, ``group=""``). Off by default: detectors already name ranks that never
    entered a stuck call, and early steps have no history to tell a stall from a long
    forward pass."""
    min_collective_timeout_s: float = 300.0
    """Torch timeouts shorter than this (process-group timeout, NCCL heartbeat) get a
    warning at ``instrument()``: trainguard needs ~8 s to name a hang's culprit, then time to
    collect the Flight Recorder dumps and restart the job; 5 minutes leaves room for a busy
    controller and stays under NCCL's 10-minute default (``collectives/timeouts.py``)."""
    trace_max_entries: int = 2048
    """Newest Flight Recorder entries sent in a ``FlightRecorderDump`` (a hang needs the last
    few per group; each entry is ~0.5 KiB of JSON)."""
    trace_dump_dir: str = ""
    """Also write the full Flight Recorder dump here (``fr-<job>-rank<N>-<command>.json``, the
    format ``torch.distributed.flight_recorder`` reads); empty: do not."""
    heartbeat_interval_s: float = 5.0
    """Cadence of ``RankEvent(kind="heartbeat")``."""
    history_calls: int = 4096
    """Raw per-call records kept on the rank (ring buffer); they never leave the process."""
    duration_window: int = 64
    """Recent durations per op used for the watchdog's median."""
    max_pending_records: int = 10_000
    """Bound of each outgoing buffer (steps, in-flight, events, probes); oldest dropped."""
    connect_backoff_max_s: float = 10.0
    """Longest pause between attempts to reach an absent agent."""
    socket_timeout_s: float = 2.0
    """Send/receive timeout on the agent socket; a wedged agent is dropped after this."""
    cuda_events: bool = True
    """Time CUDA tensors' calls with CUDA events on the stream that runs them, read back by a
    poller with ``Event.query()`` (ignored when CUDA is unavailable); NaN/Inf checks of CUDA
    tensors run on the device and are read back the same way."""
    device_path_on_cpu: bool = False
    """Run CPU tensors' calls through that device path too (a CPU "event" fires when the
    Work's future completes; NaN/Inf flags are read back through the same copy-and-mark):
    how the tests and the benchmark exercise the GPU code on gloo. Off for real CPU jobs."""
    check_nonfinite: bool = True
    """Before each reduction (all_reduce, reduce, reduce_scatter) inside a step, check this
    rank's floating-point CPU input for NaN/Inf with one fused ``sum`` (NaN and Inf survive
    it). That is how the controller names the rank a NaN came *from*: after the reduction
    every rank holds it. Cost: ~4-8 us per call back to back, ~12-16 us right after another
    collective on a loaded 2-core box, plus one read of the tensor (~0.1 ms per 4 MiB). CUDA
    tensors are checked on the device and read back a step later without a sync
    (``collectives.finite``). Turn off for fp16 jobs with dynamic loss scaling, whose
    overflows to Inf are routine."""
    role: str | None = None
    """What work this rank does, when the job knows better than the mesh/pipeline it builds
    (e.g. ``"expert"``); sent in every step summary so detectors compare only ranks of the
    same role. ``None``: derived (``collectives.roles``)."""
    nonfinite_every_steps: int = 1
    """On a device, check reduction inputs for NaN/Inf only every this many steps (the check
    costs a few tiny kernels per reduction and one 16-byte copy per step, never a sync)."""
    nonfinite_check_min_bytes: int = 1024
    """...only on inputs of at least this many bytes. Smaller reductions are scalars and
    flags (losses, norms, stop votes), not gradients, and are the ones issued by the
    thousand: checking them would double the wrapper's per-call cost (docs/collectives.md)."""

    def __post_init__(self) -> None:
        validate_job_name(self.job)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_s") and not value > 0:
                raise CollectivesConfigError(f"{field.name} must be > 0 seconds, got {value!r}")
        if self.agent_addr:
            parse_agent_addr(self.agent_addr)
            if not self.agent_token_file:
                raise CollectivesConfigError(
                    f"agent_addr {self.agent_addr!r} needs agent_token_file (set "
                    f"{ENV_TOKEN_FILE} to the mounted job-token Secret's file)"
                )
        if self.watchdog_multiplier < 1:
            raise CollectivesConfigError(
                f"watchdog_multiplier must be >= 1, got {self.watchdog_multiplier!r}"
            )
        if self.nonfinite_check_min_bytes < 0:
            raise CollectivesConfigError(
                f"nonfinite_check_min_bytes must be >= 0, got {self.nonfinite_check_min_bytes!r}"
            )
        for name in (
            "history_calls",
            "duration_window",
            "max_pending_records",
            "nonfinite_every_steps",
            "trace_max_entries",
        ):
            if getattr(self, name) < 1:
                raise CollectivesConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")


def parse_agent_addr(addr: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port), or a one-line config error."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise CollectivesConfigError(
            f"agent_addr {addr!r} is not HOST:PORT (e.g. {ENV_ADDR}=$(NODE_IP):9471)"
        )
    return host, int(port)


def validate_job_name(job: str) -> str:
    if not isinstance(job, str) or not _NAME_RE.fullmatch(job) or len(job) > 253:
        raise CollectivesConfigError(
            f"job name {job!r} is not a lowercase RFC 1123 name (a-z, 0-9, '-', '.'); "
            f"pass instrument(job=...) or set {ENV_JOB}"
        )
    return job


def config_from_env(
    job: str | None = None, env: Mapping[str, str] | None = None, **overrides: object
) -> InstrumentConfig:
    """Build the config from explicit arguments, then ``TRAINGUARD_*`` env vars, then defaults.

    Numeric knobs come from ``TRAINGUARD_COLLECTIVES_<FIELD>`` (e.g.
    ``TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S=5``).
    """
    env = os.environ if env is None else env
    job = job if job is not None else env.get(ENV_JOB)
    if not job:
        raise CollectivesConfigError(f"no job name: pass instrument(job=...) or set {ENV_JOB}")
    kwargs: dict[str, object] = {"job": job}
    if env.get(ENV_SOCKET):
        kwargs["agent_socket"] = env[ENV_SOCKET]
    if env.get(ENV_ADDR):
        kwargs["agent_addr"] = env[ENV_ADDR]
    if env.get(ENV_TOKEN_FILE):
        kwargs["agent_token_file"] = env[ENV_TOKEN_FILE]
    types = {f.name: f.type for f in dataclasses.fields(InstrumentConfig)}
    for name, type_name in types.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None or name in ("job", "agent_socket", "agent_addr", "agent_token_file"):
            continue
        kwargs[name] = _parse_env_value(ENV_PREFIX + name.upper(), raw, str(type_name))
    kwargs.update(overrides)
    unknown = set(kwargs) - set(types)
    if unknown:
        raise CollectivesConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    return InstrumentConfig(**kwargs)  # type: ignore[arg-type]


def _parse_env_value(var: str, raw: str, type_name: str) -> object:
    if "str" in type_name:
        return raw or None
    try:
        if type_name == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if type_name == "int":
            return int(raw)
        return float(raw)
    except ValueError:
        raise CollectivesConfigError(f"{var}={raw!r} is not a valid {type_name}") from None


__all__ = [
    "DEFAULT_AGENT_SOCKET",
    "ENV_ADDR",
    "ENV_FAULTS",
    "ENV_JOB",
    "ENV_SOCKET",
    "ENV_TOKEN_FILE",
    "InstrumentConfig",
    "config_from_env",
    "parse_agent_addr",
    "validate_job_name",
]
