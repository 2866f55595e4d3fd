"""Coalesced collectives (``torch.distributed._coalescing_manager``) timed as one collective.

Inside a coalescing block nothing runs per call. On the fast path (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor`` on the block's group) torch only
appends each call to a list, returns ``None`` (or an ``_IllegalWork`` whose ``wait`` and
``get_future`` raise), and issues one ``allreduce_coalesced`` / ``*_coalesced`` call when the
block exits; with a ``device`` (ProcessGroupNCCL: ``batch_isend_irecv``, old-style blocks)
each call is queued in an NCCL group that launches at ``_end_coalescing``. Either way one
Work stands for the whole block. Timing each call on its own therefore measured nothing on
a GPU (its end mark was recorded before any kernel ran) and, on the fast path, raised on the
``_IllegalWork``; and counting each call gave the group more sequence numbers than Flight
Recorder's one entry.

So a block is timed as one collective: its start mark is taken when the block opens
(before the first call), its end mark after the block's exit issued the work (``end_sync``
for a synchronous block, a mark on the block's Work for ``async_ops=True``). Fast-path calls
become one record (``all_reduce_coalesced``, ...) with the sizes of all of them; calls queued
in a device-mode block keep a record each (point-to-point calls keep their peer), all
bracketed by the block's two marks. Without a clock (CPU jobs) the record closes when the
block's Work completes, as any async call's does.

Not done inside a block: fault injection (the calls do not run there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from .recorder import CallRecord, now
from .timed_work import TimedWork
from .timing import Mark

if TYPE_CHECKING:
    from .recorder import Recorder
    from .timing import EventClock


class Instrumented(Protocol):
    """What a block needs of the wrapper (``wrap.Instrumenter``, which imports this module)."""

    recorder: Recorder
    clock: EventClock | None


#: Calls torch collects on the fast path, and the name of the one call the block makes.
FAST_PATH: dict[str, str] = {
    "all_reduce": "all_reduce_coalesced",
    "all_gather_into_tensor": "all_gather_into_tensor_coalesced",
    "all_gather_single": "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single": "reduce_scatter_tensor_coalesced",
}


class Block:
    """One open coalescing block of the training thread (wraps torch's context manager)."""

    __slots__ = (
        "_inner",
        "_tls",
        "async_ops",
        "cm",
        "deferred",
        "device_mode",
        "gid",
        "inst",
        "rec",
        "start",
        "timed",
    )

    def __init__(
        self,
        inst: Instrumented,
        tls: threading.local,
        inner: Any,
        gid: str,
        *,
        device: bool,
        async_ops: bool,
    ) -> None:
        self.inst = inst
        self._tls = tls
        self._inner = inner
        self.gid = gid
        self.device_mode = device
        self.async_ops = async_ops
        self.cm: Any = None
        self.start: Mark | None = None
        self.rec: CallRecord | None = None
        """The one record of the block's fast-path calls (None until the first)."""
        self.timed = False
        self.deferred: list[CallRecord] = []
        """Device-mode calls timed by the block's marks (their end mark is the block's)."""

    def __enter__(self) -> Any:
        self.cm = self._inner.__enter__()
        clock = self.inst.clock
        if clock is not None:
            self.start = clock.start()  # before the first call of the block
        self._tls.block = self
        return self.cm

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._tls.block = None
        recorder = self.inst.recorder
        self._tls.depth = 1
        try:
            suppress = self._inner.__exit__(exc_type, exc, tb)
        except BaseException:
            self._tls.depth = 0
            self._fail(now())
            raise
        self._tls.depth = 0
        t1 = now()
        if exc_type is not None and not suppress:
            self._fail(t1)
            return suppress  # type: ignore[no-any-return]
        works = getattr(self.cm, "works", None)
        work = works[-1] if self.async_ops and works else None
        end = self._end_mark(work)
        rec = self.rec
        self.rec = None
        if rec is not None:
            self._close(rec, work, end, t1)
            if work is not None and works is not None:
                works[-1] = TimedWork(work, rec, recorder)  # cm.wait() goes through it
        for deferred in self.deferred:
            if end is not None and self.start is not None:
                deferred.events = (self.start, end)
                recorder.event_launched(deferred, deferred.enqueue_s)
            else:  # blocking wait: the job waits the block's Work, never these calls'
                deferred.events = None
                recorder.complete(deferred, t1)
        return suppress  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ calls inside

    def add(
        self,
        op: str,
        size: int,
        dtype: str,
        *,
        bad: bool,
        device_check: Any,
        timed: bool,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A fast-path call: torch only lists it; it joins the block's one record.

        ``bad``: its input was checked on the host and held NaN/Inf; ``device_check``: the
        input to check on the device instead (None: no check)."""
        recorder = self.inst.recorder
        rec = self.rec
        if rec is None:
            async_op = self.async_ops
            rec = self.rec = recorder.enter(FAST_PATH[op], self.gid, size, dtype, async_op, now())
            self.timed = timed and self.start is not None
        else:
            recorder.grow(rec, size)
        if bad:
            recorder.nonfinite_input(rec)
        elif device_check is not None and self.timed:
            recorder.device_nonfinite(device_check, rec)
        self._tls.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            self._tls.depth = 0  # an error here reaches __exit__, which fails the record

    def defer(self, rec: CallRecord, enqueue_s: float) -> None:
        """A device-mode call timed by marks: its start is the block's, its end comes at exit
        (until then it is in flight with no end mark: the poller leaves it)."""
        rec.events = (self.start, None) if self.start is not None else rec.events
        rec.enqueue_s = enqueue_s
        self.deferred.append(rec)

    # ------------------------------------------------------------------ exit

    def _end_mark(self, work: Any) -> Mark | None:
        clock = self.inst.clock
        if clock is None or (self.rec is None and not self.deferred):
            return None
        if self.rec is not None and not self.timed and not self.deferred:
            return None
        if self.async_ops:
            return clock.end_async(work) if work is not None else clock.end_sync()
        return clock.end_sync()  # torch waited the block's Work: the stream is past it

    def _close(self, rec: CallRecord, work: Any, end: Mark | None, t1: float) -> None:
        recorder = self.inst.recorder
        if self.timed and self.start is not None:
            recorder.unblocked(rec.enter_s, t1, rec)
            rec.events = (self.start, end)  # end None (blocking wait): taken at cm.wait()
            recorder.event_launched(rec, t1 - rec.enter_s)
            return
        if work is None and not self.async_ops:
            recorder.finish(rec, rec.enter_s, t1)
            return
        recorder.unblocked(rec.enter_s, t1, rec)
        if work is None:
            recorder.complete(rec, t1)

    def _fail(self, t: float) -> None:
        recorder = self.inst.recorder
        rec = self.rec
        if rec is not None and rec.exit_s is None:
            recorder.unblocked(rec.enter_s, t, rec)  # the deferred ones were, at their call
            recorder.complete(rec, t, ok=False)
        for deferred in self.deferred:
            recorder.complete(deferred, t, ok=False)
        self.rec = None
        self.deferred = []


__all__ = ["FAST_PATH", "Block"]
