"""Device-side timing of collectives: marks on the stream that runs them, read by a poller.

On a GPU the host returns from a collective as soon as its kernel is *enqueued*
(ProcessGroupNCCL even completes ``Work.get_future()`` then), so host clocks time the
launch, not the collective. Each call on a device tensor is therefore bracketed by two
marks on the device's own timeline::

    start = clock.start()          # recorded on the current stream, before the launch
    work  = all_reduce(...)        # NCCL's stream waits for the current stream, then runs
    end   = clock.end_sync()       # synchronous op: the current stream now waits for NCCL
    end   = clock.end_async(work)  # async op: a side stream waits for the work, then records

and stays in flight until ``end.query()`` says the mark has passed; the background poller
(:meth:`collectives.recorder.Recorder.poll_events`, run by the watchdog thread) asks, and
never synchronizes. A hang is a call whose end mark never fires. The host time of the launch
is kept apart (``CallRecord.enqueue_s``).

Two clocks implement the same small interface:

* :class:`CudaEventClock`: ``torch.cuda.Event(enable_timing=True)``. For an async call the
  end event is recorded on a side stream made to wait for the work (``work.wait()`` under
  ``torch.cuda.stream(side)`` only inserts a stream dependency), so it fires when the
  collective ends without making the training stream wait. With
  ``TORCH_NCCL_BLOCKING_WAIT=1`` that ``wait()`` would block the host, so the end mark is
  then taken at the job's own ``wait()`` instead.
* :class:`CpuEventClock`: a CPU "event" that fires when the call's Work future completes.
  Tests run the whole device path (marks, poller, in-flight bookkeeping, NaN/Inf flags read
  back later) on gloo with it; it is not used for CPU jobs otherwise.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import torch

now = time.perf_counter


class Mark(Protocol):
    """A point on a device timeline."""

    def query(self) -> bool:
        """Whether the device has passed this point (never blocks)."""

    def seconds_since(self, start: Mark) -> float:
        """Device time from ``start`` to this mark; call only once :meth:`query` is true."""


class EventClock(Protocol):
    name: str

    def start(self) -> Mark: ...

    def end_sync(self) -> Mark: ...

    def end_async(self, work: Any) -> Mark | None:
        """A mark that fires when ``work`` completes on the device, or None when it cannot be
        had without blocking the host (the mark is then taken at the job's ``wait()``)."""

    def copy_flag(self, device_flag: torch.Tensor) -> tuple[torch.Tensor, Mark]:
        """Start copying a small device tensor to host memory; the copy is readable once the
        returned mark fires."""


# ---------------------------------------------------------------------- CUDA


class CudaMark:
    __slots__ = ("event",)

    def __init__(self, stream: Any = None) -> None:
        self.event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.event.record(stream)

    def query(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def seconds_since(self, start: Mark) -> float:
        assert isinstance(start, CudaMark)
        return float(start.event.elapsed_time(self.event)) / 1000.0


class CudaEventClock:
    name = "cuda"

    def __init__(self) -> None:
        self._side: dict[int, Any] = {}
        self._pinned: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.blocking_wait = _env_on("TORCH_NCCL_BLOCKING_WAIT") or _env_on("NCCL_BLOCKING_WAIT")

    def start(self) -> Mark:
        return CudaMark()

    def end_sync(self) -> Mark:
        return CudaMark()

    def end_async(self, work: Any) -> Mark | None:
        if self.blocking_wait or work is None:
            return None
        side = self._side_stream()
        with torch.cuda.stream(side):
            work.wait()  # a stream dependency on NCCL's stream, not a host wait
            return CudaMark(side)

    def copy_flag(self, device_flag: torch.Tensor) -> tuple[torch.Tensor, Mark]:
        host = torch.empty(device_flag.shape, dtype=device_flag.dtype, pin_memory=True)
        host.copy_(device_flag, non_blocking=True)
        return host, CudaMark()

    def _side_stream(self) -> Any:
        device = torch.cuda.current_device()
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return stream


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------- CPU stand-in


class CpuMark:
    """Fires once ``t`` is set (one attribute store: atomic for the poller that reads it)."""

    __slots__ = ("t",)

    def __init__(self, t: float | None = None) -> None:
        self.t = t

    def fire(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return self.t is not None

    def seconds_since(self, start: Mark) -> float:
        assert isinstance(start, CpuMark) and start.t is not None and self.t is not None
        return max(self.t - start.t, 0.0)


class CpuEventClock:
    """Marks on the CPU clock; an async call's end mark fires with its Work's future."""

    name = "cpu"

    def start(self) -> Mark:
        return CpuMark(now())

    def end_sync(self) -> Mark:
        return CpuMark(now())

    def end_async(self, work: Any) -> Mark | None:
        if work is None:
            return None
        mark = CpuMark()
        work.get_future().add_done_callback(lambda _f: mark.fire(now()))
        return mark

    def copy_flag(self, device_flag: torch.Tensor) -> tuple[torch.Tensor, Mark]:
        host = torch.empty(device_flag.shape, dtype=device_flag.dtype)
        host.copy_(device_flag, non_blocking=True)
        return host, CpuMark(now())


def default_clock(device_path_on_cpu: bool, cuda_events: bool) -> EventClock | None:
    """The clock a session times device calls with (None: host clocks only)."""
    if cuda_events and torch.cuda.is_available():
        return CudaEventClock()
    if device_path_on_cpu:
        return CpuEventClock()
    return None


__all__ = [
    "CpuEventClock",
    "CpuMark",
    "CudaEventClock",
    "CudaMark",
    "EventClock",
    "Mark",
    "default_clock",
]
