"""Per-job detection state: the sliding windows the detectors read, fed record by record.

Ingest calls :meth:`JobTrackers.observe` with every accepted report's job records (and the
node that carried them, which is how ranks are mapped to nodes); a periodic tick calls
:meth:`JobTrackers.evaluate`. Everything is in memory and bounded per job: a window of
steps, the latest in-flight record per (rank, group), crash events not yet reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from controller.logic.detection.c4d.comm_slow import CommSlowState
from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.crash import CrashState
from controller.logic.detection.c4d.evidence import Normalization
from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.group_slow import GroupSlowState
from controller.logic.detection.c4d.hang import (
    StuckCall,
    classify,
    hang_finding,
    ring_pairs,
    unexplained,
)
from controller.logic.detection.c4d.inflight import Inflight, InflightTable
from controller.logic.detection.c4d.job_evidence import (
    CommSlowEvidence,
    SlowLinkEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.c4d.node_mates import Reported, node_mates, node_note
from controller.logic.detection.c4d.nonfinite import NonfiniteState
from controller.logic.detection.c4d.probe import localize
from controller.logic.detection.c4d.restart import RunClock
from controller.logic.detection.c4d.straggler import StepVerdict, StragglerState
from controller.logic.world_size import WorldSize, outside_world
from trainguard.wire import InflightCollective, JobRecords, ProbeResult, RankEvent, StepSummary

log = logging.getLogger(__name__)

#: An open straggler's incident is refreshed when its slowdown moved by this much (absolute
#: and relative to the last report), or after this many seconds in any case.
STRAGGLER_REFRESH_MIN_CHANGE = 0.05
STRAGGLER_REFRESH_REL_CHANGE = 0.25
STRAGGLER_REFRESH_S = 60.0
#: For this long after a restart, summaries with the previous run's world size are that
#: run's backlog, not another restart (agents flush on their own timers, and a spooled
#: backlog follows an agent's reconnect).
LATE_RUN_SUMMARY_S = 120.0


@dataclass(slots=True)
class JobTracker:
    job: str
    cfg: C4DConfig
    world_size: int = 0
    #: What the ranks' recent reports agree the world size is; kept across restarts.
    world: WorldSize = field(default_factory=WorldSize)
    rank_node: dict[int, str] = field(default_factory=dict)
    rank_gpu: dict[int, int | None] = field(default_factory=dict)
    pending_steps: dict[int, dict[int, StepSummary]] = field(default_factory=dict)
    #: step -> controller time its first summary arrived (the late-summary wait starts then)
    pending_since: dict[int, float] = field(default_factory=dict)
    last_compared_step: int = -1
    newest_step: int = -1
    inflight: InflightTable = field(default_factory=InflightTable)
    last_completed: dict[int, dict[str, int]] = field(default_factory=dict)
    last_step_of_rank: dict[int, int] = field(default_factory=dict)
    #: End times of this run's summaries (tells a restart from a spool's resend).
    clock: RunClock = field(default_factory=RunClock)
    stragglers: StragglerState = field(init=False)
    comm: CommSlowState = field(init=False)
    #: Whole peer groups slow against their own history (:mod:`.group_slow`).
    groups_slow: GroupSlowState = field(init=False)
    crashes: CrashState = field(init=False)
    nonfinite: NonfiniteState = field(init=False)
    open_hangs: set[str] = field(default_factory=set)
    #: open hang key -> the stuck calls (group, seq) it stands for
    _hang_calls: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    probes: dict[str, list[ProbeResult]] = field(default_factory=dict)
    #: How many times the job restarted since the tracker first saw it.
    incarnation: int = 0
    #: Open straggler rank -> what its incident last reported; its keys are the open ones.
    _straggler_reported: dict[int, Reported] = field(default_factory=dict)
    _findings: list[Finding] = field(default_factory=list)
    #: (world size, controller time it ended) of the run before the last restart
    _previous_run: tuple[int, float] | None = None

    def __post_init__(self) -> None:
        self.stragglers = StragglerState(self.cfg)
        self.comm = CommSlowState(self.cfg)
        self.groups_slow = GroupSlowState(self.job, self.cfg)
        self.crashes = CrashState(self.job)
        self.nonfinite = NonfiniteState(
            self.job, clear_steps=self.cfg.window_steps, grace_s=self.cfg.nonfinite_grace_s
        )

    # ------------------------------------------------------------------ intake

    def observe_step(self, node: str, s: StepSummary, now_s: float = 0.0) -> None:
        agreed = self.world.observe(s.rank, s.world_size, now_s)
        if self.world_size and s.world_size != self.world_size:
            if agreed != s.world_size:
                return  # a lone report disagreeing with the other ranks (:mod:`world_size`)
            if self._late(s, now_s):
                return  # the previous run's backlog: that run is gone
            # A job changes its world size only by restarting: a new run, even when its
            # ranks' ``started`` events never reached the controller (an agent restarted
            # with them unsent). Judged on the old layout, every step of the new run
            # would lack ranks that no longer exist, and a hang would blame them.
            self._new_incarnation(now_s)
        elif self._late_same_world(s, now_s):
            return  # the previous run's backlog
        elif self.clock.went_back(s, self.last_step_of_rank.get(s.rank)):
            # A new process's step, newer than its rank's highest: once most ranks say so,
            # the job restarted with its ``started`` events lost (:mod:`.restart`); until
            # then it belongs to neither run's windows.
            if not self.clock.restarted(self.world_size):
                return
            self._new_incarnation(now_s)
        self.world_size = s.world_size
        self.rank_node[s.rank] = node
        self.rank_gpu[s.rank] = s.gpu_index
        self.nonfinite.observe(s, now_s)
        if s.step <= self.last_compared_step:
            self._progress(s)  # its step was compared: other ranks reached it too
            return  # arrived after its step was compared; too late to matter
        rows = self.pending_steps.get(s.step)
        if rows is None:
            rows = self.pending_steps[s.step] = {}
            self.pending_since[s.step] = now_s
        rows[s.rank] = s
        # A step is progress (its rank's highest, the job's newest) only once a second rank
        # reported it: one summary with an absurd step number (10**12 is valid on the wire)
        # made that number its rank's highest, so every later summary of the rank, ended
        # later, "went back" (:mod:`.restart`) and was dropped as a lone restarted process;
        # its steps then never had every rank, and the job's straggler detection stopped
        # for good (and probe rounds were set for that step). Nobody else reports such a
        # step; it waits out ``step_wait_s`` and is dropped (found by the fault-pattern sweep).
        need = min(2, self.world_size)
        if len(rows) >= need:
            for row in rows.values() if len(rows) == need else (s,):
                self._progress(row)
            self.newest_step = max(self.newest_step, s.step)
        # A rank that finished a later step is no longer stuck in an older call.
        self.inflight.passed(s.rank, s.step)

    def _progress(self, s: StepSummary) -> None:
        """``s`` is its rank's progress: its highest step so far, unless a higher one is."""
        if s.step >= self.last_step_of_rank.get(s.rank, -1):
            self.last_step_of_rank[s.rank] = s.step
            self.clock.record(s)

    def observe_inflight(self, node: str, rec: InflightCollective, now_s: float) -> None:
        if not rec.group or outside_world(rec.rank, self.world_size):
            return  # a stall outside any collective (opt-in on the rank), or a rank the job
            # does not have (a bad report, never blamed); hangs need a call of its ranks
        self.rank_node[rec.rank] = node
        self.last_completed.setdefault(rec.rank, {}).update(rec.last_completed_seq)
        self.inflight[(rec.rank, rec.group)] = Inflight(rec, now_s)

    def observe_rank_event(self, node: str, ev: RankEvent, now_s: float) -> None:
        if ev.kind == "started" and ev.rank in self.last_step_of_rank:
            self._new_incarnation(now_s)
        if ev.world_size:
            started = ev.kind == "started"
            agreed = self.world.observe(ev.rank, ev.world_size, now_s, started=started)
            # A restart's ``started`` event sets the new run's size; otherwise the ranks'
            # agreed size stands, so one event cannot grow (or shrink) a running job.
            if not self.world_size or agreed == ev.world_size:
                self.world_size = ev.world_size
        if outside_world(ev.rank, self.world_size):
            return  # a rank the job's ranks do not have: a bad report, never blamed
        self.rank_node[ev.rank] = node
        self._findings.extend(self.crashes.observe(node, ev, now_s))

    def _late(self, s: StepSummary, now_s: float) -> bool:
        """A summary of the run before the last restart, arriving late (an agent's
        backlog): it carries that run's world size, comes soon after the restart and,
        where it says when it ended, ended no later than that run's newest summary. A job
        that shrank and grew back within ``LATE_RUN_SUMMARY_S`` runs with the old size
        again: its steps, ended later, are a new run, not a backlog (they were dropped
        until then; found by the fault-pattern sweep)."""
        previous = self._previous_run
        if previous is None or s.world_size != previous[0]:
            return False
        if s.end_unix_s is not None and self.clock.previous_end_unix_s is not None:
            return self.clock.previous_runs(s)
        return now_s - previous[1] < LATE_RUN_SUMMARY_S

    def _late_same_world(self, s: StepSummary, now_s: float) -> bool:
        """The previous run's backlog with the same world size: soon after the restart, it
        ended no later than that run's newest summary."""
        previous = self._previous_run
        return (
            previous is not None
            and now_s - previous[1] < LATE_RUN_SUMMARY_S
            and self.clock.previous_runs(s)
        )

    def _new_incarnation(self, now_s: float) -> None:
        """The job restarted (a rank that already stepped starts again): begin afresh.

        A job resumed from a checkpoint repeats step numbers already compared, may run on
        other nodes and with a different world size; windows, in-flight calls and crash
        bookkeeping of the previous run would blind or mislead the detectors. What the
        previous run left open resolves: those ranks and collectives are gone.
        """
        for rank in sorted(self.stragglers.open_ranks):
            self._findings.append(self._straggler_finding(rank, resolved=True))
        self._findings.extend(self.groups_slow.resolve_all(self.rank_node))
        if self.comm.open:
            self._findings.append(self._resolved(FindingKind.COMM_SLOW, f"comm_slow:{self.job}"))
        if self.nonfinite.open:
            self._findings.append(self._resolved(FindingKind.NONFINITE, self.nonfinite.key))
        for key in sorted(self.open_hangs):
            kind = FindingKind.COMM_HANG if key.startswith("comm_hang:") else FindingKind.HANG
            self._findings.append(self._resolved(kind, key))
        fresh = JobTracker(job=self.job, cfg=self.cfg, incarnation=self.incarnation + 1)
        fresh._findings = self._findings
        fresh._previous_run = (self.world_size, now_s)
        fresh.clock = self.clock.next_run()
        fresh.world = self.world
        for name in JobTracker.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def _resolved(self, kind: FindingKind, key: str) -> Finding:
        return Finding(
            kind=kind,
            job=self.job,
            severity="warning",
            summary=f"job {self.job} restarted; the condition ended with the previous run",
            key=key,
            resolved=True,
        )

    def observe_probe(self, res: ProbeResult) -> None:
        if outside_world(max(res.src_rank, res.dst_rank), self.world_size):
            return  # a pair the controller never asked for: no evidence about a link
        self.probes.setdefault(res.probe_id, []).append(res)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, now_s: float) -> list[Finding]:
        out, self._findings = self._findings, []
        out.extend(self.crashes.evaluate(now_s, self.world_size))
        for step in self._ready_steps(now_s):
            rows = self.pending_steps.pop(step)
            self.pending_since.pop(step, None)
            self.last_compared_step = step
            out.extend(self._compare_step(step, rows, now_s))
        out.extend(self._check_hangs(now_s))
        nonfinite = self.nonfinite.evaluate(now_s, self.world_size, self.rank_node)
        if nonfinite is not None:
            out.append(nonfinite)
        return out

    def finish_probe(self, probe_id: str) -> Finding | None:
        """Localize from a completed probe round (call once its results are in)."""
        results = self.probes.pop(probe_id, [])
        if not results:
            return None
        verdict = localize(results, self.rank_node, self.cfg.probe_slow_fraction)
        if verdict.scope == "none":
            return None
        # Slow pairs sharing no rank or node are separate links: each named as its pair
        # (one list of all their ranks read as a single link).
        links = ", ".join(f"{a}-{b}" for a, b in verdict.slow_pairs)
        where = {
            "rank": f"rank(s) {list(verdict.culprit_ranks)} on {list(verdict.culprit_nodes)}",
            "node": f"node(s) {list(verdict.culprit_nodes)}",
            "link": f"the link between ranks {list(verdict.culprit_ranks)}"
            if len(verdict.slow_pairs) == 1
            else f"the links between ranks {links}",
            "failed": f"ranks {list(verdict.culprit_ranks)} (probe transfers failed)",
        }[verdict.scope]
        lesser = ", ".join(f"{a}-{b}" for a, b in verdict.marginal_pairs)
        return Finding(
            kind=FindingKind.SLOW_LINK,
            job=self.job,
            severity="warning",
            summary=f"link probe of job {self.job} localizes slow communication to {where}"
            + (f" (also slower than their peers, far less: {lesser})" if lesser else ""),
            key=f"slow_link:{self.job}:{probe_id}",
            ranks=verdict.culprit_ranks,
            nodes=verdict.culprit_nodes,
            evidence=SlowLinkEvidence(
                scope=verdict.scope,
                # A rank common to every slow pair is the sharpest answer a probe gives.
                confidence={"rank": 0.9, "node": 0.8, "link": 0.7, "failed": 0.5}[verdict.scope],
                median_gbps=round(verdict.median_gbps, 3),
                slow_pairs=[list(p) for p in verdict.slow_pairs],
                pair_gbps={f"{a}-{b}": round(g, 3) for (a, b), g in verdict.pair_gbps.items()},
                marginal_pairs=[list(p) for p in verdict.marginal_pairs],
            ),
        )

    def _ready_steps(self, now_s: float) -> list[int]:
        """Pending steps to compare now, oldest first (a per-step watermark).

        A step is ready once every rank reported it, or once it waited ``step_wait_s``
        since its first summary (a node's agent may be gone). Agents batch on their own
        timers, so a step complete on one node may lack another's summaries for seconds;
        comparing it early would drop them (and with them, a slow node's own steps). A
        rank having reported a later step proves nothing: a retried batch from the spool
        can arrive after a newer one. Steps are compared in order: a younger complete step
        waits behind an older one.
        """
        ready = []
        need = max(2, int(self.cfg.min_step_coverage * self.world_size + 0.999))
        steps_over = len(self.pending_steps) - self.cfg.max_pending_steps
        records_over = (
            sum(len(rows) for rows in self.pending_steps.values()) - self.cfg.max_pending_records
        )
        for step in sorted(self.pending_steps):
            rows = self.pending_steps[step]
            waited = now_s - self.pending_since.get(step, now_s) >= self.cfg.step_wait_s
            forced = steps_over > 0 or records_over > 0
            if len(rows) >= self.world_size or waited or forced:
                steps_over -= 1
                records_over -= len(rows)
                if len(rows) >= need:
                    ready.append(step)
                else:  # too few ranks ever reported it
                    del self.pending_steps[step]
                    self.pending_since.pop(step, None)
                continue
            break
        return ready

    def _compare_step(self, step: int, rows: dict[int, StepSummary], now_s: float) -> list[Finding]:
        verdict = self.stragglers.add(step, rows)
        out: list[Finding] = []
        opened, cleared = self.stragglers.transitions()
        for rank in sorted(opened):
            out.append(self._straggler_finding(rank, resolved=False))
            self._straggler_reported[rank] = (
                self.stragglers.slowdown(rank),
                self.stragglers.flaps(rank),
                now_s,
                node_mates(rank, self.stragglers.open_ranks, self.rank_node),
            )
        for rank in sorted(cleared):
            out.append(self._straggler_finding(rank, resolved=True))
            self._straggler_reported.pop(rank, None)
        out.extend(self._straggler_refreshes(now_s))
        suspects = verdict.flagged | self.stragglers.open_ranks
        out.extend(
            self.groups_slow.add(rows, self.stragglers.peers, suspects, self.rank_node, now_s)
        )
        out.extend(
            self._comm_slow(
                self.stragglers.explained_wait_s(verdict.flagged | self.stragglers.open_ranks),
                verdict,
                now_s,
            )
        )
        recovered = self.nonfinite.compared(rows)
        if recovered is not None:
            out.append(recovered)
        return out

    def _straggler_refreshes(self, now_s: float) -> list[Finding]:
        """Newer readings of open stragglers, when the slowdown moved or a while passed.

        A straggler first confirmed at 12% may be at 40% a minute later; the remediation
        policy's cost threshold and the operator read the open incident, and its updates
        also keep a live straggler from looking stale; so does a change in which other
        ranks of its node are open stragglers (its summary names them: :mod:`.node_mates`).
        """
        out = []
        for rank, (last, last_flaps, last_s, mates) in sorted(self._straggler_reported.items()):
            slowdown = self.stragglers.slowdown(rank)
            flaps = self.stragglers.flaps(rank)
            now_mates = node_mates(rank, self.stragglers.open_ranks, self.rank_node)
            moved = abs(slowdown - last) >= max(
                STRAGGLER_REFRESH_MIN_CHANGE, STRAGGLER_REFRESH_REL_CHANGE * abs(last)
            ) or (flaps, now_mates) != (last_flaps, mates)
            if moved or now_s - last_s >= STRAGGLER_REFRESH_S:
                out.append(replace(self._straggler_finding(rank, resolved=False), refresh=True))
                self._straggler_reported[rank] = (slowdown, flaps, now_s, now_mates)
        return out

    def _straggler_finding(self, rank: int, *, resolved: bool) -> Finding:
        node = self.rank_node.get(rank, "?")
        ev = self.stragglers.evidence(rank, node, self.rank_gpu.get(rank))
        group = ev.peer_group
        peers = "its peers" if group.label == "job" else f"its peers ({group.label})"
        if ev.normalization is Normalization.OWN_HISTORY:
            # Alone in its group, it has no peer: it is compared with its own past.
            peers = f"its own history ({group.label})"
        flaps = f"; flapped {ev.flaps}x between slow and normal" if ev.flaps else ""
        if not resolved:  # a whole slow node: its other open stragglers
            flaps += node_note(node, node_mates(rank, self.stragglers.open_ranks, self.rank_node))
        return Finding(
            kind=FindingKind.STRAGGLER,
            job=self.job,
            severity="warning",
            summary=(
                f"rank {rank} of job {self.job} on {node} (GPU {ev.gpu_index}) "
                f"computes {ev.slowdown_pct / 100:.0%} longer than {peers}, costing "
                f"~{ev.step_cost_pct / 100:.0%} of each step{flaps}"
            ),
            key=f"straggler:{self.job}:{rank}",
            ranks=(rank,),
            nodes=(node,),
            evidence=StragglerIncidentEvidence(**dict(ev)),
            resolved=resolved,
        )

    def _comm_slow(self, explained_s: float, verdict: StepVerdict, now_s: float) -> list[Finding]:
        # An open straggler explains a rise as well as a candidate does: where ranks are
        # coupled beyond one collective (pipeline stages), its delay reaches every rank's
        # wait, its own included, so it can drop out of the candidates while still slow.
        # It explains only up to its extra time per step: a larger rise is the network's.
        # The job's compute rising (a host-wide slowdown) explains a like rise of the wait.
        step_s = verdict.median_step_s
        change = self.comm.add(
            verdict.comm_wait_s, step_s, explained_s, now_s, verdict.job_compute_s
        )
        key = f"comm_slow:{self.job}"
        if change == "resolved":
            summary = f"job {self.job}: collective wait back to normal"
            return [
                Finding(
                    kind=FindingKind.COMM_SLOW,
                    job=self.job,
                    severity="warning",
                    summary=summary,
                    key=key,
                    resolved=True,
                )
            ]
        if change != "opened":
            return []
        ranks = tuple(r for r in sorted(self.rank_node) if not outside_world(r, self.world_size))
        ref, rec = self.comm.reference_wait_s, self.comm.recent_wait_s
        host_s = self.comm.host_explained_s
        balance = "" if explained_s > 0 else " with compute balanced"
        if host_s > 0.1 * (rec - ref):  # more than compute's noise
            balance = f", {host_s * 1e3:.1f} ms of it matching the job's slower compute"
        if explained_s > 0:
            balance += (
                f", more than the {explained_s * 1e3:.1f} ms per step the straggler(s) account for"
            )
        evidence = CommSlowEvidence(reference_wait_s=ref, wait_s=rec, step_s=step_s, confidence=0.5)
        if explained_s > 0:
            evidence.straggler_explained_s = round(explained_s, 6)
        return [
            Finding(
                kind=FindingKind.COMM_SLOW,
                job=self.job,
                severity="warning",
                summary=(
                    f"job {self.job}: collective wait rose from {ref * 1e3:.1f} ms to "
                    f"{rec * 1e3:.1f} ms per step on every rank{balance}; probing links"
                ),
                key=key,
                ranks=ranks,
                nodes=tuple(sorted({self.rank_node[r] for r in ranks})),
                # Which link is slow is unknown until the probe round answers.
                evidence=evidence,
                probe_pairs=ring_pairs(ranks),
            )
        ]

    def _check_hangs(self, now_s: float) -> list[Finding]:
        for rank_group in self._expired_inflight(now_s):
            del self.inflight[rank_group]
        live = [v.record for v in self.inflight.values()]
        dead = self.crashes.reported
        # One fault, one incident: non-communication hangs are keyed by who is absent (a hung
        # rank leaves a stuck call in every group it belongs to), and calls whose absentees
        # all died are already explained by their crash incident.
        by_key: dict[str, list[StuckCall]] = {}
        calls = classify(live, self.world_size, self.last_completed)
        # A rank waiting inside some stuck call is a victim wherever else it is absent (a
        # rank blocked in its tensor-parallel all-reduce never reaches the data-parallel
        # one); only absentees stuck nowhere are culprits.
        waiting = {rank for call in calls for rank in call.entered}
        skipped: list[StuckCall] = []  # victims' calls, explained by where they wait
        explaining: set[tuple[str, int]] = set()  # calls with a verdict, or not yet due
        for call in calls:
            if call.elapsed_s < self.cfg.hang_timeout_s:
                explaining.add((call.group, call.seq))
                continue
            culprits = call.stranded or tuple(r for r in call.absent if r not in waiting)
            if call.absent and not culprits:
                skipped.append(call)  # explained by the calls its absentees wait in
                continue
            explaining.add((call.group, call.seq))
            if not call.stranded:
                call = replace(call, absent=culprits)
            if set(culprits) <= dead and culprits:
                continue
            if call.communication:
                key = f"comm_hang:{self.job}:{call.group}:{call.seq}"
            else:
                key = f"hang:{self.job}:ranks:{','.join(map(str, culprits))}"
            by_key.setdefault(key, []).append(call)
        cycle = unexplained(skipped, explaining, calls)  # waiting for each other: no origin
        cycle_key: str | None = None
        if cycle:
            ranks = sorted({r for c in cycle for r in c.absent})
            cycle_key = f"hang:{self.job}:ranks:{','.join(map(str, ranks))}"
            by_key.setdefault(cycle_key, []).extend(cycle)
        out: list[Finding] = []
        for key, calls in by_key.items():
            self._hang_calls[key] = {(c.group, c.seq) for c in calls}
            if key not in self.open_hangs:
                self.open_hangs.add(key)
                stuck = self.inflight.ranks()
                deadlock = key == cycle_key
                out.append(
                    hang_finding(self.job, calls, key, self.rank_node, stuck, deadlock=deadlock)
                )
        for key in sorted(self.open_hangs - set(by_key)):
            self.open_hangs.discard(key)
            self._hang_calls.pop(key, None)
            kind = FindingKind.COMM_HANG if key.startswith("comm_hang:") else FindingKind.HANG
            out.append(
                Finding(
                    kind=kind,
                    job=self.job,
                    severity="critical",
                    summary=f"job {self.job}: the stuck collectives moved on",
                    key=key,
                    resolved=True,
                )
            )
        return out

    def _expired_inflight(self, now_s: float) -> list[tuple[int, str]]:
        """In-flight records to drop: not refreshed for ``inflight_ttl_s``, unless they are
        part of an open hang whose call another rank still reports stuck.

        A waiting rank's agent may go quiet (its node lost, its reports delayed) while the
        hang goes on; its silence is not progress. Dropping its record would turn it from
        *entered* into *absent*, and the hang into a new incident blaming the waiting rank.
        Such a record is held for as long as some other rank keeps the call alive; when
        nobody refreshes the call any longer, the job is gone or moving, and it expires.
        """
        ttl = self.cfg.inflight_ttl_s
        stale = [k for k, v in self.inflight.items() if now_s - v.received_s > ttl]
        if not stale or not self._hang_calls:
            return stale
        held = set().union(*self._hang_calls.values())
        alive = {
            (v.record.group, v.record.seq)
            for v in self.inflight.values()
            if now_s - v.received_s <= ttl
        }
        return [
            k
            for k in stale
            if (call := (self.inflight[k].record.group, self.inflight[k].record.seq)) not in held
            or call not in alive
        ]


