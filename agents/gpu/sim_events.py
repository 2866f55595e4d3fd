"""Event sets for the simulated NVML: critical XIDs and ECC events via ``nvmlEventSetWait_v2``.

Kept apart from :mod:`agents.gpu.sim` so the driver surface stays readable; the methods are
mixed into :class:`~agents.gpu.sim.SimNvml` and keep pynvml's names and error behaviour
(NVML_ERROR_TIMEOUT when nothing arrives within the wait, INVALID_ARGUMENT on a freed set,
NOT_SUPPORTED for event types the board cannot deliver).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml

from agents.gpu.faults import FaultSpec

#: The event types the simulated board can deliver.
SUPPORTED_EVENTS = int(
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
)
_NO_INSTANCE = 0xFFFFFFFF


def sim_error(code: int) -> pynvml.NVMLError:
    """The pynvml exception subclass for ``code`` (e.g. ``NVMLError_GpuIsLost``)."""
    return pynvml.NVMLError(code)


@dataclass(slots=True, eq=False)
class SimHandle:
    """Opaque device handle (the real one is a ctypes pointer; only identity matters)."""

    index: int


@dataclass(slots=True)
class SimEventData:
    """Same attributes as ``pynvml.c_nvmlEventData_t`` (``device`` is a SimHandle)."""

    device: SimHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


@dataclass(slots=True, eq=False)
class SimEventSet:
    registered: dict[int, int] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)
    freed: bool = False


@dataclass(slots=True, frozen=True)
class ScheduledEvent:
    ident: int
    gpu: int
    at_s: float
    event_type: int
    data: int


class SimEventsMixin:
    """The event-set half of the simulated driver; state lives in :class:`SimNvml`."""

    _lock: threading.RLock
    _events: list[ScheduledEvent]
    _handles: list[SimHandle]
    faults: tuple[FaultSpec, ...]

    def now_s(self) -> float:
        raise NotImplementedError

    def _wait_fault(self, event_set: SimEventSet) -> None:
        """A due ``nvml_error`` fault with ``events=1`` on a GPU registered in the set fails
        the wait with its code, as a wedged GPU makes the real wait fail."""
        t_s = self.now_s()
        for fault in self.faults:
            if (
                fault.kind == "nvml_error"
                and fault.value("events")
                and fault.gpu in event_set.registered
                and fault.at_s <= t_s < fault.at_s + fault.duration_s
            ):
                raise sim_error(fault.value("code"))

    def _check(self, name: str) -> None:
        raise NotImplementedError

    def _gpu(self, handle: Any, name: str) -> Any:
        raise NotImplementedError

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
        return SUPPORTED_EVENTS

    def nvmlEventSetCreate(self) -> SimEventSet:
        self._check("nvmlEventSetCreate")
        return SimEventSet()

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
            if not isinstance(eventSet, SimEventSet) or eventSet.freed:
                raise sim_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if eventTypes & ~SUPPORTED_EVENTS:
                raise sim_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            eventSet.registered[gpu.index] = eventSet.registered.get(gpu.index, 0) | eventTypes

    def _next_due(self, event_set: SimEventSet) -> ScheduledEvent | None:
        t_s = self.now_s()
        for ev in self._events:
            if ev.at_s > t_s:
                return None
            if ev.ident in event_set.delivered:
                continue
            if event_set.registered.get(ev.gpu, 0) & ev.event_type:
                return ev
        return None

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> SimEventData:
        """Block up to ``timeoutms`` for a due event; NVML_ERROR_TIMEOUT when none came."""
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        while True:
            with self._lock:
                self._check("nvmlEventSetWait_v2")
                if not isinstance(eventSet, SimEventSet) or eventSet.freed:
                    raise sim_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                self._wait_fault(eventSet)
                ev = self._next_due(eventSet)
                if ev is not None:
                    eventSet.delivered.add(ev.ident)
                    return SimEventData(self._handles[ev.gpu], ev.event_type, ev.data)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise sim_error(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(0.01, remaining))

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> SimEventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._check("nvmlEventSetFree")
        if not isinstance(eventSet, SimEventSet) or eventSet.freed:
            raise sim_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        eventSet.freed = True


__all__ = [
    "SUPPORTED_EVENTS",
    "ScheduledEvent",
    "SimEventData",
    "SimEventSet",
    "SimEventsMixin",
    "SimHandle",
    "sim_error",
]
