"""Counters the agent keeps about itself, read by the Prometheus collector at scrape time."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class AgentStats:
    reports_sent_total: int = 0
    report_failures_total: int = 0
    reports_rejected_total: int = 0
    commands_total: Counter[str] = field(default_factory=Counter)
    #: (gpu index, xid code) -> events seen since start.
    xid_total: Counter[tuple[int, int]] = field(default_factory=Counter)
    #: HardwareEvent kind -> events seen since start.
    hardware_events_total: Counter[str] = field(default_factory=Counter)
    last_report_ok_unix_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def count_xid(self, gpu: int, code: int) -> None:
        with self._lock:
            self.xid_total[(gpu, code)] += 1

    def count_events(self, kinds: list[str]) -> None:
        with self._lock:
            self.hardware_events_total.update(kinds)

    def count_command(self, status: str) -> None:
        with self._lock:
            self.commands_total[status] += 1


__all__ = ["AgentStats"]
