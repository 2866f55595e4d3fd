"""Carrying out the controller's commands on this node, and acknowledging each one.

GPU commands go through the same NVML-like API the sampler reads (W are converted to NVML's
mW; requests outside the board's limits are refused before the driver is asked, with the
allowed range in the reason). Job commands cannot be executed here: they are queued for
the job's ranks connected to the local socket and acknowledged ``relayed``, or ``failed``
when no rank of that job is on this node. Each command id is acted on once; a repeated id
(the controller resends when an ack has not reached it yet) gets the first ack again.

A preflight may take a while (its ``clocks_load`` check loads the GPUs for seconds), and
commands run on the reporter thread, whose heartbeat must not stop: the preflight callable
is handed a ``finish`` function and acks when it calls it, at once or later from its own
thread. Until then a resent id is neither acked nor started again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from trainguard.wire import (
    Command,
    CommandAck,
    CommandStatus,
    JobCommand,
    LockClocks,
    ResetPowerLimit,
    RunPreflight,
    SetPowerLimit,
    UnlockClocks,
)

log = logging.getLogger(__name__)

#: Command ids remembered for idempotency (a few hours of power-policy traffic).
REMEMBERED_COMMANDS = 4096
#: How long :meth:`CommandExecutor.execute` waits for a preflight's ack by default: the
#: longest preflight the agent's settings allow (``preflight_load_s`` at most 300 s plus
#: ``preflight_load_grace_s`` at most 600 s). An ack not there by then is not coming (a
#: preflight that never calls ``finish``), and the caller must not hang on it.
EXECUTE_TIMEOUT_S = 900.0

JobRelay = Callable[[JobCommand], int]
#: Starts the node's preflight; it calls ``finish(all passed, one-line summary)`` once, inline
#: or later from another thread (that call acks the command).
Finish = Callable[[bool, str], None]
Preflight = Callable[[RunPreflight, Finish], None]


class CommandRefused(Exception):
    """Internal: the command cannot be carried out; the message is the ack's reason."""


class CommandTimeout(TimeoutError):
    """:meth:`CommandExecutor.execute` gave up waiting for a command's ack. The command may
    still finish and ack itself (through ``on_ack``); this caller just stops waiting."""


def _nvml_reason(exc: pynvml.NVMLError, what: str) -> str:
    if exc.value == pynvml.NVML_ERROR_NO_PERMISSION:
        return f"no permission: {what} needs root (or CAP_SYS_ADMIN) on the node"
    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
        return f"{what} failed: the GPU is lost"
    if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
        return f"{what} is not supported by this GPU or driver"
    return f"{what} failed: NVML error {exc.value} ({exc})"


