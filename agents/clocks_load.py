"""The ``clocks_load`` preflight check: SM clocks and clock-event reasons under a short load.

A GPU can pass every idle check and still be unable to run fast: a stuck slowdown signal,
a failed fan or power stage, a board pinned at low clocks. Only a load shows it. The agent
never imports torch, so the load is a subprocess per GPU (by default
``collectives/gpu_load.py``: back-to-back matmuls, bf16 where supported), all GPUs at once
so the node is heated and powered as under a job; meanwhile a sampling thread reads, per
GPU, the SM clock (``nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)``), the clock-event reasons
(``nvmlDeviceGetCurrentClocksEventReasons``, ``...ThrottleReasons`` on drivers before r535)
and the utilization (``nvmlDeviceGetUtilizationRates``). This all runs on the caller's
thread and its own sampler, never on the agent's reporter thread (the daemon starts it on a
``preflight-load`` thread and acks the command when it ends).

Verdict, per GPU, over the *loaded* samples (taken while its load process ran, GPU
utilization ≥ :data:`LOADED_UTILIZATION_PCT`):

* **fail** when any loaded sample has a hardware slowdown reason (:data:`SLOWDOWN_REASONS`:
  ``HwSlowdown``, ``SwThermalSlowdown``, ``HwThermalSlowdown``, ``HwPowerBrakeSlowdown``,
  the set the controller's ``gpu_degraded`` rule uses; ``SwPowerCap`` is not one, a GPU at
  its power limit under a heavy GEMM is normal), or when the median SM clock is below
  :data:`MIN_CLOCK_FRACTION` of the reference (the board's max SM clock, or the upper lock
  this agent set on purpose through a ``lock_clocks`` command);
* **fail** when the load command fails (non-zero status other than the two below), runs past
  ``seconds + grace_s`` (it is killed), or exits 0 although NVML never saw the GPU busy
  (a load that reached no GPU proves nothing);
* **skip**, with the reason, where no load can be generated: the check is disabled, torch is
  not importable (status 3, or no ``torch`` for the agent's own interpreter), no CUDA device
  (status 4), NVML answers NOT_SUPPORTED for the GPU's SM clock or utilization (a MIG-enabled
  or virtual GPU: no load can be confirmed), a job's ranks are connected to this agent (a
  load would slow them), or the agent stopped during the load;
* **pass** otherwise. There is no pass without a load that NVML saw. Clock-event reasons
  answered NOT_SUPPORTED leave the clock to judge by, and the verdict says so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pynvml

from agents.gpu.backend import GpuBackend
from agents.nics import NicMonitor
from agents.preflight import Check, Status, evaluate
from agents.sampler import ClockEventReasons, GpuSampler
from trainguard.wire import GpuInfo, GpuSample, decode_throttle_reasons

log = logging.getLogger(__name__)

#: The median SM clock under load must reach this fraction of the reference clock. A healthy
#: board under a power-capped GEMM runs well above it; a stuck slowdown (typically half the
#: clock or less) or a board left at idle clocks (~345 of 1980 MHz on an H100) falls below.
MIN_CLOCK_FRACTION = 0.6
#: A sample counts as loaded from this GPU utilization on (NVML's busy-time percentage).
LOADED_UTILIZATION_PCT = 50
#: Clock-event reasons that fail the check (pynvml constant names; the bits match
#: ``trainguard.wire.THROTTLE_REASON_BITS``).
SLOWDOWN_REASONS = (
    pynvml.nvmlClocksEventReasonHwSlowdown
    | pynvml.nvmlClocksEventReasonSwThermalSlowdown
    | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
)
#: NVML's answers for "this board does not report that" (vGPU, MIG-enabled and some consumer
#: boards): not a failure of the GPU, so never a failed check.
_UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
#: Exit statuses of the load generator (``collectives.gpu_load``; a test pins them equal).
EXIT_NO_TORCH = 3
EXIT_NO_CUDA = 4
#: The real load generator, run as a file so that a node without torch gets status 3.
GPU_LOAD_FILE = "gpu_load.py"
#: Longest wait for the sampling thread once the loads ended; past it NVML hung.
SAMPLER_JOIN_S = 5.0


def default_load_command() -> list[str] | None:
    """``collectives/gpu_load.py`` for this interpreter, or None when the package (or torch
    for this interpreter) is missing. Located without importing either package."""
    spec = importlib.util.find_spec("collectives")
    if spec is None or spec.origin is None or importlib.util.find_spec("torch") is None:
        return None
    script = Path(spec.origin).with_name(GPU_LOAD_FILE)
    if not script.is_file():
        return None
    return [sys.executable, str(script), "--gpu", "{gpu}", "--seconds", "{seconds}"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadSettings:
    """How to load the GPUs. ``command`` is a template: ``{gpu}`` (the UUID, else the index),
    ``{uuid}``, ``{index}`` and ``{seconds}`` are filled per GPU."""

    command: tuple[str, ...]
    seconds: float = 10.0
    #: Allowed on top of ``seconds`` before the command is killed: python, torch's import
    #: and a CUDA context take seconds (15 s here for torch's import alone on a busy CPU).
    grace_s: float = 60.0
    sample_interval_s: float = 0.2
    min_clock_fraction: float = MIN_CLOCK_FRACTION


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadTarget:
    """One GPU to load: its NVML handle, and the clock it should reach."""

    index: int
    uuid: str
    handle: Any
    sm_clock_max_mhz: int | None
    #: The upper SM clock this agent locked on purpose (``lock_clocks``), if any.
    locked_max_mhz: int | None = None


@dataclass(slots=True)
class _Sample:
    sm_clock_mhz: int
    reasons: int
    utilization_pct: int


@dataclass(slots=True)
class _Run:
    target: LoadTarget
    proc: subprocess.Popen[bytes] | None = None
    out: IO[bytes] | None = None
    err: IO[bytes] | None = None
    timed_out: bool = False
    cancelled: bool = False
    start_error: str = ""
    samples: list[_Sample] = field(default_factory=list)
    nvml_errors: list[str] = field(default_factory=list)
    #: A reading the GPU answered NOT_SUPPORTED for ("SM clock", "utilization"): no sample.
    unsupported: str = ""
    #: The clock-event reasons answered NOT_SUPPORTED: samples carry none (0).
    reasons_unsupported: bool = False

    @property
    def returncode(self) -> int | None:
        """The load's exit status once it was reaped (every load is, before judging)."""
        return self.proc.returncode if self.proc is not None else None


