"""Per-call and per-step bookkeeping of one rank: the state every other part reads.

The training thread calls :meth:`Recorder.enter`/:meth:`complete` around each collective and
:meth:`step_start`/:meth:`step_end` around each step; the watchdog thread reads in-flight
calls through :meth:`stuck`. Durations come from the rank's monotonic clock
(``time.perf_counter``), or from CUDA events for calls on CUDA tensors: those are recorded
around the launch and read later with ``Event.query()``, which never synchronizes, so a
call on the GPU stays "in flight" until its end event has completed on the stream.

Wait vs. compute: a step's collective wait is the time the training thread was blocked
inside a collective call or a ``Work.wait()`` (on GPU: the collectives' event durations);
compute is the rest of the step. A late arriver therefore shows high compute and low wait;
the ranks waiting for it show the opposite.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainguard.wire import MAX_STEP, InflightCollective, StepSummary

from .config import InstrumentConfig
from .finite import StepFlags
from .outbox import Outbox

if TYPE_CHECKING:
    from .roles import RoleTracker
    from .timing import EventClock, Mark

now = time.perf_counter

#: ``op`` of the in-flight record a rank sends when its training thread is stuck outside any
#: collective inside a step (a non-communication hang seen from the culprit's side).
COMPUTE_OP = "compute"


@dataclass(slots=True, eq=False)
class CallRecord:
    """One collective or point-to-point call on this rank (kept in a local ring buffer)."""

    op: str
    group: str
    seq: int
    size_bytes: int
    dtype: str
    enter_s: float
    step: int | None
    async_op: bool = False
    exit_s: float | None = None
    blocked_s: float = 0.0
    ok: bool = True
    events: tuple[Mark, Mark | None] | None = None
    """Device marks (start, end) of a call timed on its stream (``collectives.timing``);
    end is None until it is known (an async call under blocking wait: at ``wait()``)."""
    enqueue_s: float = 0.0
    """Host time spent launching an event-timed call (its device duration is apart)."""
    reported_s: float = field(default=0.0, repr=False)

    @property
    def duration_s(self) -> float | None:
        return None if self.exit_s is None else self.exit_s - self.enter_s


#: The largest step number a summary carries (``trainguard.wire.Step``): a larger one
#: would fail to build at the step's end, inside the training loop's ``with`` block.
STEP_MAX = MAX_STEP


@dataclass(slots=True)
class StepNumbering:
    """The step numbers this process sends: the loop's own while they go forward, and the
    sequence carried on where they go back.

    Why: the controller reads one process's step numbers as its clock. A number at or below
    one already sent reads as the job restarted from a checkpoint (every incident resolved
    and opened again, every window emptied); with summaries that lack ``end_unix_s``, as
    already compared (every later step dropped). Yet a loop's numbers go back for reasons
    that are no restart: an epoch loop's ``enumerate(loader)`` starts again at 0, a step is
    retried under its number. A restart is a new process (its ``started`` event, a new
    numbering); inside one process the steps only go on. So a number that goes back is
    sent as the last one sent + 1, and the numbers after it keep their spacing from it (an
    offset). Every rank maps the same sequence of numbers the same way, so ranks stay
    aligned, and while the loop's numbers increase (the offset is 0) the numbers sent are
    the loop's own: checkpoint steps, resume bounds and a rollback's "first bad step" stay
    in one numbering.

    A step that raised sent nothing: its number is given back (:meth:`drop`), so a step
    retried under the same number keeps it. A loop that went back on purpose (it reloaded a
    checkpoint in this process) says so with ``rewind``: the numbers are sent as given from
    there, as a restarted process would send them, so the controller sees those steps run
    again and its rollback evidence stays in the checkpoints' numbering.
    """

    #: What is added to the loop's numbers (0 until they first go back).
    offset: int = 0
    #: The loop's number of the last step that ended (None: none yet, or just rewound).
    last_given: int | None = None
    #: (given, offset) of the step in progress, made final by :meth:`close`.
    _open: tuple[int, int] | None = None

    def open(self, given: int, *, rewind: bool = False) -> tuple[int | None, bool]:
        """The number to send for the step the loop numbered ``given`` (None: past what a
        summary carries) and whether ``given`` went back (at or below the last step's)."""
        offset, last = (0, None) if rewind else (self.offset, self.last_given)
        went_back = last is not None and given <= last
        if last is not None and went_back:
            offset = last + offset + 1 - given
        sent = given + offset
        if sent > STEP_MAX:
            return None, went_back
        self._open = (given, offset)
        return sent, went_back

    @property
    def given(self) -> int | None:
        """The loop's own number of the step in progress."""
        return None if self._open is None else self._open[0]

    def close(self) -> None:
        """The step in progress ended: the next numbers follow it."""
        if self._open is not None:
            self.last_given, self.offset = self._open
            self._open = None

    def drop(self) -> None:
        """The step in progress raised: it sent nothing, its number is free again."""
        self._open = None

    def sent(self, given: int) -> int:
        """``given`` (a number of the loop, e.g. the one ``should_checkpoint(i)`` is asked
        about) in the numbering sent, where the controller's ``at_step`` is."""
        offset = self.offset if self._open is None else self._open[1]
        return min(given + offset, STEP_MAX)


@dataclass(slots=True)
class _Step:
    step: int
    start_s: float
    wait_s: float = 0.0
    bytes: int = 0
    calls: int = 0
    event_calls: list[CallRecord] = field(default_factory=list)
    enqueue_s: float = 0.0
    flags: StepFlags | None = None
    nonfinite: int = 0
    nonfinite_first: CallRecord | None = None


@dataclass(slots=True)
class _PendingGpuStep:
    summary: dict[str, Any]
    calls: list[CallRecord]
    flags: StepFlags | None = None
    flag_copy: tuple[Any, Mark] | None = None


class Recorder:
    def __init__(
        self,
        cfg: InstrumentConfig,
        *,
        rank: int,
        world_size: int,
        outbox: Outbox,
        local_rank: int | None = None,
        gpu_index: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.gpu_index = gpu_index
        self.outbox = outbox
        self.history: deque[CallRecord] = deque(maxlen=cfg.history_calls)
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {}
        self._last_done: dict[str, int] = {}
        self._inflight: dict[int, CallRecord] = {}
        #: The event-timed part of ``_inflight``: all the poller has to look at.
        self._evented: dict[int, CallRecord] = {}
        #: Group id -> its global ranks (sorted), sent with in-flight reports.
        self.group_ranks: dict[str, list[int]] = {}
        #: Group id -> torch's group name (how Flight Recorder dumps name it).
        self.group_names: dict[str, str] = {}
        self._durations: dict[str, deque[float]] = {}
        self._segments: deque[float] = deque(maxlen=cfg.duration_window)
        self._step: _Step | None = None
        self._seg_start = now()
        self._busy = 0
        self._gpu_steps: deque[_PendingGpuStep] = deque()
        self._stall_reported_s = 0.0
        self.last_step: int | None = None
        #: Role fields of every summary (``roles.RoleTracker.fields``); set by the session.
        self.roles: RoleTracker | None = None
        #: Clock of event-timed calls and NaN/Inf flag copies (``collectives.timing``).
        self.clock: EventClock | None = None

    # ------------------------------------------------------------------ calls (hot path)

    @property
    def step(self) -> int | None:
        s = self._step
        return None if s is None else s.step

    def compute_segment_s(self) -> float:
        return now() - self._seg_start

    def enter(
        self, op: str, group: str, size_bytes: int, dtype: str, async_op: bool, t: float
    ) -> CallRecord:
        # No lock: only the training thread writes the counters, and single dict operations
        # are atomic for the watchdog thread that reads them.
        step = self._step
        self._segments.append(t - self._seg_start)
        self._busy += 1
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        rec = CallRecord(
            op, group, seq, size_bytes, dtype, t, None if step is None else step.step, async_op
        )
        self._inflight[id(rec)] = rec
        if step is not None:
            step.bytes += size_bytes
            step.calls += 1
        return rec

    def grow(self, rec: CallRecord, size_bytes: int) -> None:
        """One more call joined ``rec`` (a coalescing block's calls are one collective)."""
        rec.size_bytes += size_bytes
        step = self._step
        if step is not None and rec.step == step.step:
            step.bytes += size_bytes

    def nonfinite_input(self, rec: CallRecord) -> None:
        """``rec``'s input from this rank held NaN/Inf before the call (a rare, cold path)."""
        step = self._step
        if step is not None:
            step.nonfinite += 1
            if step.nonfinite_first is None:
                step.nonfinite_first = rec

    def finish(self, rec: CallRecord, t_start: float, t_end: float) -> None:
        """A blocking CPU call returned: the fast path of :meth:`unblocked` + :meth:`complete`."""
        self._busy -= 1
        elapsed = t_end - t_start
        rec.blocked_s = elapsed
        rec.exit_s = t_end
        self._seg_start = t_end
        step = self._step
        if step is not None:
            step.wait_s += elapsed
        del self._inflight[id(rec)]
        group = rec.group
        if rec.seq > self._last_done.get(group, 0):
            self._last_done[group] = rec.seq
        window = self._durations.get(rec.op)
        if window is None:
            window = self._durations[rec.op] = deque(maxlen=self.cfg.duration_window)
        window.append(t_end - rec.enter_s)
        self.history.append(rec)

    def unblocked(self, t_start: float, t_end: float, rec: CallRecord) -> None:
        """The training thread was blocked in ``rec``'s call or wait from t_start to t_end."""
        self._busy -= 1
        rec.blocked_s += t_end - t_start
        self._seg_start = t_end
        step = self._step
        if step is not None and rec.events is None:
            step.wait_s += t_end - t_start

    def blocked(self) -> None:
        self._busy += 1

    def event_launched(self, rec: CallRecord, enqueue_s: float) -> None:
        """``rec`` was launched on a device; the poller closes it when its end mark fires."""
        rec.enqueue_s = enqueue_s
        self._evented[id(rec)] = rec
        step = self._step
        if step is not None:
            step.event_calls.append(rec)
            step.enqueue_s += enqueue_s

    def event_cancelled(self, rec: CallRecord) -> None:
        """``rec`` is no longer timed by marks (its future closes it on the CPU clock)."""
        rec.enqueue_s = 0.0
        step = self._step
        if step is not None and rec in step.event_calls:
            step.event_calls.remove(rec)

    def device_nonfinite(self, value: Any, rec: CallRecord) -> None:
        """Queue the on-device NaN/Inf check of ``rec``'s input (``collectives.finite``)."""
        step = self._step
        if step is None:
            return
        every = self.cfg.nonfinite_every_steps
        if every > 1 and step.step % every:
            return
        if step.flags is None:
            step.flags = StepFlags()
        step.flags.add(value, rec, self.cfg.nonfinite_check_min_bytes)

    def complete(self, rec: CallRecord, t: float, ok: bool = True) -> None:
        with self._lock:
            if rec.exit_s is not None:
                return
            rec.exit_s = t
            rec.ok = ok
            self._inflight.pop(id(rec), None)
            if ok:
                if rec.seq > self._last_done.get(rec.group, 0):
                    self._last_done[rec.group] = rec.seq
                window = self._durations.get(rec.op)
                if window is None:
                    window = self._durations[rec.op] = deque(maxlen=self.cfg.duration_window)
                window.append(t - rec.enter_s)
        self.history.append(rec)

    def abandon(self, rec: CallRecord) -> None:
        """Forget a call whose handle was dropped unwaited (its end is unknowable)."""
        with self._lock:
            self._inflight.pop(id(rec), None)
            if rec.exit_s is None:  # lets a GPU step waiting on it be summarized
                rec.exit_s = rec.enter_s + rec.blocked_s
                rec.ok = False

    def revive(self, rec: CallRecord) -> None:
        """In flight again: an abandoned call (its result thought dropped) is waited after
        all, so a wait that hangs is still reported as this call."""
        with self._lock:
            rec.exit_s = None
            rec.ok = True
            self._inflight[id(rec)] = rec

    def last_completed(self) -> dict[str, int]:
        done = _copy(self._last_done)
        return {g: done.get(g, 0) for g in _copy(self._seq)}

    # ------------------------------------------------------------------ steps

    def step_start(self, step: int) -> object:
        """Open step ``step``; returns the token that :meth:`step_end`/:meth:`step_abort`
        take to close this step and no other."""
        t = now()
        opened = self._step = _Step(step, t)
        self._seg_start = t
        self._stall_reported_s = 0.0
        return opened

    def is_open(self, token: object) -> bool:
        """Whether the step opened with ``token`` is the one in progress."""
        return token is not None and self._step is token

    def step_end(self, token: object | None = None) -> StepSummary | None:
        """Close the step in progress (only if it is ``token``'s, when one is given)."""
        step = self._step
        if step is None or (token is not None and step is not token):
            return None
        t = now()
        self._step = None
        self._seg_start = t
        self.last_step = step.step
        step_time = t - step.start_s
        fields: dict[str, Any] = {
            "job": self.cfg.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": step.step,
            "step_time_s": step_time,
            "collective_bytes": step.bytes,
            "collective_calls": step.calls,
            "local_rank": self.local_rank,
            "gpu_index": self.gpu_index,
            "end_unix_s": time.time(),
            "wait_cpu_s": step.wait_s,
        }
        roles = self.roles
        if roles is not None:
            fields.update(roles.fields)
        first = step.nonfinite_first
        if first is not None:
            fields["nonfinite_inputs"] = step.nonfinite
            fields["nonfinite_first_op"] = first.op
            fields["nonfinite_first_group"] = first.group
            fields["nonfinite_first_seq"] = first.seq
        flags = step.flags
        flag_copy = None
        if flags is not None and self.clock is not None:
            flag_copy = flags.read_back(self.clock)
        if step.event_calls or flag_copy is not None:
            if step.event_calls:
                fields["collective_enqueue_s"] = step.enqueue_s
            pending = _PendingGpuStep(fields, step.event_calls, flags, flag_copy)
            with self._lock:
                self._gpu_steps.append(pending)
            self.poll_events()
            return None
        return self._emit(fields, step.wait_s)

    def step_abort(self, token: object | None = None) -> None:
        if token is not None and self._step is not token:
            return
        self._step = None
        self._seg_start = now()

    def _emit(self, fields: dict[str, Any], wait_s: float) -> StepSummary:
        fields.pop("wait_cpu_s", None)
        step_time = fields["step_time_s"]
        wait = min(max(wait_s, 0.0), step_time)
        summary = StepSummary(**fields, collective_wait_s=wait, compute_time_s=step_time - wait)
        self.outbox.add_step(summary)
        return summary

    # ------------------------------------------------------------------ background thread

    def poll_events(self) -> None:
        """The poller: complete event-timed calls whose end mark has fired (``query()``,
        never a synchronize) and emit the steps whose calls and NaN/Inf flags are all in."""
        for key, rec in _copy(self._evented).items():
            if rec.exit_s is not None or rec.events is None:  # abandoned or cancelled
                self._evented.pop(key, None)
                continue
            start, end = rec.events
            if end is not None and end.query():
                rec.blocked_s = end.seconds_since(start)
                self.complete(rec, rec.enter_s + rec.blocked_s)
                self._evented.pop(key, None)
        while True:
            with self._lock:
                if not self._gpu_steps:
                    return
                head = self._gpu_steps[0]
                if any(r.exit_s is None for r in head.calls):
                    return
                if head.flag_copy is not None and not head.flag_copy[1].query():
                    return
                self._gpu_steps.popleft()
            if head.flags is not None and head.flag_copy is not None:
                _fill_nonfinite(head.summary, *head.flags.resolve(head.flag_copy[0]))
            cpu_wait = head.summary["wait_cpu_s"]
            self._emit(head.summary, cpu_wait + sum(r.blocked_s for r in head.calls))

    def drain(self, timeout_s: float, sleep: Any = time.sleep) -> bool:
        """Emit the ended steps still waiting on device marks, polling (never synchronizing)
        for up to ``timeout_s``; True when none is left.

        Why: a step whose calls were timed on the device is summarized by the background
        poller once its marks fire, which on a GPU is after the training thread ended the
        step. The job's last step is nearly always still pending when the job ends, and the
        poller stops with the session: without this the final step never went out."""
        deadline = now() + timeout_s
        while True:
            self.poll_events()
            with self._lock:
                if not self._gpu_steps:
                    return True
            if now() >= deadline:
                return False
            sleep(0.005)

    def stuck(self, t: float) -> list[InflightCollective]:
        """In-flight calls past their adaptive deadline, due for a (re-)report."""
        cfg = self.cfg
        calls = list(_copy(self._inflight).values())
        medians = {}
        for op, window in _copy(self._durations).items():
            values = _snapshot(window)
            if values:
                medians[op] = statistics.median(values)
        out: list[InflightCollective] = []
        last: dict[str, int] | None = None
        for rec in calls:
            elapsed = t - rec.enter_s
            limit = max(cfg.watchdog_multiplier * medians.get(rec.op, 0.0), cfg.watchdog_floor_s)
            if elapsed < limit or t - rec.reported_s < cfg.watchdog_repeat_s:
                continue
            rec.reported_s = t
            last = self.last_completed() if last is None else last
            out.append(
                InflightCollective(
                    job=cfg.job,
                    rank=self.rank,
                    group=rec.group,
                    op=rec.op,
                    seq=rec.seq,
                    elapsed_s=elapsed,
                    size_bytes=rec.size_bytes,
                    last_completed_seq=last,
                    step=rec.step,
                    group_ranks=self.group_ranks.get(rec.group, []),
                )
            )
        if cfg.report_compute_stalls:
            stall = self._compute_stall(t)
            if stall is not None:
                out.append(stall)
        return out

    def _compute_stall(self, t: float) -> InflightCollective | None:
        step = self._step
        if step is None or self._busy > 0:
            return None
        cfg = self.cfg
        elapsed = t - self._seg_start
        segments = _snapshot(self._segments)
        typical = statistics.median(segments) if segments else 0.0
        limit = max(cfg.watchdog_multiplier * typical, cfg.watchdog_floor_s)
        if elapsed < limit or t - self._stall_reported_s < cfg.watchdog_repeat_s:
            return None
        self._stall_reported_s = t
        return InflightCollective(
            job=cfg.job,
            rank=self.rank,
            group="",
            op=COMPUTE_OP,
            seq=0,
            elapsed_s=elapsed,
            last_completed_seq=self.last_completed(),
            step=step.step,
        )


def _fill_nonfinite(fields: dict[str, Any], count: int, first: CallRecord | None) -> None:
    """Add the device check's tally to a summary (the CPU check may have counted too)."""
    if not count:
        return
    fields["nonfinite_inputs"] = fields.get("nonfinite_inputs", 0) + count
    if first is not None and "nonfinite_first_op" not in fields:
        fields["nonfinite_first_op"] = first.op
        fields["nonfinite_first_group"] = first.group
        fields["nonfinite_first_seq"] = first.seq


def _copy(mapping: dict[Any, Any]) -> dict[Any, Any]:
    """Copy a dict another thread may be resizing (the copy itself runs under the GIL)."""
    for _ in range(100):
        try:
            return dict(mapping)
        except RuntimeError:  # pragma: no cover - resized mid-copy; try again
            continue
    return {}  # pragma: no cover


def _snapshot(window: deque[float]) -> list[float]:
    for _ in range(100):
        try:
            return list(window)
        except RuntimeError:  # pragma: no cover - mutated mid-copy; try again
            continue
    return []  # pragma: no cover


__all__ = ["COMPUTE_OP", "STEP_MAX", "CallRecord", "Recorder", "StepNumbering"]
