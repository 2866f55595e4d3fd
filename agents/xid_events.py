"""XID and ECC events from NVML's event set, collected on a thread of their own.

XIDs are edge events: the driver delivers each once, through ``nvmlEventSetWait_v2``, and a
poll-based sampler would miss them. The watcher blocks in the wait (with a short timeout so
it can stop), stamps each event, and keeps it until the sampler takes it into the next
sample; ``on_event`` lets the daemon flush a report at once instead of waiting.

The same set also carries single- and double-bit ECC events where the board supports them.
Their counts reach the report through the sampler's ECC counters, so an ECC event is not
kept: ``on_ecc`` only says that one happened, so that an uncorrectable error can be
reported at once, as a critical XID is, rather than at the next reporting interval. A
board without ECC events (ECC disabled, or a driver that refuses them) is registered for
critical XIDs alone.

One bad event costs that event only: an XID code the wire cannot carry (NVML's
``eventData`` is 64-bit; an XID code fits 0 .. 2^31-1) is dropped with a warning and counted
in ``dropped_total``, and any other exception while handling one event (the record, an ECC
event, a callback) is logged (first time, then at most once a minute), counted in
``errors_total`` and the watcher goes on. Should the thread end anyway, it says so at ERROR
and ``failure`` holds the reason, which the daemon reports as the node's ``gpu_error``.

A storm (thousands of XIDs a second on every GPU of a 64-GPU node) must neither grow the
agent's memory nor push a report past the wire's ``MAX_REPORT_BYTES`` (the controller would
refuse it whole, and every sample in it with it). Per GPU the watcher keeps the newest
:data:`MAX_PENDING_PER_GPU` events and, per code, how many came and the newest of them; a
drain lists at most ``limit`` events (the caller sizes it to the report's room), and every
code seen is in that list, however many of another code followed it (a fatal XID 79 must
never be pushed out by a thousand XID 13s). Where events of a code were left out, its
newest event's ``detail`` says how many came and how many are not listed; the agent's
``trainguard_gpu_xid_errors_total`` counts every one.

A wait that fails (any error but the empty wait's TIMEOUT) is retried after a backoff that
doubles from 0.2 s to at most 5 s: the driver queues events in the set while nobody waits,
so a retry a few seconds late still delivers them, and a wait that fails at once forever
(a wedged GPU in the set) must not spin a core or flood the log. Retrying is not watching,
though: once the wait has failed without a break for ``report_after_s``, ``wait_failure``
says so and the daemon reports it as the node's ``gpu_error`` (the controller's
``gpu_watch_failed``) until a wait works again. The set spans every GPU, so it is the
node's events that go unseen, not one GPU's.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from trainguard.limits import INT32_MAX
from trainguard.wire import XidEvent

log = logging.getLogger(__name__)

#: How long one wait blocks (ms); bounds how long ``stop()`` takes.
WAIT_TIMEOUT_MS = 200
#: Events kept per GPU between samples (the wire's cap per GPU sample); beyond this the
#: oldest are dropped (and counted), the newest of each code kept apart (see the module note).
MAX_PENDING_PER_GPU = 1024
#: Distinct codes per GPU whose count and newest event are kept between samples: NVML has
#: a few dozen XID codes; past this (garbage from a broken driver) a new code is only counted.
MAX_CODES_PER_GPU = 32
XID_EVENTS = int(pynvml.nvmlEventTypeXidCriticalError)
#: ECC events, registered where the board supports them.
ECC_EVENTS = int(pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError)
#: Everything the watcher asks for.
WATCHED_EVENTS = XID_EVENTS | ECC_EVENTS
#: The largest XID code the wire carries (``XidEvent.code``).
MAX_XID_CODE = INT32_MAX
#: Least seconds between two log lines about events that failed to be handled.
ERROR_LOG_INTERVAL_S = 60.0
#: Longest backoff between two failed waits (s); see the module note.
MAX_WAIT_BACKOFF_S = 5.0
#: Failed waits without a break for this long are reported (``wait_failure``): a driver
#: reset fails them for a few seconds, a wedged GPU for good.
WAIT_FAILING_REPORT_S = 30.0


@dataclass(frozen=True, slots=True)
class EccEvent:
    """One ECC event from NVML: which GPU, and whether the error was uncorrectable."""

    gpu_index: int
    uncorrectable: bool
    time_unix_s: float


class _Pending:
    """One GPU's events since the last drain: the newest ones, and per code a count and the
    newest event of that code (so no code is ever lost to a storm of another). Events are
    numbered as they come, so a drain lists them in arrival order even where NVML's clock
    stamps several alike."""

    __slots__ = ("by_code", "count", "newest")

    def __init__(self) -> None:
        self.newest: deque[tuple[int, XidEvent]] = deque(maxlen=MAX_PENDING_PER_GPU)
        #: code -> (events of that code, (number, the newest of them))
        self.by_code: dict[int, tuple[int, tuple[int, XidEvent]]] = {}
        self.count = 0

    def add(self, event: XidEvent) -> None:
        self.count += 1
        item = (self.count, event)
        self.newest.append(item)
        seen = self.by_code.get(event.code)
        if seen is not None or len(self.by_code) < MAX_CODES_PER_GPU:
            self.by_code[event.code] = ((seen[0] if seen else 0) + 1, item)

    def listed(self, limit: int) -> list[XidEvent]:
        """At most ``limit`` events in arrival order: the newest of each code (the most
        recent codes when there are more codes than ``limit``), then the newest overall. A
        code with events left out says how many in its newest event's ``detail``."""
        limit = max(1, min(limit, MAX_PENDING_PER_GPU))
        reps = sorted(item for _, item in self.by_code.values())[-limit:]
        rep_numbers = {n for n, _ in reps}
        room = limit - len(reps)
        fill = [item for item in self.newest if item[0] not in rep_numbers]
        kept = sorted([*reps, *(fill[len(fill) - room :] if room > 0 else [])])
        listed_per_code: dict[int, int] = {}
        for _, event in kept:
            listed_per_code[event.code] = listed_per_code.get(event.code, 0) + 1
        out = []
        for number, event in kept:
            total = self.by_code[event.code][0] if event.code in self.by_code else 0
            left_out = total - listed_per_code[event.code]
            if number in rep_numbers and left_out > 0:
                detail = (
                    f"{event.detail}; {total} XID {event.code} on this GPU since the last "
                    f"sample, {left_out} not listed"
                )
                event = event.model_copy(update={"detail": detail[:512]})
            out.append(event)
        return out


