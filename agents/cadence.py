"""When the agent seals its next report: the report timer, or sooner for job step summaries.

NVML samples are taken every second and batched into a report every ``report_interval_s``
(5 s): their consumers (health rules, power, the dashboard) read seconds-scale trends, and
ingest sized its capacity on that rate. Step summaries are different: the straggler
detector counts in *steps* (a verdict after ~15-30 compared steps), and a step is compared
only once every node's summaries of it arrived. With 5 s report timers and 70 ms steps, a
node's summaries wait up to ~70 steps before they are sent, so delivery, not the detector,
set how many steps a slow rank went unnamed (76 steps measured on real gloo runs).

So a report also goes out once some local rank has ``job_flush_steps`` (8) new step
summaries in the batch, but never sooner than ``job_flush_min_interval_s`` (1 s) after the
previous report. Delivery then costs at most ``job_flush_steps`` steps for any job whose
steps last ``job_flush_min_interval_s / job_flush_steps`` or more (125 ms at the
defaults; 1 s worth of steps below that), and the report rate stays bounded: a job with
steps of 0.625 s or more still reports every 5 s (its 8 steps take longer than the timer),
and no node reports more than once per ``job_flush_min_interval_s`` however short its
steps: at most 1 report/s per node, 250 reports/s for a 2,000-GPU fleet of 8-GPU nodes
whose jobs all step faster than 0.625 s, against ~400 reports/s that ingest keeps up with
on 2 cores (docs/controller.md). Samples are not sent more often: an early report carries
the ones taken since the previous report. The rule is a pure function of the clock and the
batch so the benchmark (``bench.detect_gloo``) replays deployed agents with this very code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.wire import JobRecords


@dataclass(kw_only=True, slots=True)
class ReportCadence:
    """The report timer and the early flush for step summaries, on one node."""

    report_interval_s: float
    #: A local rank with this many new step summaries makes a report due (0: timer only).
    job_flush_steps: int
    #: ...but never sooner than this after the previous report.
    job_flush_min_interval_s: float
    #: Clock time of the previous report (the agent's start before the first one).
    last_report_s: float = 0.0
    #: (job, rank) -> step summaries of that rank in the batch not yet reported.
    _pending: dict[tuple[str, int], int] = field(default_factory=dict)
    _most: int = 0

    def add(self, records: JobRecords) -> None:
        """Step summaries entered the batch."""
        for s in records.steps:
            key = (s.job, s.rank)
            n = self._pending[key] = self._pending.get(key, 0) + 1
            self._most = max(self._most, n)

    @property
    def most_pending_steps(self) -> int:
        """The most new step summaries any one local rank has waiting."""
        return self._most

    def due_s(self) -> float:
        """Clock time the next report is due."""
        due = self.last_report_s + self.report_interval_s
        if self.job_flush_steps and self._most >= self.job_flush_steps:
            due = min(due, self.last_report_s + self.job_flush_min_interval_s)
        return due

    def sealed(self) -> None:
        """The batch went into a report: none of its step summaries is pending any more."""
        self._pending.clear()
        self._most = 0

    def reported(self, now_s: float) -> None:
        """A report was sealed at ``now_s`` (on the timer, early, or urgent)."""
        self.last_report_s = now_s
        self.sealed()


__all__ = ["ReportCadence"]
