"""Telling a restart of a job from a spool's resend, when the ``started`` events are lost.

A restarted job announces itself with its ranks' ``started`` events, or by a new world
size. With the same world size and the events lost (an agent restarted with them unsent),
only the step summaries remain: the new run repeats step numbers already compared, and a
spool resending an old batch does too. What tells them apart is the wall clock each
summary carries (``StepSummary.end_unix_s``, set by the job-side recorder): within one run
a rank's step numbers and end times grow together, so a rank reporting a step at or below
its highest one, ended clearly *later* than that one, is a new process resumed from a
checkpoint, while a resend carries its steps' original, older end times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.wire import StepSummary

#: How much newer than a rank's highest step a lower step's end time must be to count as a
#: restart: restarting processes and loading a checkpoint takes longer than this, and
#: hosts' clocks agree far better.
RESTART_CLOCK_MARGIN_S = 1.0


@dataclass(slots=True)
class RunClock:
    """One run's end times: per rank, that of its highest step; the run's newest."""

    #: rank -> ``end_unix_s`` of its highest step's summary (when it carried one)
    last_end_of_rank: dict[int, float] = field(default_factory=dict)
    #: Ranks whose summaries went back in steps with newer end times (restart votes).
    restarted_ranks: set[int] = field(default_factory=set)
    newest_end_unix_s: float | None = None
    #: The newest end time of the run before the last restart (its backlog ended no later).
    previous_end_unix_s: float | None = None

    def went_back(self, s: StepSummary, last_step: int | None) -> bool:
        """Whether ``s`` is from a restarted process: a step at or below its rank's highest
        (``last_step``), ended clearly later than that one. Summaries without
        ``end_unix_s`` (older job-side code) cannot tell a restart from a resend: never."""
        last_end = self.last_end_of_rank.get(s.rank)
        if s.end_unix_s is None or last_step is None or last_end is None:
            return False
        if s.step > last_step or s.end_unix_s < last_end + RESTART_CLOCK_MARGIN_S:
            return False
        self.restarted_ranks.add(s.rank)
        return True

    def restarted(self, world_size: int) -> bool:
        """Whether more than half of the job's ranks went back: one rank alone (its clock
        stepped) is not enough, a job restarts as a whole."""
        return 2 * len(self.restarted_ranks) > max(world_size, 1)

    def previous_runs(self, s: StepSummary) -> bool:
        """Whether ``s`` ended no later than the previous run's newest summary."""
        end = self.previous_end_unix_s
        return end is not None and s.end_unix_s is not None and s.end_unix_s <= end

    def record(self, s: StepSummary) -> None:
        """``s`` is its rank's highest step so far.

        It also withdraws the rank's restart vote: a restarted process repeats steps
        below its rank's highest until most ranks agree, while a rank that only looked
        restarted (its host's clock stepped back by seconds, an NTP correction, and a
        report delivered its steps out of order) goes on past its highest. Kept for the
        whole run, such votes from different nodes at different times added up to a
        false restart, which resolved the run's open incidents and emptied its windows
        (found by the fault-pattern sweep: +-2 s clock steps on three of four nodes)."""
        self.restarted_ranks.discard(s.rank)
        if s.end_unix_s is not None:
            self.last_end_of_rank[s.rank] = s.end_unix_s
            self.newest_end_unix_s = max(self.newest_end_unix_s or 0.0, s.end_unix_s)

    def next_run(self) -> RunClock:
        return RunClock(previous_end_unix_s=self.newest_end_unix_s)
