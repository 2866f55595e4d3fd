"""Goodput accounting per job: productive time, time lost per incident, and ETTR.

A :class:`GoodputLedger` is fed two streams and keeps no clock of its own (times are the
caller's, in seconds):

* step records, one per completed training step: ``record_step(step, t_end, duration_s)``;
* lifecycle events from the policy engine, per incident: ``fault`` (when the fault began:
  the incident's evidence start when known, else its open time; it may lie in the past),
  ``detected``, ``restart_started`` (with the last step reached and the checkpoint step
  resumed from), ``resumed`` (the first step after the restart completed) and ``closed``
  (an incident resolved without a restart, e.g. a straggler that went away).

The model. An incident's *window* runs from its fault to the job's resumption (or its
closing; still open: up to now). Time inside a window is lost, except that steps completed
inside it *and kept* (not thrown away by a restart from an older checkpoint) are credited
at the median healthy step time — so a straggler costs its slowdown, a hang its whole
window. Steps redone after a restart (``last_step - resume_step``) cost
``recomputed_steps * median healthy step time`` on top::

    lost_s = max(0, outage_s - credited_s) + recomputed_s
    productive_s = wall_s - Σ lost_s          ETTR (goodput) = productive_s / wall_s

where ``wall_s`` runs from the start of the job's first step. A step that ends exactly
when a fault begins is before it; the first step after a restart ends the window, so its
time (checkpoint load, communicator setup) counts as recovery — and, when it is a redone
step, also once more in ``recomputed_s`` (an over-count of at most one step per restart).

Windows that overlap are charged once: the earlier incident owns the overlap (a second
fault during the first one's recovery adds only what extends beyond it), and steps already
due for recomputation by a still-pending restart are not charged twice.
A step completed twice counts once (``steps`` vs ``repeated_steps``).

Memory is O(1) per step (a bounded window of recent steps for the median and for
crediting steps that completed before a fault was reported) plus O(1) per incident.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Incident:
    id: str
    kind: str
    fault_t: float
    order: int
    detected_t: float | None = None
    restart_t: float | None = None
    resumed_t: float | None = None
    closed_t: float | None = None
    last_step: int | None = None
    resume_step: int | None = None
    recomputed_steps: int = 0
    #: Median healthy step time when the restart began (prices the recomputation).
    step_s_at_restart: float | None = None
    # Steps completed inside the window, before any restart: lowest, highest, count.
    lo: int | None = None
    hi: int | None = None
    n: int = 0

    def end(self) -> float | None:
        return self.resumed_t if self.resumed_t is not None else self.closed_t

    def open_at(self, t: float) -> bool:
        end = self.end()
        return self.fault_t < t and (end is None or t < end)

    def add_step(self, step: int) -> None:
        self.lo = step if self.lo is None else min(self.lo, step)
        self.hi = step if self.hi is None else max(self.hi, step)
        self.n += 1

    def kept_steps(self) -> int:
        """Steps completed in the window that the restart (if any) did not throw away."""
        if self.n == 0 or self.resume_step is None or self.lo is None:
            return self.n
        return max(0, min(self.n, self.resume_step - self.lo + 1))


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    """Length of ``[a0, a1]`` covered by the union of ``spans``."""
    covered = 0.0
    cursor = a0
    for s0, s1 in sorted(spans):
        lo, hi = max(s0, cursor), min(s1, a1)
        if hi > lo:
            covered += hi - lo
            cursor = hi
    return covered


class GoodputLedger:
    """Goodput of one job; see the module docstring for the model."""

    def __init__(self, job: str, *, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.job = job
        self._first_start: float | None = None
        self._latest_t: float | None = None
        self._high_water: int | None = None
        self._steps = 0
        self._repeated = 0
        #: (t_end, duration_s) of recent steps outside any incident window.
        self._healthy: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        #: (step, t_end) of recent steps, to credit those that finish before a fault arrives.
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._incidents: dict[str, _Incident] = {}

    # -- feeding --------------------------------------------------------------------------

    def _seen(self, t: float) -> None:
        self._latest_t = t if self._latest_t is None else max(self._latest_t, t)

    def record_step(self, step: int, t_end: float, duration_s: float) -> None:
        """One completed training step (any rank's view of the job's step)."""
        if duration_s < 0:
            raise ValueError(f"step {step}: duration_s must be >= 0, got {duration_s}")
        start = t_end - duration_s
        if self._first_start is None or start < self._first_start:
            self._first_start = start
        self._seen(t_end)
        if self._high_water is None or step > self._high_water:
            self._high_water = step
            self._steps += 1
        else:
            self._repeated += 1
        self._recent.append((step, t_end))
        owner = self._owner(t_end)
        if owner is None:
            self._healthy.append((t_end, duration_s))
        elif owner.restart_t is None:
            owner.add_step(step)

    def fault(self, t: float, incident_id: str, kind: str) -> None:
        """An incident's fault began at ``t`` (may be earlier than steps already recorded)."""
        if incident_id in self._incidents:
            return  # repeated report: the first one stands
        inc = _Incident(id=incident_id, kind=kind, fault_t=t, order=len(self._incidents))
        self._incidents[incident_id] = inc
        self._seen(t)
        # Steps that finished after the fault began were not healthy; credit those this
        # incident owns (no earlier open window covers them).
        self._healthy = collections.deque(
            (h for h in self._healthy if h[0] <= t), maxlen=self._healthy.maxlen
        )
        for step, t_end in self._recent:
            if t_end > t and self._owner(t_end) is inc:
                inc.add_step(step)

    def _ensure(self, t: float, incident_id: str) -> _Incident:
        """An event for an incident whose fault was never reported starts it at ``t``."""
        if incident_id not in self._incidents:
            self.fault(t, incident_id, "unknown")
        return self._incidents[incident_id]

    def detected(self, t: float, incident_id: str) -> None:
        inc = self._ensure(t, incident_id)
        self._seen(t)
        if inc.detected_t is None:
            inc.detected_t = t

    def started_at(self, t: float) -> None:
        """The job's first step began at ``t`` at the latest (a ledger rebuilt after a
        failover knows the job's start from the database, not from its steps)."""
        if self._first_start is None or t < self._first_start:
            self._first_start = t
        self._seen(t)

    def restart_started(
        self,
        t: float,
        incident_id: str,
        last_step: int,
        resume_step: int,
        *,
        step_s: float | None = None,
    ) -> None:
        """The engine began restarting the job for this incident, from ``resume_step``.

        ``step_s`` prices the recomputed steps (default: the median healthy step now)."""
        inc = self._ensure(t, incident_id)
        self._seen(t)
        if inc.restart_t is not None:
            return  # a retried restart: the first one stands
        if inc.detected_t is None:
            inc.detected_t = t
        # Steps already due for recomputation by restarts still pending are not charged twice.
        pending = [
            (float(i.resume_step), float(i.last_step))
            for i in self._incidents.values()
            if i is not inc
            and i.restart_t is not None
            and i.resumed_t is None
            and i.resume_step is not None
            and i.last_step is not None
        ]
        lo, hi = float(resume_step), float(max(last_step, resume_step))
        inc.recomputed_steps = round((hi - lo) - _overlap(lo, hi, pending))
        inc.restart_t, inc.last_step, inc.resume_step = t, last_step, resume_step
        inc.step_s_at_restart = step_s if step_s is not None else self.median_step_s()

    def resumed(self, t: float) -> None:
        """The first step after a restart completed: every pending restart is over."""
        self._seen(t)
        for inc in self._incidents.values():
            if inc.restart_t is not None and inc.end() is None:
                inc.resumed_t = max(t, inc.fault_t)

    def closed(self, t: float, incident_id: str) -> None:
        """An incident resolved without a restart; its window ends at ``t``."""
        inc = self._incidents.get(incident_id)
        self._seen(t)
        if inc is not None and inc.end() is None:
            inc.closed_t = max(t, inc.fault_t)

    def _owner(self, t: float) -> _Incident | None:
        """The earliest-fault incident whose window contains ``t``."""
        best: _Incident | None = None
        for inc in self._incidents.values():
            if inc.open_at(t) and (
                best is None or (inc.fault_t, inc.order) < (best.fault_t, best.order)
            ):
                best = inc
        return best

    # -- reading --------------------------------------------------------------------------

    @property
    def high_water_step(self) -> int | None:
        """The highest step completed so far (steps run again after a restart do not move it)."""
        return self._high_water

    def median_step_s(self) -> float | None:
        """Median duration of recent healthy steps (``None`` before the first one)."""
        if not self._healthy:
            return None
        return float(statistics.median(d for _, d in self._healthy))

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Everything as JSON-ready numbers, up to ``now`` (default: the latest time seen)."""
        now = self._latest_t if now is None else now
        median = self.median_step_s()
        start = self._first_start
        wall = 0.0 if start is None or now is None else max(0.0, now - start)
        rows: list[dict[str, Any]] = []
        earlier: list[tuple[float, float]] = []
        total_lost = 0.0
        ordered = sorted(self._incidents.values(), key=lambda i: (i.fault_t, i.order))
        for inc in ordered:
            end = inc.end()
            w_end = end if end is not None else (now if now is not None else inc.fault_t)
            w_start = inc.fault_t if start is None else max(inc.fault_t, start)
            w_end = max(w_start, w_end)
            outage = (w_end - w_start) - _overlap(w_start, w_end, earlier)
            earlier.append((w_start, w_end))
            step_s = median or 0.0
            credited = min(outage, inc.kept_steps() * step_s)
            price = inc.step_s_at_restart if inc.step_s_at_restart is not None else step_s
            recomputed_s = inc.recomputed_steps * price
            lost = max(0.0, outage - credited) + recomputed_s
            total_lost += lost
            rows.append(self._row(inc, outage, credited, recomputed_s, lost))
        total_lost = min(total_lost, wall)
        productive = wall - total_lost
        return {
            "job": self.job,
            "wall_s": wall,
            "productive_s": productive,
            "lost_s": total_lost,
            "ettr": productive / wall if wall > 0 else None,
            "steps": self._steps,
            "repeated_steps": self._repeated,
            "high_water_step": self._high_water,
            "median_step_s": median,
            "incidents": rows,
        }

    @staticmethod
    def _row(
        inc: _Incident, outage: float, credited: float, recomputed_s: float, lost: float
    ) -> dict[str, Any]:
        def gap(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else max(0.0, b - a)

        if inc.closed_t is not None:
            state = "closed"
        elif inc.resumed_t is not None:
            state = "resumed"
        elif inc.restart_t is not None:
            state = "restarting"
        else:
            state = "detected" if inc.detected_t is not None else "open"
        return {
            "incident_id": inc.id,
            "kind": inc.kind,
            "state": state,
            "fault_t": inc.fault_t,
            "detection_s": gap(inc.fault_t, inc.detected_t),
            "recovery_s": gap(inc.detected_t, inc.resumed_t),
            "restart_s": gap(inc.restart_t, inc.resumed_t),
            "recomputed_steps": inc.recomputed_steps,
            "recomputed_s": recomputed_s,
            "outage_s": outage,
            "credited_s": credited,
            "lost_s": lost,
        }
