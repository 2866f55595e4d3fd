"""ECC events through the NVML event set: the simulated driver delivers them as the real
one does, and the watcher registers for them, names them and hands them on."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pynvml
import pytest

from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import XID_DOUBLE_BIT_ECC, SimNvml
from agents.xid_events import WATCHED_EVENTS, XID_EVENTS, EccEvent, XidWatcher
from trainguard.wire import XidEvent


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def _sim(faults: str, cls: type[SimNvml] = SimNvml) -> tuple[SimNvml, Clock]:
    clock = Clock()
    api = cls(gpu_count=4, clock=clock, faults=parse_fault_specs(faults))
    api.nvmlInit()
    return api, clock


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@contextmanager
def _watching(
    api: SimNvml, clock: Clock
) -> Iterator[tuple[XidWatcher, list[XidEvent], list[EccEvent]]]:
    xids: list[XidEvent] = []
    eccs: list[EccEvent] = []
    handles = [api.nvmlDeviceGetHandleByIndex(i) for i in range(api.nvmlDeviceGetCount())]
    watcher = XidWatcher(api, handles, on_event=xids.append, on_ecc=eccs.append, clock=clock)
    watcher.start()
    try:
        yield watcher, xids, eccs
    finally:
        watcher.stop()


def _drain(api: SimNvml, event_set: Any) -> list[tuple[int, int, int]]:
    """(GPU, event type, event data) of every event due now."""
    out: list[tuple[int, int, int]] = []
    while True:
        try:
            data = api.nvmlEventSetWait_v2(event_set, 10)
        except pynvml.NVMLError_Timeout:
            return out
        out.append((api.nvmlDeviceGetIndex(data.device), data.eventType, data.eventData))


def test_sim_driver_delivers_ecc_events_with_their_xid() -> None:
    api, clock = _sim("kind=ecc,gpu=1,at=2,uncorrected=1;kind=ecc,gpu=3,at=2,corrected=5")
    event_set = api.nvmlEventSetCreate()
    for i in range(4):
        api.nvmlDeviceRegisterEvents(api.nvmlDeviceGetHandleByIndex(i), WATCHED_EVENTS, event_set)
    assert _drain(api, event_set) == []
    clock.t += 3
    assert sorted(_drain(api, event_set)) == [
        (1, pynvml.nvmlEventTypeDoubleBitEccError, 0),
        (1, pynvml.nvmlEventTypeXidCriticalError, XID_DOUBLE_BIT_ECC),
        (3, pynvml.nvmlEventTypeSingleBitEccError, 0),
    ]
    assert _drain(api, event_set) == []  # each delivered once


def test_sim_driver_keeps_ecc_events_from_an_xid_only_set() -> None:
    api, clock = _sim("kind=ecc,gpu=0,at=0,uncorrected=2,corrected=1")
    event_set = api.nvmlEventSetCreate()
    api.nvmlDeviceRegisterEvents(api.nvmlDeviceGetHandleByIndex(0), XID_EVENTS, event_set)
    clock.t += 1
    assert _drain(api, event_set) == [(0, pynvml.nvmlEventTypeXidCriticalError, XID_DOUBLE_BIT_ECC)]


def test_uncorrectable_ecc_event_reaches_on_ecc_as_urgent() -> None:
    api, clock = _sim("kind=ecc,gpu=2,at=1,uncorrected=1")
    with _watching(api, clock) as (watcher, xids, eccs):
        assert watcher.registered == [0, 1, 2, 3]
        assert set(watcher.registered_events.values()) == {WATCHED_EVENTS}
        clock.t += 2
        _wait_for(lambda: bool(eccs) and bool(xids))
        assert eccs == [EccEvent(gpu_index=2, uncorrectable=True, time_unix_s=clock.t)]
        # XID 48 still travels the XID path into the next sample, as before.
        assert [(x.code, x.gpu_index) for x in xids] == [(XID_DOUBLE_BIT_ECC, 2)]
        assert [x.code for x in watcher.drain(2)] == [XID_DOUBLE_BIT_ECC]
        assert watcher.ecc_events_total == {False: 0, True: 1}


def test_corrected_ecc_event_is_not_urgent_and_not_an_xid() -> None:
    api, clock = _sim("kind=ecc,gpu=0,at=1,corrected=3")
    with _watching(api, clock) as (watcher, xids, eccs):
        clock.t += 2
        _wait_for(lambda: bool(eccs))
        assert [(e.gpu_index, e.uncorrectable) for e in eccs] == [(0, False)]
        time.sleep(0.3)  # nothing else arrives
        assert xids == [] and watcher.drain(0) == []
        assert watcher.ecc_events_total == {False: 1, True: 0}


class _NoEccBoard(SimNvml):
    """A board with ECC disabled: it supports critical XIDs only and refuses the rest."""

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        super().nvmlDeviceGetSupportedEventTypes(handle)
        return XID_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        if eventTypes & ~XID_EVENTS:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        super().nvmlDeviceRegisterEvents(handle, eventTypes, eventSet)


class _SilentBoard(_NoEccBoard):
    """Cannot say what it supports (an older driver): the watcher asks, then falls back."""

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


@pytest.mark.parametrize("board", [_NoEccBoard, _SilentBoard])
def test_board_without_ecc_events_still_gets_xids(board: type[SimNvml]) -> None:
    api, clock = _sim("kind=xid,code=79,gpu=1,at=1", cls=board)
    with _watching(api, clock) as (watcher, xids, eccs):
        assert watcher.registered == [0, 1, 2, 3]
        assert set(watcher.registered_events.values()) == {XID_EVENTS}
        clock.t += 2
        _wait_for(lambda: bool(xids))
        assert [(x.code, x.gpu_index) for x in xids] == [(79, 1)] and eccs == []
