"""The proxy an asynchronous call returns, so that its record closes when the work does.

Its own module because both the wrapper (single calls) and the coalescing block (the one
Work a block issues) hand it out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .recorder import CallRecord, Recorder, now


class TimedWork(dist.Work):
    """Proxy of a ``torch.distributed.Work`` that closes the call's record on completion.

    A device-timed call (``rec.events``) is closed by the poller when its end mark fires,
    whatever the job does with the handle; the others close on ``wait()``,
    ``is_completed()`` or the future's completion.

    It *is* a ``dist.Work`` (a Python subclass, as torch's own ``_IllegalWork`` is): torch
    code tells an async call's handle from a synchronous call's ``None`` with
    ``isinstance(work, dist.distributed_c10d.Work)`` (FSDP2 waits its all-gather only then:
    a plain proxy made ``unshard(async_op=True)`` read parameters before they arrived).
    Every method of ``Work`` is forwarded to the wrapped one (the base object is empty).
    """

    __slots__ = ("_by_future", "_rec", "_recorder", "_work")

    def __init__(self, work: Any, rec: CallRecord, recorder: Recorder) -> None:
        super().__init__()
        self._work = work
        self._rec = rec
        self._recorder = recorder
        self._by_future = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        rec, recorder = self._rec, self._recorder
        if rec.exit_s is not None and rec.events is None:
            return self._work.wait(*args, **kwargs)
        recorder.blocked()
        t0 = now()
        try:
            result = self._work.wait(*args, **kwargs)
        except BaseException:
            recorder.unblocked(t0, now(), rec)
            recorder.complete(rec, now(), ok=False)
            raise
        t1 = now()
        recorder.unblocked(t0, t1, rec)
        events = rec.events
        if events is None:
            recorder.complete(rec, t1)
        elif events[1] is None and recorder.clock is not None:
            # Blocking wait: no end mark could be had at launch; the stream is past it now.
            rec.events = (events[0], recorder.clock.end_sync())
        return result

    def is_completed(self) -> bool:
        done = bool(self._work.is_completed())
        if done and self._rec.events is None:
            self._recorder.complete(self._rec, now())
        return done

    def get_future(self) -> Any:
        fut = self._work.get_future()
        rec, recorder = self._rec, self._recorder
        self._by_future = True
        events = rec.events
        if events is not None and events[1] is not None:
            return fut  # the end mark closes it: NCCL completes this future at enqueue
        if events is not None:  # no end mark (blocking wait): the future is all there is
            rec.events = None
            recorder.event_cancelled(rec)
        fut.add_done_callback(lambda _f: recorder.complete(rec, now()))
        return fut

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __del__(self) -> None:
        rec = self._rec
        if rec.exit_s is None and not self._by_future:
            with contextlib.suppress(Exception):  # never raise from a finalizer
                if rec.events is not None:
                    if rec.events[1] is None:  # never waited: no end mark to read
                        self._recorder.abandon(rec)
                    # else: the poller reads its marks
                elif self._work.is_completed():
                    self._recorder.complete(rec, now())
                else:
                    self._recorder.abandon(rec)


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: TimedWork, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._work, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


# The rest of Work's methods (``result``, ``exception``, ``source_rank``, ``is_success``,
# ``synchronize``, ``boxed``, ...): inherited as they are, they would act on the empty base.
for _name in dir(dist.Work):
    if _name.startswith("__") or _name in ("unbox", "_pybind11_conduit_v1_"):
        continue
    if _name not in TimedWork.__dict__ and callable(getattr(dist.Work, _name)):
        setattr(TimedWork, _name, _forwarder(_name))


__all__ = ["TimedWork"]
