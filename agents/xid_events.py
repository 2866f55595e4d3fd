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
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from trainguard.wire import XidEvent

log = logging.getLogger(__name__)

#: How long one wait blocks (ms); bounds how long ``stop()`` takes.
WAIT_TIMEOUT_MS = 200
#: Events kept per GPU between samples; beyond this the oldest are dropped (and counted).
MAX_PENDING_PER_GPU = 1024
XID_EVENTS = int(pynvml.nvmlEventTypeXidCriticalError)
#: ECC events, registered where the board supports them.
ECC_EVENTS = int(pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError)
#: Everything the watcher asks for.
WATCHED_EVENTS = XID_EVENTS | ECC_EVENTS


@dataclass(frozen=True, slots=True)
class EccEvent:
    """One ECC event from NVML: which GPU, and whether the error was uncorrectable."""

    gpu_index: int
    uncorrectable: bool
    time_unix_s: float


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
    ) -> None:
        self._api = api
        self._handles = list(handles)
        self._on_event = on_event
        self._on_ecc = on_ecc
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, list[XidEvent]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.dropped_total = 0
        self.registered: list[int] = []
        #: GPU index -> the event types it was registered for.
        self.registered_events: dict[int, int] = {}
        #: ECC events seen, by uncorrectable (True) or not.
        self.ecc_events_total: dict[bool, int] = {False: 0, True: 0}

    def start(self) -> None:
        """Create the event set and register each GPU; a GPU that refuses is logged, skipped."""
        try:
            self._event_set = self._api.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("XID events unavailable (nvmlEventSetCreate: %s); relying on polling", exc)
            return
        for index, handle in enumerate(self._handles):
            if handle is None:  # did not answer at start; its faults show in the samples
                log.warning("GPU %d: not registered for XID events (no NVML handle)", index)
                continue
            mask = self._register(index, handle)
            if mask:
                self.registered.append(index)
                self.registered_events[index] = mask
            else:
                log.warning("GPU %d: cannot register for XID events", index)
        self._thread = threading.Thread(target=self._run, name="xid-watcher", daemon=True)
        self._thread.start()

    def update_handles(self, handles: Sequence[Any]) -> list[int]:
        """Register GPUs that first answered after ``start`` (they had no handle then);
        returns the indices registered now. Before ``start`` only the handles are kept."""
        self._handles = list(handles)
        if self._event_set is None:
            return []
        added: list[int] = []
        for index, handle in enumerate(self._handles):
            if handle is None or index in self.registered_events:
                continue
            mask = self._register(index, handle)
            if mask:
                self.registered.append(index)
                self.registered_events[index] = mask
                added.append(index)
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
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._event_set is not None:
            try:
                self._api.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None

    def drain(self, gpu_index: int) -> list[XidEvent]:
        """Events for one GPU since the last drain, oldest first."""
        with self._lock:
            return self._pending.pop(gpu_index, [])

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

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                data = self._api.nvmlEventSetWait_v2(self._event_set, WAIT_TIMEOUT_MS)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    failures = 0
                    continue
                failures += 1
                if failures == 1:
                    log.warning("nvmlEventSetWait_v2 failed (%s); retrying", exc)
                self._stop.wait(min(5.0, 0.1 * 2**failures))
                continue
            except Exception:
                log.exception("XID watcher: unexpected error; retrying")
                self._stop.wait(1.0)
                continue
            failures = 0
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                self._record(data)
            elif data.eventType & ECC_EVENTS:
                self._ecc(data)

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
        event = XidEvent(
            code=int(data.eventData),
            time_unix_s=self._clock(),
            gpu_index=index,
            detail=f"XID {int(data.eventData)} reported by NVML",
        )
        if index is None:
            log.warning("XID %d on a GPU NVML cannot name; dropped", event.code)
            with self._lock:
                self.dropped_total += 1
            return
        log.warning("GPU %d: XID %d", index, event.code)
        with self._lock:
            bucket = self._pending[index]
            bucket.append(event)
            if len(bucket) > MAX_PENDING_PER_GPU:
                del bucket[0]
                self.dropped_total += 1
        if self._on_event is not None:
            self._on_event(event)


__all__ = ["ECC_EVENTS", "WATCHED_EVENTS", "XID_EVENTS", "EccEvent", "XidWatcher"]
