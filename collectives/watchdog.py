"""The in-flight watchdog: a daemon thread that reports calls stuck past their deadline.

Rule: a call is stuck once it has been in flight for
``max(watchdog_multiplier * median(recent durations of its op), watchdog_floor_s)``; it is
reported then and every ``watchdog_repeat_s`` while it stays stuck, with the last completed
sequence number of every group this rank uses. A training thread stuck *outside* any call
within a step (past the same rule applied to its compute segments) is reported with
``op="compute"``, so the culprit of a non-communication hang speaks for itself too.
It also completes CUDA-timed calls whose end events have fired, and first runs its
``reapers`` (the functional collectives' :meth:`~collectives.functional.FunctionalHooks.reap`:
results dropped unwaited stop counting as in flight).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .outbox import Outbox
from .recorder import Recorder, now

log = logging.getLogger("trainguard.collectives")


class Watchdog:
    def __init__(self, recorder: Recorder, outbox: Outbox, interval_s: float) -> None:
        self.recorder = recorder
        self.outbox = outbox
        self.interval_s = interval_s
        self.reports = 0
        self.reapers: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s * 4)

    def tick(self) -> None:
        for reap in self.reapers:
            reap()
        self.recorder.poll_events()
        for record in self.recorder.stuck(now()):
            self.reports += 1
            self.outbox.add_inflight(record)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:
                log.debug("trainguard watchdog tick failed", exc_info=True)


__all__ = ["Watchdog"]
