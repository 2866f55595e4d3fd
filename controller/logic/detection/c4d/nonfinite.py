"""Non-finite values (NaN/Inf): the rank that produced one, before a reduction spread it.

A NaN in one rank's gradient becomes a NaN on every rank once the gradients are
all-reduced, and in every weight after the optimizer step, so "which ranks saw NaN" points
nowhere after the fact. The ranks check each reduction's *input* before the call and say so
in their step summary: how many calls, and the first one's group and per-group sequence
number (``StepSummary.nonfinite_*``). Sequence numbers of one group are the same call on
every rank, so the origin is the rank(s) whose first non-finite input came at the lowest
sequence number of that group, in the first step where any rank saw one; ranks that only
saw it later received it. Sequence numbers of *different* groups cannot be ordered: when the
lowest calls of two groups both carry NaN (a pipeline stage sent it to the next one by a
point-to-point transfer, which is not checked, and each fed it into its own data-parallel
reduction), either group's rank may be the origin. Both are named, each with its call and
group, at confidence ``1 / number of groups``.

One incident per job: it opens at the first such step (once no earlier step can still
turn up) and resolves after ``window_steps`` clean steps (a job that skips bad steps, as
dynamic loss scaling does, recovers on its own). While it is open, every later step that
still carries NaN/Inf is counted in ``evidence.bad_steps`` (a refresh of the incident):
an fp16 overflow that the loss scaler skips stays at 1, a diverged model whose weights are
NaN grows by one per step, which is what the remediation policy's ``min_bad_steps`` waits
for before rolling the job back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.job_evidence import NonfiniteEvidence
from trainguard.wire import StepSummary


def origins(rows: dict[int, StepSummary]) -> tuple[int, ...]:
    """Ranks whose non-finite input came first (lowest sequence number of its group)."""
    bad = {r: s for r, s in rows.items() if s.nonfinite_inputs > 0}
    first: dict[str, int] = {}
    for s in bad.values():
        if s.nonfinite_first_seq is not None:
            group = s.nonfinite_first_group
            first[group] = min(first.get(group, s.nonfinite_first_seq), s.nonfinite_first_seq)
    return tuple(
        sorted(
            r
            for r, s in bad.items()
            # Without a sequence number (an older rank) it cannot be ordered: keep it.
            if s.nonfinite_first_seq is None
            or s.nonfinite_first_seq == first[s.nonfinite_first_group]
        )
    )


def origin_groups(rows: dict[int, StepSummary], culprits: tuple[int, ...]) -> dict[str, list[int]]:
    """Origin ranks by the group of their first poisoned call (those with a sequence number:
    only they were ordered, within their group)."""
    by_group: dict[str, list[int]] = {}
    for r in culprits:
        if rows[r].nonfinite_first_seq is not None:
            by_group.setdefault(rows[r].nonfinite_first_group, []).append(r)
    return by_group


#: Steps whose reporting ranks are kept (to tell when a step is complete).
_STEPS_KEPT = 256
#: At most this many (step, rank) entries are kept in all; the oldest steps go first. A
#: step whose ranks were forgotten is not "complete" and waits ``grace_s`` instead.
_RANK_ENTRIES_KEPT = 262_144
#: Refresh the open incident for each of its first bad steps, then every this many (enough
#: to keep its evidence fresh for the remediation guard without a write per step).
_REFRESH_EVERY_AFTER = 10
_REFRESH_EVERY = 50


@dataclass(slots=True)
class NonfiniteState:
    """Watches step summaries as they arrive (not when their step is compared: a later
    step, where every rank already carries the NaN, may be compared first and the origin
    step then dropped as late)."""

    job: str
    clear_steps: int
    grace_s: float
    open: bool = False
    clean_streak: int = 0
    #: Steps with NaN/Inf since the incident opened, its first step included.
    bad_steps: int = 0
    #: The opening finding (refreshes repeat it with ``bad_steps`` updated).
    opened: Finding | None = None
    #: step -> ranks that reported it. Distinct ranks, not summaries: a spool resends
    #: summaries, and a duplicate counted twice would make an incomplete step look
    #: complete, so the detector would stop waiting for the origin's late summary.
    ranks_per_step: dict[int, set[int]] = field(default_factory=dict)
    _rank_entries: int = 0
    bad: dict[int, dict[int, StepSummary]] = field(default_factory=dict)
    first_seen_s: float | None = None
    lowest_step: int | None = None

    def observe(self, s: StepSummary, now_s: float) -> None:
        if self.lowest_step is None or s.step < self.lowest_step:
            self.lowest_step = s.step
        ranks = self.ranks_per_step.setdefault(s.step, set())
        if s.rank not in ranks:
            ranks.add(s.rank)
            self._rank_entries += 1
        self._forget_old_steps()
        if s.nonfinite_inputs and not self.open:
            self.bad.setdefault(s.step, {})[s.rank] = s
            if self.first_seen_s is None:
                self.first_seen_s = now_s

    def _forget_old_steps(self) -> None:
        """Bound the memory: at most ``2 * _STEPS_KEPT`` steps and ``_RANK_ENTRIES_KEPT``
        ranks in all (a large job reaches the second first)."""
        kept = self.ranks_per_step
        if len(kept) <= 2 * _STEPS_KEPT and self._rank_entries <= _RANK_ENTRIES_KEPT:
            return
        for old in sorted(kept)[: max(1, len(kept) // 2)]:
            self._rank_entries -= len(kept.pop(old))

    def _reported(self, step: int) -> int:
        return len(self.ranks_per_step.get(step, ()))

    def evaluate(self, now_s: float, world_size: int, rank_node: dict[int, str]) -> Finding | None:
        """Open once the first step with a NaN/Inf input can no longer be preceded by an
        earlier one: every rank reported it and the step before (ranks report in order),
        or ``grace_s`` passed since the first such report."""
        if self.open or not self.bad or self.first_seen_s is None:
            return None
        step = min(self.bad)
        settled = all(
            self._reported(k) >= world_size or k < (self.lowest_step or 0) for k in (step - 1, step)
        )
        if not settled and now_s - self.first_seen_s < self.grace_s:
            return None
        rows = self.bad[step]
        reported = max(self._reported(step), len(rows))
        self.open, self.clean_streak, self.bad_steps = True, 0, 1
        self.bad.clear()
        self.first_seen_s = None
        self.opened = self._finding(step, rows, reported, rank_node)
        return self.opened

    def compared(self, rows: dict[int, StepSummary]) -> Finding | None:
        """A step was compared: count clean steps towards resolving an open incident."""
        if not self.open:
            return None
        if any(s.nonfinite_inputs for s in rows.values()):
            self.clean_streak = 0
            return self._still_bad(rows)
        self.clean_streak += 1
        if self.clean_streak < self.clear_steps:
            return None
        self.open, self.opened = False, None
        return Finding(
            kind=FindingKind.NONFINITE,
            job=self.job,
            severity="critical",
            summary=f"job {self.job}: {self.clean_streak} steps without NaN/Inf inputs",
            key=self.key,
            resolved=True,
        )

    def _still_bad(self, rows: dict[int, StepSummary]) -> Finding | None:
        """A step after the opening one still carries NaN/Inf: count it, refresh the incident."""
        opened = self.opened
        if opened is None or not rows or not isinstance(opened.evidence, NonfiniteEvidence):
            return None
        if next(iter(rows.values())).step <= opened.evidence.step:
            return None  # the opening step (or an earlier one) compared late: already counted
        self.bad_steps += 1
        n = self.bad_steps
        if n > _REFRESH_EVERY_AFTER and n % _REFRESH_EVERY:
            return None
        return replace(
            opened,
            summary=f"{opened.summary}; NaN/Inf in {n} steps so far",
            evidence=opened.evidence.model_copy(update={"bad_steps": n}),
            refresh=True,
        )

    @property
    def key(self) -> str:
        return f"nonfinite:{self.job}"

    def _finding(
        self, step: int, rows: dict[int, StepSummary], reported: int, rank_node: dict[int, str]
    ) -> Finding:
        culprits = origins(rows)
        bad = sorted(rows)
        first = rows[culprits[0]]
        what = f"{first.nonfinite_first_op} #{first.nonfinite_first_seq}"
        nodes = tuple(sorted({rank_node.get(r, "?") for r in culprits}))
        everyone = len(culprits) == reported
        by_group = origin_groups(rows, culprits)
        unordered = len(by_group) > 1 and not everyone
        confidence = 0.5 if everyone else 1.0
        if everyone:
            # All at once: the data or the model itself, not one rank's hardware.
            blame = f"every rank ({reported}) fed NaN/Inf into {what} at once"
        elif unordered:
            # Calls of different groups have no common order: one group's rank may have
            # received the NaN from another's outside any checked reduction (a pipeline
            # send), so each is only possibly the origin.
            parts = [
                f"{ranks} on {sorted({rank_node.get(r, '?') for r in ranks})} "
                f"{'fed NaN/Inf ' if i == 0 else ''}into {rows[ranks[0]].nonfinite_first_op} "
                f"#{rows[ranks[0]].nonfinite_first_seq} of group {group}"
                for i, (group, ranks) in enumerate(sorted(by_group.items(), key=lambda kv: kv[1]))
            ]
            blame = (
                f"rank(s) {', rank(s) '.join(parts)} first; calls of different groups cannot "
                "be ordered, so one of them may have received it from another outside any "
                "checked reduction (e.g. a pipeline send)"
            )
            confidence = round(1 / len(by_group), 2)
        else:
            blame = (
                f"rank(s) {list(culprits)} on {list(nodes)} fed NaN/Inf into {what} "
                "before the reduction spread it"
            )
        evidence = NonfiniteEvidence(
            step=step,
            op=first.nonfinite_first_op,
            group=first.nonfinite_first_group,
            seq=first.nonfinite_first_seq,
            origin_ranks=list(culprits),
            nonfinite_ranks=bad,
            first_seq_by_rank={str(r): rows[r].nonfinite_first_seq for r in bad},
            nonfinite_calls_by_rank={str(r): rows[r].nonfinite_inputs for r in bad},
            clean_ranks=reported - len(bad),
            gpu_index=first.gpu_index if len(culprits) == 1 else None,
            # A single origin among clean peers is unambiguous; all ranks at once is not,
            # nor are origins in groups that cannot be ordered.
            confidence=confidence,
            bad_steps=1,
        )
        if unordered:
            evidence.origin_group_by_rank = {
                str(r): g for g, ranks in by_group.items() for r in ranks
            }
        return Finding(
            kind=FindingKind.NONFINITE,
            job=self.job,
            severity="critical",
            summary=f"job {self.job} step {step}: {blame}",
            key=self.key,
            ranks=culprits,
            nodes=nodes,
            evidence=evidence,
        )