def skipped(targets: Sequence[int], reason: str) -> list[Check]:
    """A ``clocks_load`` skip for each GPU index, with the reason."""
    return [Check("clocks_load", f"gpu{i}", "skip", reason) for i in targets]


def _argv(template: Sequence[str], target: LoadTarget, seconds: float) -> list[str]:
    values = {
        "gpu": target.uuid if target.uuid.startswith(("GPU-", "MIG-")) else str(target.index),
        "uuid": target.uuid,
        "index": str(target.index),
        "seconds": f"{seconds:g}",
    }
    return [part.format(**values) for part in template]


def _tail(stream: IO[bytes] | None) -> str:
    if stream is None:
        return ""
    stream.seek(0)
    lines = [ln.strip() for ln in stream.read()[-4096:].decode(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[-1][:300] if lines else ""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: children go too
    except OSError:
        proc.kill()
    proc.wait()


class _Sampler(threading.Thread):
    """Reads clocks, reasons and utilization of each running load's GPU until stopped."""

    def __init__(self, api: Any, runs: Sequence[_Run], interval_s: float) -> None:
        super().__init__(name="clocks-load-sampler", daemon=True)
        self._api = api
        self._runs = runs
        self._interval_s = interval_s
        self.stop = threading.Event()
        self._reasons = ClockEventReasons(api)

    def run(self) -> None:
        while not self.stop.is_set():
            for run in self._runs:
                if run.proc is None or run.proc.poll() is not None:
                    continue
                sample = self._read(run, run.target.handle)
                # Still running when read: a sample under load.
                if sample is not None and run.proc.poll() is None:
                    run.samples.append(sample)
            self.stop.wait(self._interval_s)

    def _read(self, run: _Run, h: Any) -> _Sample | None:
        """One sample, or None. A board that answers NOT_SUPPORTED for its clock-event
        reasons is sampled without them (0); for its SM clock or utilization it gets no
        sample and the check is skipped (``run.unsupported``), never failed as if NVML
        had not answered: a failed preflight cordons the node."""
        api = self._api
        reads: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("SM clock", lambda: api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            ("utilization", lambda: api.nvmlDeviceGetUtilizationRates(h).gpu),
            ("reasons", lambda: self._reasons.read(h)),
        )
        values: list[int] = []
        for what, read in reads:
            try:
                values.append(int(read()))
            except pynvml.NVMLError as exc:
                if exc.value not in _UNSUPPORTED:
                    run.nvml_errors.append(str(exc))
                    return None
                if what != "reasons":
                    run.unsupported = run.unsupported or what
                    return None
                run.reasons_unsupported = True
                values.append(0)
        sm_clock, utilization, reasons = values
        return _Sample(sm_clock_mhz=sm_clock, reasons=reasons, utilization_pct=utilization)


def run_clocks_load(
    api: Any,
    targets: Sequence[LoadTarget],
    settings: LoadSettings,
    *,
    cancel: threading.Event | None = None,
    env: dict[str, str] | None = None,
) -> list[Check]:
    """Load every target GPU at once for ``settings.seconds`` and judge each; blocks for
    about that long (call it off the reporter thread). ``cancel`` ends it early: the loads
    are killed and their checks are skipped (a load that did not finish proves nothing)."""
    if not targets:
        return []
    runs = [_Run(t) for t in targets]
    sampler = _Sampler(api, runs, settings.sample_interval_s)
    deadline = time.monotonic() + settings.seconds + settings.grace_s
    with tempfile.TemporaryDirectory(prefix="trainguard-load-") as tmp:
        for run in runs:
            argv = _argv(settings.command, run.target, settings.seconds)
            run.out = open(Path(tmp) / f"gpu{run.target.index}.out", "w+b")  # noqa: SIM115
            run.err = open(Path(tmp) / f"gpu{run.target.index}.err", "w+b")  # noqa: SIM115
            try:
                run.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=run.out,
                    stderr=run.err,
                    start_new_session=True,
                    env=env,
                )
            except OSError as exc:
                run.start_error = f"{argv[0]}: {exc.strerror or exc}"
        sampler.start()
        try:
            pending = [r for r in runs if r.proc is not None]
            while pending:
                if cancel is not None and cancel.is_set():
                    for run in pending:
                        assert run.proc is not None
                        _kill(run.proc)
                        run.cancelled = True
                    break
                for run in list(pending):
                    assert run.proc is not None
                    if run.proc.poll() is not None:
                        pending.remove(run)
                    elif time.monotonic() >= deadline:
                        run.timed_out = True
                        _kill(run.proc)
                        pending.remove(run)
                if pending:
                    time.sleep(0.05)
        finally:
            for run in runs:
                if run.proc is not None and run.proc.poll() is None:
                    _kill(run.proc)
            sampler.stop.set()
            sampler.join(SAMPLER_JOIN_S)
            checks = [_judge(run, settings, sampler_hung=sampler.is_alive()) for run in runs]
            for run in runs:
                for stream in (run.out, run.err):
                    if stream is not None:
                        stream.close()
    return checks


def _judge(run: _Run, settings: LoadSettings, *, sampler_hung: bool) -> Check:
    return Check("clocks_load", f"gpu{run.target.index}", *_status(run, settings, sampler_hung))


def _status(run: _Run, settings: LoadSettings, sampler_hung: bool) -> tuple[Status, str]:
    if run.start_error:
        return "fail", f"load command did not run: {run.start_error}"
    if run.cancelled:  # no verdict either way: the load did not finish
        return "skip", "cancelled: the agent stopped during the load"
    why = _tail(run.err) or _tail(run.out)
    if run.timed_out:
        limit = settings.seconds + settings.grace_s
        return "fail", f"load command ran past {limit:g} s and was killed"
    if run.returncode == EXIT_NO_TORCH:
        return "skip", f"no load generated: torch is not importable ({why})"
    if run.returncode == EXIT_NO_CUDA:
        return "skip", f"no load generated: no usable CUDA device ({why})"
    if run.returncode != 0:
        return "fail", f"load command exited with status {run.returncode}: {why}"
    if run.unsupported and not run.samples:
        return (
            "skip",
            f"NVML does not report this GPU's {run.unsupported} (Not Supported, e.g. a "
            "MIG-enabled or virtual GPU): no clock under load can be judged",
        )
    loaded = [s for s in run.samples if s.utilization_pct >= LOADED_UTILIZATION_PCT]
    if not loaded:
        if sampler_hung or (run.nvml_errors and not run.samples):
            last = run.nvml_errors[-1] if run.nvml_errors else "a call hung"
            return "fail", f"NVML did not answer during the load ({last})"
        busiest = max((s.utilization_pct for s in run.samples), default=0)
        return (
            "fail",
            f"the load ran but NVML never saw the GPU busy ({len(run.samples)} samples, "
            f"at most {busiest}% utilization)",
        )
    return _verdict(run.target, loaded, settings, reasons_known=not run.reasons_unsupported)


def _verdict(
    target: LoadTarget,
    loaded: Sequence[_Sample],
    settings: LoadSettings,
    *,
    reasons_known: bool = True,
) -> tuple[Status, str]:
    clock = int(statistics.median(s.sm_clock_mhz for s in loaded))
    reasons = 0
    flagged = 0
    for s in loaded:
        reasons |= s.reasons
        flagged += bool(s.reasons & SLOWDOWN_REASONS)
    if target.locked_max_mhz is not None:
        reference = target.locked_max_mhz
        of = f"the {reference} MHz lock this agent set"
    else:
        reference, of = target.sm_clock_max_mhz or 0, f"max {target.sm_clock_max_mhz} MHz"
    shown = ", ".join(r.value for r in decode_throttle_reasons(reasons)) or "none"
    if not reasons_known:
        shown = "not reported by this GPU (Not Supported)"
    what = f"SM clock {clock} MHz under load ({len(loaded)} samples)"
    if flagged:
        slow = ", ".join(r.value for r in decode_throttle_reasons(reasons & SLOWDOWN_REASONS))
        return "fail", f"{slow} in {flagged}/{len(loaded)} samples; {what}"
    if not reference:
        return "fail", f"{what}; the max SM clock is not reported"
    fraction = clock / reference
    if fraction < settings.min_clock_fraction:
        return (
            "fail",
            f"{what} is {fraction:.0%} of {of} (needs {settings.min_clock_fraction:.0%}); "
            f"clock-event reasons: {shown}",
        )
    return "pass", f"{what}, {fraction:.0%} of {of}; clock-event reasons: {shown}"


def load_command(api: Any, configured: Sequence[str] = ()) -> tuple[list[str] | None, str]:
    """The command that loads this node's GPUs: the configured one, the simulator's stand-in
    on a simulated backend, else ``collectives/gpu_load.py``; or None and why not (the check
    is then skipped with that reason, never passed)."""
    if configured:
        return list(configured), ""
    from agents.gpu.sim import SimNvml  # the simulator only where it is in use

    if isinstance(api, SimNvml):
        return api.sim_load_command(), ""
    found = default_load_command()
    if found is None:
        return None, "no load generated: torch is not importable by the agent's python"
    return found, ""


#: Runs ``work(cancel)``, then ``done`` with its results: on the caller's thread
#: (:func:`run_inline`, the CLI) or on a thread of its own (:meth:`ClocksLoadRunner.start`).
LoadStarter = Callable[
    [Callable[[threading.Event], list[Check]], Callable[[list[Check]], None]], object
]


def run_inline(
    work: Callable[[threading.Event], list[Check]], done: Callable[[list[Check]], None]
) -> None:
    """A :data:`LoadStarter` that blocks for the load (nothing can cancel it)."""
    done(work(threading.Event()))


def run_preflight(
    backend: GpuBackend,
    sampler: GpuSampler,
    nics: NicMonitor,
    gpus: Sequence[GpuSample],
    *,
    load: LoadSettings | None,
    why_not: str = "",
    done: Callable[[list[Check]], None],
    start: LoadStarter = run_inline,
    expected_nic_rate_gbps: float | None = None,
    locked_max_mhz: Callable[[int], int | None] = lambda _i: None,
) -> None:
    """Every check of the preflight, for the agent and the CLI alike: the idle checks over
    ``gpus`` (a sample of ``sampler``) and a fresh read of the NICs, then ``clocks_load``
    with ``load`` on every GPU that answered, through ``start``; with no ``load`` each of
    them is skipped, saying ``why_not``. ``done`` gets the final checks, once."""
    checks = evaluate(
        backend,
        gpus,
        nics.read_all(),
        nvlinks_down_at_start=sampler.nvlinks_down_at_start,
        expected_nic_rate_gbps=expected_nic_rate_gbps,
    )
    targets = load_targets(gpus, sampler.inventory, sampler.handles, locked_max_mhz)
    if load is None or not targets:
        done(merge(checks, skipped([t.index for t in targets], why_not)))
        return
    api = backend.api
    start(
        lambda cancel: run_clocks_load(api, targets, load, cancel=cancel),
        lambda results: done(merge(checks, results)),
    )


def run_preflight_with_load(
    backend: GpuBackend,
    sampler: GpuSampler,
    nics: NicMonitor,
    *,
    load_s: float,
    expected_nic_rate_gbps: float | None = None,
    command: Sequence[str] = (),
) -> list[Check]:
    """``trainguard preflight --local``: :func:`run_preflight` over a fresh sample,
    ``clocks_load`` included (``load_s`` seconds of load on all GPUs at once; 0 skips it and
    says so). Blocks for the load; the CLI has no heartbeat to keep."""
    load: LoadSettings | None = None
    why_not = "no load generated: --load-s 0"
    if load_s > 0:
        argv, why_not = load_command(backend.api, command)
        if argv is not None:
            load = LoadSettings(command=tuple(argv), seconds=load_s)
    out: list[Check] = []
    run_preflight(
        backend,
        sampler,
        nics,
        sampler.sample(),
        load=load,
        why_not=why_not,
        done=out.extend,
        expected_nic_rate_gbps=expected_nic_rate_gbps,
    )
    return out


def load_targets(
    gpus: Sequence[GpuSample],
    inventory: Sequence[GpuInfo],
    handles: Sequence[Any],
    locked_max_mhz: Callable[[int], int | None] = lambda _i: None,
) -> list[LoadTarget]:
    """The GPUs to load: those whose latest sample answered (a lost or hung GPU already
    failed ``nvml_sanity`` and gets no load), with their handle and max SM clock."""
    info = {g.index: g for g in inventory}
    out = []
    for sample in gpus:
        i = sample.index
        unread = sample.lost or sample.unknown or sample.unreachable
        if unread or i >= len(handles) or handles[i] is None:
            continue
        known = info.get(i)
        out.append(
            LoadTarget(
                index=i,
                uuid=sample.uuid or (known.uuid if known else ""),
                handle=handles[i],
                sm_clock_max_mhz=known.sm_clock_max_mhz if known else None,
                locked_max_mhz=locked_max_mhz(i),
            )
        )
    return out


def merge(checks: Sequence[Check], results: Sequence[Check]) -> list[Check]:
    """``checks`` with each GPU's ``clocks_load`` placeholder replaced by its result; a
    result for no placeholder (the node-wide failure of a crashed check) is added at the end,
    so that it fails the preflight instead of vanishing."""
    by_target = {c.target: c for c in results}
    placed = {c.target for c in checks if c.name == "clocks_load"}
    merged = [by_target.get(c.target, c) if c.name == "clocks_load" else c for c in checks]
    return merged + [c for c in results if c.target not in placed]


class ClocksLoadRunner:
    """The daemon's side: one load at a time, on a thread of its own, cancelled at stop."""

    def __init__(self) -> None:
        self._one_at_a_time = threading.Lock()
        self.cancel = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(
        self,
        work: Callable[[threading.Event], list[Check]],
        done: Callable[[list[Check]], None],
    ) -> threading.Thread:
        """Run ``work(cancel)`` then ``done(results)`` on a ``preflight-load`` thread; a second
        preflight waits for the first one's load (two at once would share the GPUs)."""

        def body() -> None:
            with self._one_at_a_time:
                try:
                    results = work(self.cancel)
                except Exception as exc:  # the ack must come, whatever broke
                    log.exception("clocks_load check crashed")
                    results = [
                        Check("clocks_load", "node", "fail", f"agent error: {type(exc).__name__}")
                    ]
            done(results)

        thread = threading.Thread(target=body, name="preflight-load", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill running loads and wait (bounded) for their threads to ack."""
        self.cancel.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


__all__ = [
    "EXIT_NO_CUDA",
    "EXIT_NO_TORCH",
    "LOADED_UTILIZATION_PCT",
    "MIN_CLOCK_FRACTION",
    "SLOWDOWN_REASONS",
    "ClocksLoadRunner",
    "LoadSettings",
    "LoadStarter",
    "LoadTarget",
    "default_load_command",
    "load_command",
    "load_targets",
    "merge",
    "run_clocks_load",
    "run_inline",
    "run_preflight",
    "run_preflight_with_load",
    "skipped",
]