class CommandExecutor:
    """Thread-safe; called by the reporter thread with each reply's commands."""

    def __init__(
        self,
        api: Any,
        handles: Sequence[Any],
        *,
        relay: JobRelay,
        on_ack: Callable[[CommandAck], None],
        clock: Callable[[], float] = time.time,
        preflight: Preflight | None = None,
    ) -> None:
        self._api = api
        self._preflight = preflight
        self._handles = list(handles)
        self._relay = relay
        self._on_ack = on_ack
        self._clock = clock
        self._lock = threading.Lock()
        #: Notified (under ``_lock``) each time an ack is kept: :meth:`execute` waits on it.
        self._acked = threading.Condition(self._lock)
        self._done: OrderedDict[str, CommandAck] = OrderedDict()
        #: Command id -> callers of :meth:`execute` waiting for its ack, and the acks kept for
        #: them apart from ``_done``: an ack evicted from the remembered ones (more than
        #: ``REMEMBERED_COMMANDS`` others kept before a woken waiter got the lock back)
        #: still reaches its waiter.
        self._waiters: dict[str, int] = {}
        self._for_waiters: dict[str, CommandAck] = {}
        #: Preflights started and not finished yet (their ack comes from ``finish``).
        self._running: set[str] = set()
        self._locked_max_mhz: dict[int, int] = {}

    def locked_clock_mhz(self, gpu_index: int) -> int | None:
        """Upper SM clock the agent locked on this GPU, if any (for ``GpuSample``)."""
        return self._locked_max_mhz.get(gpu_index)

    def refuse(self, command_id: str, reason: str) -> CommandAck:
        """Ack a command the agent could not even parse (e.g. a kind newer than this agent)."""
        with self._lock:
            ack = self._done.get(command_id) or CommandAck(
                command_id=command_id,
                status=CommandStatus.FAILED,
                reason=reason[:1024],
                finished_unix_s=self._clock(),
            )
            self._done[command_id] = ack
        self._on_ack(ack)
        return ack

    def handle(self, commands: Sequence[Command]) -> list[CommandAck]:
        """Carry out a reply's commands; returns (and acks) those finished now. Never waits
        for a preflight: it acks itself when done."""
        acks = [ack for ack in map(self.submit, commands) if ack is not None]
        for ack in acks:
            self._on_ack(ack)
        return acks

    def execute(self, cmd: Command, *, timeout_s: float = EXECUTE_TIMEOUT_S) -> CommandAck:
        """Carry out one command and return its ack, waiting up to ``timeout_s`` for a
        preflight to finish (for callers that may block; the reporter thread uses
        :meth:`handle`). Raises :class:`CommandTimeout` when no ack came in time: a caller
        must not hang on a preflight that never finishes."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._lock:  # a waiter before submit: no ack of this id can slip past it
            self._waiters[cmd.id] = self._waiters.get(cmd.id, 0) + 1
        try:
            ack = self.submit(cmd)
            if ack is not None:
                return ack
            with self._acked:
                done = self._acked.wait_for(
                    lambda: self._for_waiters.get(cmd.id) or self._done.get(cmd.id), timeout_s
                )
            if done is None:
                raise CommandTimeout(
                    f"command {cmd.id} ({cmd.kind}) not finished within {timeout_s:g} s; "
                    "it acks itself if it finishes later"
                )
            return done
        finally:
            with self._lock:
                left = self._waiters[cmd.id] - 1
                if left:
                    self._waiters[cmd.id] = left
                else:
                    del self._waiters[cmd.id]
                    self._for_waiters.pop(cmd.id, None)

    def submit(self, cmd: Command) -> CommandAck | None:
        """The command's ack, or None for a preflight still running (it acks itself)."""
        with self._lock:
            previous = self._done.get(cmd.id)
            if previous is not None:
                log.info("command %s already handled (%s); acking again", cmd.id, previous.status)
                return previous
            if cmd.id in self._running:
                log.info("preflight %s still running; it acks when done", cmd.id)
                return None
            deferred = isinstance(cmd, RunPreflight) and self._preflight is not None
            if deferred:
                self._running.add(cmd.id)
        if deferred:
            assert isinstance(cmd, RunPreflight) and self._preflight is not None
            self._start_preflight(cmd, self._preflight)
            return None
        with self._lock:
            try:
                status, reason = self._dispatch(cmd)
            except CommandRefused as exc:
                status, reason = CommandStatus.FAILED, str(exc)
            except Exception as exc:  # a bug must cost one command, not the reporter thread
                log.exception("command %s (%s) crashed", cmd.id, cmd.kind)
                status, reason = CommandStatus.FAILED, f"agent error: {type(exc).__name__}: {exc}"
            ack = self._remember(cmd.id, status, reason)
        level = logging.INFO if status != CommandStatus.FAILED else logging.WARNING
        log.log(level, "command %s %s: %s: %s", cmd.id, cmd.kind, status.value, reason)
        return ack

    def _remember(self, command_id: str, status: CommandStatus, reason: str) -> CommandAck:
        """Build and keep the ack (caller holds the lock)."""
        ack = CommandAck(
            command_id=command_id,
            status=status,
            reason=reason[:1024],
            finished_unix_s=self._clock(),
        )
        self._done[command_id] = ack
        if command_id in self._waiters:
            self._for_waiters[command_id] = ack
        while len(self._done) > REMEMBERED_COMMANDS:
            self._done.popitem(last=False)
        self._acked.notify_all()
        return ack

    def _start_preflight(self, cmd: RunPreflight, preflight: Preflight) -> None:
        finished = threading.Event()

        def finish(passed: bool, reason: str) -> None:
            if finished.is_set():
                log.error("preflight %s finished twice; the second verdict is ignored", cmd.id)
                return
            finished.set()
            status = CommandStatus.SUCCEEDED if passed else CommandStatus.FAILED
            with self._lock:
                self._running.discard(cmd.id)
                ack = self._remember(cmd.id, status, reason)
            level = logging.INFO if passed else logging.WARNING
            log.log(level, "command %s run_preflight: %s: %s", cmd.id, status.value, reason)
            self._on_ack(ack)

        try:
            preflight(cmd, finish)
        except Exception as exc:  # a bug must cost one command, not the reporter thread
            log.exception("command %s (%s) crashed", cmd.id, cmd.kind)
            finish(False, f"agent error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, cmd: Command) -> tuple[CommandStatus, str]:
        if isinstance(cmd, JobCommand):
            clients = self._relay(cmd)
            if clients <= 0:
                return CommandStatus.FAILED, f"no rank of job {cmd.job} on this node"
            return CommandStatus.RELAYED, f"queued for {clients} local client(s) of job {cmd.job}"
        if isinstance(cmd, RunPreflight):  # with a preflight callable, execute() started it
            raise CommandRefused("this agent cannot run a preflight")
        if isinstance(cmd, SetPowerLimit):
            return CommandStatus.SUCCEEDED, self._set_power(cmd.gpu_index, cmd.limit_w)
        if isinstance(cmd, ResetPowerLimit):
            return CommandStatus.SUCCEEDED, self._set_power(cmd.gpu_index, None)
        if isinstance(cmd, LockClocks):
            return CommandStatus.SUCCEEDED, self._lock_clocks(cmd)
        if isinstance(cmd, UnlockClocks):
            return CommandStatus.SUCCEEDED, self._unlock_clocks(cmd.gpu_index)
        raise CommandRefused(f"unknown command kind {cmd.kind!r}")

    def adopt_api(self, api: Any, handles: Sequence[Any]) -> None:
        """NVML came back after failing at start: commands go to the working API now."""
        with self._lock:
            self._api = api
            self._handles = list(handles)

    def update_handles(self, handles: Sequence[Any]) -> None:
        """A GPU that was unavailable at start answered: its handle can take commands now."""
        with self._lock:
            self._handles = list(handles)

    def _handle(self, gpu_index: int) -> Any:
        if not 0 <= gpu_index < len(self._handles):
            raise CommandRefused(
                f"gpu_index {gpu_index} out of range (this node has {len(self._handles)} GPUs)"
            )
        handle = self._handles[gpu_index]
        if handle is None:
            raise CommandRefused(f"GPU {gpu_index} has not answered NVML since the agent started")
        return handle

    def _nvml(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise CommandRefused(_nvml_reason(exc, what)) from None

    def _set_power(self, gpu_index: int, limit_w: float | None) -> str:
        h = self._handle(gpu_index)
        api = self._api
        lo_mw, hi_mw = self._nvml(
            "reading the power limit range", api.nvmlDeviceGetPowerManagementLimitConstraints, h
        )
        if limit_w is None:
            target_mw = int(
                self._nvml(
                    "reading the default power limit",
                    api.nvmlDeviceGetPowerManagementDefaultLimit,
                    h,
                )
            )
        else:
            target_mw = round(limit_w * 1000)
            if not lo_mw <= target_mw <= hi_mw:
                raise CommandRefused(
                    f"power limit {limit_w:g} W for GPU {gpu_index} is outside the allowed range "
                    f"{lo_mw / 1000:g}-{hi_mw / 1000:g} W"
                )
        before = self._nvml("reading the power limit", api.nvmlDeviceGetEnforcedPowerLimit, h)
        self._nvml("setting the power limit", api.nvmlDeviceSetPowerManagementLimit, h, target_mw)
        verb = "reset to the default" if limit_w is None else "set to"
        return (
            f"GPU {gpu_index} power limit {verb} {target_mw / 1000:g} W (was {before / 1000:g} W)"
        )

    def _lock_clocks(self, cmd: LockClocks) -> str:
        h = self._handle(cmd.gpu_index)
        if cmd.min_mhz > cmd.max_mhz:
            raise CommandRefused(f"min_mhz {cmd.min_mhz} is above max_mhz {cmd.max_mhz}")
        top = int(
            self._nvml(
                "reading the max SM clock",
                self._api.nvmlDeviceGetMaxClockInfo,
                h,
                pynvml.NVML_CLOCK_SM,
            )
        )
        if cmd.min_mhz <= 0 or cmd.max_mhz > top:
            raise CommandRefused(
                f"clock range {cmd.min_mhz}-{cmd.max_mhz} MHz for GPU {cmd.gpu_index} is outside "
                f"the allowed range 1-{top} MHz"
            )
        self._nvml(
            "locking GPU clocks",
            self._api.nvmlDeviceSetGpuLockedClocks,
            h,
            cmd.min_mhz,
            cmd.max_mhz,
        )
        self._locked_max_mhz[cmd.gpu_index] = cmd.max_mhz
        return f"GPU {cmd.gpu_index} SM clock locked to {cmd.min_mhz}-{cmd.max_mhz} MHz"

    def _unlock_clocks(self, gpu_index: int) -> str:
        h = self._handle(gpu_index)
        self._nvml("unlocking GPU clocks", self._api.nvmlDeviceResetGpuLockedClocks, h)
        self._locked_max_mhz.pop(gpu_index, None)
        return f"GPU {gpu_index} SM clock unlocked"


__all__ = ["CommandExecutor", "CommandTimeout", "Finish", "JobRelay", "Preflight"]