class JobTrackers:
    """All jobs' trackers; the one object ingest and the periodic tick talk to."""

    def __init__(self, cfg: C4DConfig | None = None) -> None:
        self.cfg = cfg or C4DConfig()
        self.jobs: dict[str, JobTracker] = {}

    def tracker(self, job: str) -> JobTracker:
        t = self.jobs.get(job)
        if t is None:
            t = self.jobs[job] = JobTracker(job=job, cfg=self.cfg)
        return t

    def observe(self, node: str, records: JobRecords, now_s: float) -> None:
        # Rank events first: a restarted rank's "started" precedes its new steps in the
        # same batch, and must reset the job before they are counted.
        for ev in records.rank_events:
            self.tracker(ev.job).observe_rank_event(node, ev, now_s)
        for s in records.steps:
            self.tracker(s.job).observe_step(node, s, now_s)
        for rec in records.inflight:
            self.tracker(rec.job).observe_inflight(node, rec, now_s)
        for res in records.probes:
            self.tracker(res.job).observe_probe(res)

    def evaluate(self, now_s: float) -> list[Finding]:
        out: list[Finding] = []
        for tracker in list(self.jobs.values()):
            try:
                out.extend(tracker.evaluate(now_s))
            except Exception:  # one job's bad data must not blind the others
                log.exception("job detector failed for job %s", tracker.job)
        return out

    def forget(self, job: str) -> None:
        self.jobs.pop(job, None)