def _handle_key(handle: Any) -> object:
    """Identity of a device handle: the pointer value for pynvml's ctypes handles."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return id(handle)


class XidWatcher:
    """Owns one NVML event set registered for critical XIDs and ECC errors on every GPU."""

    def __init__(
        self,
        api: Any,
        handles: Sequence[Any],
        *,
        on_event: Callable[[XidEvent], None] | None = None,
        on_ecc: Callable[[EccEvent], None] | None = None,
        clock: Callable[[], float] = time.time,
        report_after_s: float = WAIT_FAILING_REPORT_S,
    ) -> None:
        self._api = api
        self._report_after_s = report_after_s
        #: Since when (monotonic) every wait has failed; None while waits work.
        self._failing_since: float | None = None
        #: Why events are not seen although the thread runs: waits have failed without a
        #: break for ``report_after_s`` ("" while they work; cleared by the next one that does).
        self.wait_failure = ""
        self._handles = list(handles)
        self._on_event = on_event
        self._on_ecc = on_ecc
        self._clock = clock
        self._lock = threading.Lock()
        #: Held while GPUs are registered: a registration may hang on a wedged GPU.
        self._registering = threading.Lock()
        self._pending: dict[int, _Pending] = defaultdict(_Pending)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.dropped_total = 0
        self.registered: list[int] = []
        #: GPU index -> the event types it was registered for.
        self.registered_events: dict[int, int] = {}
        #: ECC events seen, by uncorrectable (True) or not.
        self.ecc_events_total: dict[bool, int] = {False: 0, True: 0}
        #: Events whose handling raised (logged, skipped; the watcher went on).
        self.errors_total = 0
        self._last_error_log: float | None = None
        #: Why the watcher thread ended although nobody stopped it ("" while it runs).
        self.failure = ""

    def start(self) -> None:
        """Create the event set and register each GPU; a GPU that refuses is logged, skipped."""
        with self._registering:
            try:
                self._event_set = self._api.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                log.warning(
                    "XID events unavailable (nvmlEventSetCreate: %s); relying on polling", exc
                )
                return
            handles = self._handles
            self._register_pending(at_start=True)
            if self._handles is not handles:  # update_handles found us busy: its handles
                self._register_pending()
            if self._stop.is_set():
                return
            thread = threading.Thread(target=self._main, name="xid-watcher", daemon=True)
            thread.start()
            self._thread = thread  # only once started: stop() may run on another thread

    def start_in_background(self) -> threading.Thread:
        """:meth:`start` on a thread of its own, for the agent's start and main loop: an
        NVML call on a wedged GPU can hang for minutes, and registering for its events must
        not hold up the heartbeat that reports the GPU as not answering."""
        thread = threading.Thread(target=self.start, name="xid-register", daemon=True)
        thread.start()
        return thread

    def update_handles(self, handles: Sequence[Any]) -> list[int]:
        """Register GPUs that first answered after ``start`` (they had no handle then);
        returns the indices registered now. Before ``start`` only the handles are kept, and
        while ``start`` is still registering (maybe stuck on a hung GPU) it picks them up
        when it is done: this call never waits for it."""
        self._handles = list(handles)
        if not self._registering.acquire(blocking=False):
            return []
        try:
            if self._event_set is None:
                return []
            return self._register_pending()
        finally:
            self._registering.release()

    def _register_pending(self, *, at_start: bool = False) -> list[int]:
        """Register every GPU with a handle that is not registered yet; the indices added.
        A GPU without a handle did not answer at start (its faults show in the samples);
        one that refuses is tried again when the handles change."""
        added: list[int] = []
        for index, handle in enumerate(self._handles):
            if index in self.registered_events:
                continue
            if self._stop.is_set():
                break
            if handle is None:
                if at_start:
                    log.warning("GPU %d: not registered for XID events (no NVML handle)", index)
                continue
            mask = self._register(index, handle)
            if not mask:
                log.warning("GPU %d: cannot register for XID events", index)
                continue
            self.registered.append(index)
            self.registered_events[index] = mask
            added.append(index)
            if not at_start:
                log.info("GPU %d: registered for XID events after it first answered", index)
        return added

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _register(self, index: int, handle: Any) -> int:
        """Register ``handle`` for what it supports of WATCHED_EVENTS; 0 when it refuses."""
        try:
            supported = int(self._api.nvmlDeviceGetSupportedEventTypes(handle))
        except pynvml.NVMLError:
            supported = WATCHED_EVENTS  # cannot tell: ask for all, fall back if refused
        wanted = WATCHED_EVENTS & (supported | XID_EVENTS)
        for mask in dict.fromkeys((wanted, XID_EVENTS)):
            try:
                self._api.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("GPU %d: nvmlDeviceRegisterEvents(0x%x): %s", index, mask, exc)
                continue
            if not mask & ECC_EVENTS:
                log.info("GPU %d: no ECC events; uncorrectable errors wait for the poll", index)
            return mask
        return 0

    def stop(self) -> None:
        self._stop.set()
        # A start still registering sees the stop and starts no watcher thread.
        registering_done = self._registering.acquire(timeout=2)
        if registering_done:
            self._registering.release()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not registering_done:
            # A registration still hangs on a wedged GPU: freeing the event set under it
            # could crash the driver call; the process is going anyway.
            log.warning("XID event set not freed: a GPU registration still hangs")
            return
        if self._event_set is not None:
            try:
                self._api.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None

    def drain(self, gpu_index: int, limit: int = MAX_PENDING_PER_GPU) -> list[XidEvent]:
        """Events for one GPU since the last drain, oldest first: at most ``limit``, every
        code seen among them (see the module note); the rest are counted in
        ``dropped_total``."""
        with self._lock:
            pending = self._pending.pop(gpu_index, None)
            if pending is None:
                return []
            listed = pending.listed(limit)
            self.dropped_total += pending.count - len(listed)
            return listed

    def _index_of(self, device: Any) -> int | None:
        try:
            return int(self._api.nvmlDeviceGetIndex(device))
        except pynvml.NVMLError:
            # A lost GPU may refuse even this; match the handle itself instead.
            key = _handle_key(device)
            for index, handle in enumerate(self._handles):
                if handle is not None and _handle_key(handle) == key:
                    return index
        return None

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.failure = f"XID watcher stopped: {exc!r}"[:400]
            log.exception("XID watcher stopped; XIDs on this node are no longer seen")
            return
        if not self._stop.is_set():  # pragma: no cover - _run returns only when stopped
            self.failure = "XID watcher stopped"

    @property
    def alive(self) -> bool:
        """Started and still watching (False before ``start`` and after ``stop``)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                data = self._api.nvmlEventSetWait_v2(self._event_set, WAIT_TIMEOUT_MS)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    failures = 0
                    self._wait_works()
                    continue
                failures += 1
                if failures == 1:
                    log.warning("nvmlEventSetWait_v2 failed (%s); retrying", exc)
                self._wait_failed(exc)
                self._stop.wait(min(MAX_WAIT_BACKOFF_S, 0.1 * 2 ** min(failures, 16)))
                continue
            except Exception:
                log.exception("XID watcher: unexpected error; retrying")
                self._stop.wait(1.0)
                continue
            failures = 0
            self._wait_works()
            try:
                if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    self._record(data)
                elif data.eventType & ECC_EVENTS:
                    self._ecc(data)
            except Exception:
                self._handling_failed(data)

    def _wait_failed(self, exc: pynvml.NVMLError) -> None:
        """Count the failure toward ``wait_failure``; say it once it has lasted long enough."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        failing_s = now - self._failing_since
        if not self.wait_failure and failing_s >= self._report_after_s:
            self.wait_failure = (
                f"nvmlEventSetWait_v2 has failed for {failing_s:.0f} s ({exc}): "
                "XID and ECC events on this node are not seen"
            )[:400]
            log.error("%s; reporting this node unhealthy until a wait works", self.wait_failure)

    def _wait_works(self) -> None:
        """A wait answered (an event, or none within the timeout): events are seen again."""
        self._failing_since = None
        if self.wait_failure:
            self.wait_failure = ""
            log.warning("nvmlEventSetWait_v2 works again; XIDs are watched")

    def _handling_failed(self, data: Any) -> None:
        """One event could not be handled: count it, log (rate-limited), keep watching."""
        with self._lock:
            self.errors_total += 1
            count = self.errors_total
        now = time.monotonic()
        if self._last_error_log is None or now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.exception(
                "XID watcher: handling an event (type 0x%x, data %r) failed (%d so far); "
                "skipped, still watching",
                int(getattr(data, "eventType", 0) or 0),
                getattr(data, "eventData", None),
                count,
            )

    def _ecc(self, data: Any) -> None:
        index = self._index_of(data.device)
        uncorrectable = bool(data.eventType & pynvml.nvmlEventTypeDoubleBitEccError)
        with self._lock:
            self.ecc_events_total[uncorrectable] += 1
        if index is None:
            log.warning("ECC event on a GPU NVML cannot name; the counters will show it")
            return
        if uncorrectable:
            log.warning("GPU %d: uncorrectable (double-bit) ECC error", index)
        else:
            log.debug("GPU %d: corrected (single-bit) ECC error", index)
        if self._on_ecc is not None:
            self._on_ecc(EccEvent(index, uncorrectable, self._clock()))

    def _record(self, data: Any) -> None:
        index = self._index_of(data.device)
        code = int(data.eventData)
        if not 0 <= code <= MAX_XID_CODE:
            # Not an XID number (NVML's 64-bit eventData; all ones is "unknown"): reporting
            # a made-up code would mislead whoever reads it, so the event is only counted.
            log.warning(
                "GPU %s: critical XID event with code %d (0x%x), not an XID number "
                "(0..%d); dropped",
                "?" if index is None else index,
                code,
                code & 0xFFFF_FFFF_FFFF_FFFF,
                MAX_XID_CODE,
            )
            with self._lock:
                self.dropped_total += 1
            return
        event = XidEvent(
            code=code,
            time_unix_s=self._clock(),
            gpu_index=index,
            detail=f"XID {code} reported by NVML",
        )
        if index is None:
            log.warning("XID %d on a GPU NVML cannot name; dropped", event.code)
            with self._lock:
                self.dropped_total += 1
            return
        log.warning("GPU %d: XID %d", index, event.code)
        with self._lock:
            self._pending[index].add(event)
        if self._on_event is not None:
            self._on_event(event)


__all__ = [
    "ECC_EVENTS",
    "MAX_CODES_PER_GPU",
    "MAX_PENDING_PER_GPU",
    "MAX_XID_CODE",
    "WATCHED_EVENTS",
    "XID_EVENTS",
    "EccEvent",
    "XidWatcher",
]
