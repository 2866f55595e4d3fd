"""Job detectors in the controller loop: C4D trackers fed by ingest, findings to incidents.

:mod:`controller.logic.detection.c4d` is pure; this module is its adapter. Every stored report's
job records go to the trackers; each tick turns findings into incidents (one open incident
per finding key) and, when a finding asks for it, starts a link-probe round: a
``job_link_probe`` command to every node hosting the job, all naming the same future step.
Each node's command has its own id, which the ranks echo as ``probe_id``; the adapter maps
those ids back to the round and localizes once every probed pair answered or the round's
deadline passed.

A communication hang cannot be probed in place: every rank is blocked inside the stuck
call and never reaches a future step. Its probe is deferred to the job's next run (the
restart the remediation policy orders, or an operator's): once the restarted job has
stepped on every rank, the round probes the ring of its ranks, so a link that is still
slow, or slow from the first step (which the ``comm_slow`` detector, comparing against the
job's own past, cannot see), is named.

A finding is emitted by the trackers once (a crash is never seen again), so one whose
incident write fails is not lost: it is held and tried again at later ticks, with backoff,
in the order its condition's readings came (a later reading of a held condition waits
behind it), for at most ``HELD_FINDING_TTL_S`` and ``MAX_HELD_FINDINGS`` findings; counted
in ``trainguard_job_findings_held_total{outcome}`` (issue 14).
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controller.errors import ControllerError
from controller.logic.detection.c4d import C4DConfig, Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.hang import ring_pairs
from controller.logic.detection.c4d.job_evidence import (
    CommSlowEvidence,
    GpuCauseFacts,
    NonfiniteEvidence,
    SlowLinkEvidence,
    StragglerIncidentEvidence,
)
from controller.logic.detection.cause import POLICY_FACT, OwnCap, straggler_cause
from controller.logic.detection.incident_evidence import HwEvidence
from controller.logic.detection.nic_evidence import (
    InvolvedRank,
    NicEvidence,
    NicIssue,
    NicPort,
    nic_evidence,
)
from controller.logic.incident_kinds import IncidentKind
from controller.services.commands import CommandService
from controller.services.detection.probe_rounds import (
    DEFERRED_PROBE_TTL_S,
    MAX_PROBE_ROUNDS,
    MIN_LEAD_STEPS,
    PROBE_DEADLINE_S,
    PROBE_LEAD_S,
    DeferredProbe,
    ProbeRound,
)
from controller.services.incidents import IncidentService, IncidentSpec
from controller.services.metrics import SafeCollector
from controller.state import ClusterState
from trainguard import wire

log = logging.getLogger(__name__)

#: A finding whose incident write failed is tried again for this long after it failed first
#: (then dropped and logged: the database has been away for minutes, an alert of its own) ...
HELD_FINDING_TTL_S = 600.0
#: ... with at most this many held at once (more are dropped at once, and counted) ...
MAX_HELD_FINDINGS = 256
#: ... each waiting twice as long as before between tries, up to this.
HELD_FINDING_MAX_BACKOFF_S = 30.0


@dataclass(slots=True)
class HeldFinding:
    """A finding whose incident write failed, waiting for its next try."""

    finding: Finding
    first_failed_unix_s: float
    attempts: int = 0
    next_try_unix_s: float = 0.0


class JobDetector:
    """``ReportObserver`` + ``Ticker`` running the C4D trackers for every job."""

    def __init__(
        self,
        state: ClusterState,
        incidents: IncidentService,
        commands: CommandService,
        *,
        config: C4DConfig | None = None,
        tick_interval_s: float = 1.0,
        probe_lead_s: float = PROBE_LEAD_S,
    ) -> None:
        self.trackers = JobTrackers(config)
        self.probe_lead_s = probe_lead_s
        self._state = state
        self._incidents = incidents
        self._commands = commands
        self.tick_interval_s = tick_interval_s
        self.rounds: dict[str, ProbeRound] = {}
        self.deferred: dict[str, DeferredProbe] = {}
        self._round_of_command: dict[str, str] = {}
        #: Each job node's RDMA ports as its agent last described them (GPU-to-NIC affinity).
        self.nic_inventory: dict[str, list[wire.NicInfo]] = {}
        #: Findings not recorded yet, by finding key, oldest reading first.
        self.held: dict[str, deque[HeldFinding]] = {}
        #: Findings held (a write failed), recorded at a later try, dropped (given up).
        self.held_counts: dict[str, int] = {"held": 0, "recorded": 0, "dropped": 0}
        #: The power limit trainguard's power policy applies to (node, GPU), when the power
        #: loop is wired in: a straggler at that limit is our cap, not a hardware cause.
        self.own_caps: Callable[[str, int], OwnCap | None] | None = None
        # A job dropped from memory loses its windows too; a returning one starts afresh.
        state.job_forgotten.append(self.trackers.forget)

    @property
    def waiting(self) -> int:
        """Findings held now: every queue of ``held`` together (at most
        ``MAX_HELD_FINDINGS``, so counting them is cheap and never drifts)."""
        return sum(len(queue) for queue in self.held.values())

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        if report.node.nics:  # kept by reference: the identity is rebuilt only when it changes
            self.nic_inventory[report.node.name] = report.node.nics
        records = report.job
        if records.is_empty():
            return
        if records.probes:  # rare: rewrite command ids to round ids (a copy, off the hot path)
            probes = []
            for res in records.probes:
                round_id = self._round_of_command.get(res.probe_id)
                if round_id is None:
                    continue  # a probe this controller did not start (or from before a restart)
                probe_round = self.rounds[round_id]
                pair = (res.src_rank, res.dst_rank)
                if not self._asked(probe_round, pair, report.node.name):
                    continue  # a pair the round did not ask, or a rank not on this node
                probe_round.seen_pairs.add(pair)
                if res.missed:  # never ran: says nothing about the link
                    probe_round.missed_pairs.add(pair)
                    continue
                probes.append(res.model_copy(update={"probe_id": round_id}))
            records = records.model_copy(update={"probes": probes})
        self.trackers.observe(report.node.name, records, received_unix_s)

    def _asked(self, probe_round: ProbeRound, pair: tuple[int, int], node: str) -> bool:
        """A probe answer counts only for a pair its round asked, from the node that runs
        its source rank (when known): an agent's report is what it says, and a result for
        another pair or another node's rank would put a link the round never measured in
        a ``slow_link`` incident."""
        if pair not in probe_round.asked:
            return False
        job = self.trackers.jobs.get(probe_round.job)
        runs_on = None if job is None else job.rank_node.get(pair[0])
        return runs_on is None or runs_on == node

    async def tick(self, now_unix_s: float) -> None:
        await self._retry_held(now_unix_s)
        for finding in self.trackers.evaluate(now_unix_s):
            await self._record(finding, now_unix_s)
        for probe_round in list(self.rounds.values()):
            done = probe_round.seen_pairs >= set(probe_round.pairs)
            if done or now_unix_s > probe_round.deadline_unix_s:
                await self._finish_round(probe_round, now_unix_s)
        for deferred in list(self.deferred.values()):
            await self._maybe_start_deferred(deferred, now_unix_s)

    # ------------------------------------------------------------------ findings held back

    async def _record(self, finding: Finding, now_unix_s: float) -> None:
        """Turn ``finding`` into its incident; hold it for a later tick if the write fails."""
        held = HeldFinding(finding, first_failed_unix_s=now_unix_s)
        queue = self.held.get(finding.key)
        if not queue:  # else an earlier reading of the condition waits: keep the order
            if await self._try(held, now_unix_s):
                return
            queue = self.held.setdefault(finding.key, deque())
        if self._room():
            queue.append(held)
            self.held_counts["held"] += 1
            fields = {"finding": finding.key, "attempts": held.attempts}
            log.warning("job finding held: incident not recorded", extra={"fields": fields})
        elif not queue:
            del self.held[finding.key]

    async def _retry_held(self, now_unix_s: float) -> None:
        for key in list(self.held):
            queue = self.held[key]
            # Each stays in its queue (and is counted waiting) until recorded or dropped.
            while queue and queue[0].next_try_unix_s <= now_unix_s:
                if not await self._try(queue[0], now_unix_s, retry=True):
                    break  # the rest waits behind it
                queue.popleft()
            if not queue:
                del self.held[key]

    async def _try(self, held: HeldFinding, now_unix_s: float, *, retry: bool = False) -> bool:
        """One try at ``held``'s incident: ``True`` when done with it (recorded, or given up
        after ``HELD_FINDING_TTL_S``), ``False`` when it is to wait for its next try."""
        finding = held.finding
        try:
            await self._apply(finding, now_unix_s)
        except Exception as exc:
            held.attempts += 1
            fields = {"finding": finding.key, "attempts": held.attempts, "error": str(exc)[:300]}
            if not isinstance(exc, ControllerError):  # a bug, not the database: say so
                log.exception("job finding not recorded", extra={"fields": fields})
            if now_unix_s - held.first_failed_unix_s > HELD_FINDING_TTL_S:
                self.held_counts["dropped"] += 1
                log.error("job finding dropped: not recorded in time", extra={"fields": fields})
                return True
            backoff = min(
                self.tick_interval_s * 2 ** (held.attempts - 1), HELD_FINDING_MAX_BACKOFF_S
            )
            held.next_try_unix_s = now_unix_s + backoff
            return False
        if retry:
            self.held_counts["recorded"] += 1
        return True

    def _room(self) -> bool:
        """Whether one more finding may be held; counts and logs the drop when not."""
        if self.waiting < MAX_HELD_FINDINGS:
            return True
        self.held_counts["dropped"] += 1
        log.error(
            "job finding dropped: too many held", extra={"fields": {"held": MAX_HELD_FINDINGS}}
        )
        return False

    async def _apply(self, finding: Finding, now_unix_s: float) -> None:
        if finding.resolved:
            incident = self._incidents.find_open(finding.key)
            if incident is not None:
                await self._incidents.resolve(incident, note=finding.summary)
            return
        summary = finding.summary
        evidence = finding.evidence.model_copy(update={"nodes": list(finding.nodes)})
        if isinstance(evidence, StragglerIncidentEvidence):
            causes, facts = self._gpu_cause(finding)
            evidence.gpu = GpuCauseFacts.model_validate(facts)
            evidence.causes = causes
            if causes:
                summary += "; likely cause: " + ", ".join(causes)
            if facts.get(POLICY_FACT):  # alerted (it costs the job time), not hardware
                summary += f"; slowed by trainguard's own power cap: {facts[POLICY_FACT]}"
        if isinstance(evidence, CommSlowEvidence | SlowLinkEvidence):
            nic = self.nic_evidence(finding, now_unix_s)
            evidence.nic = nic
            if nic.suspects:
                summary += "; " + nic.headline()
        # The kinds whose evidence names one GPU (a single-rank finding's own).
        gpu_index = (
            evidence.gpu_index
            if isinstance(evidence, NonfiniteEvidence | StragglerIncidentEvidence)
            and len(finding.ranks) == 1
            else None
        )
        spec = IncidentSpec(
            kind=IncidentKind(finding.kind),
            severity=finding.severity,
            summary=summary,
            dedupe_key=finding.key,
            node=finding.nodes[0] if len(finding.nodes) == 1 else None,
            gpu_index=gpu_index,
            job=finding.job,
            ranks=list(finding.ranks),
            evidence=evidence,
        )
        if finding.refresh:
            await self._incidents.open_or_bump(spec, count=0, refresh=True)
            return
        _, opened = await self._incidents.open_or_bump(spec)
        if not (opened and finding.probe_pairs):
            return
        if finding.kind is FindingKind.COMM_HANG:
            tracker = self.trackers.jobs.get(finding.job)
            if tracker is not None:  # a hung job never reaches a future step: next run
                self.deferred[finding.job] = DeferredProbe(
                    job=finding.job,
                    hang_key=finding.key,
                    hang_summary=finding.summary,
                    incarnation=tracker.incarnation,
                    expires_unix_s=now_unix_s + DEFERRED_PROBE_TTL_S,
                )
                log.info(
                    "link probe deferred to the job's next run",
                    extra={"fields": {"job": finding.job, "incident": finding.key}},
                )
            return
        await self._start_round(
            finding.job,
            finding.probe_pairs,
            f"localize: {finding.summary}",
            now_unix_s,
            source=finding.key,
        )

    async def _maybe_start_deferred(self, deferred: DeferredProbe, now_unix_s: float) -> None:
        tracker = self.trackers.jobs.get(deferred.job)
        if tracker is None or now_unix_s > deferred.expires_unix_s:
            del self.deferred[deferred.job]
            return
        ranks = tuple(sorted(tracker.rank_node))
        restarted_and_stepping = (
            tracker.incarnation > deferred.incarnation
            and tracker.world_size > 1
            and ranks == tuple(range(tracker.world_size))
            and tracker.stragglers.last is not None  # a step compared: its time is known
        )
        if not restarted_and_stepping:
            return
        del self.deferred[deferred.job]
        # The restarted job may run on other nodes or fewer ranks: probe it as it runs now.
        reason = f"localize after the communication hang ({deferred.hang_summary})"
        await self._start_round(
            deferred.job, ring_pairs(ranks), reason, now_unix_s, after=deferred.hang_key
        )

    def _gpu_cause(self, finding: Finding) -> tuple[list[str], dict[str, Any]]:
        tracker = self.trackers.jobs.get(finding.job)
        if tracker is None or not finding.ranks:
            return [], {}
        rank = finding.ranks[0]
        # The GPUs of the ranks it was compared with (its peer group); all of the job's
        # when the evidence has none (a finding from before the peer groups).
        ev = finding.evidence
        members = ev.peer_group.ranks if isinstance(ev, StragglerIncidentEvidence) else None
        compared = [r for r in (members or tracker.rank_node) if r in tracker.rank_node]
        peers = [
            sample
            for r in compared
            if r != rank and (sample := self._sample(tracker.rank_node[r], tracker.rank_gpu.get(r)))
        ]
        node, gpu = tracker.rank_node.get(rank), tracker.rank_gpu.get(rank)
        own = (
            self.own_caps(node, gpu)
            if self.own_caps is not None and node is not None and gpu is not None
            else None
        )
        return straggler_cause(self._sample(node, gpu), peers, own)

    def nic_evidence(self, finding: Finding, now_unix_s: float) -> NicEvidence:
        """NICs with recent errors or flaps on the finding's nodes, the involved GPUs'
        nearest NIC first (``controller.logic.detection.nic_evidence``)."""
        tracker = self.trackers.jobs.get(finding.job)
        rank_node = tracker.rank_node if tracker is not None else {}
        rank_gpu = tracker.rank_gpu if tracker is not None else {}
        involved = [
            InvolvedRank(rank=r, node=rank_node[r], gpu_index=rank_gpu.get(r))
            for r in finding.ranks
            if r in rank_node
        ]
        known = {i.node for i in involved}
        involved += [
            InvolvedRank(rank=-1, node=n, gpu_index=None) for n in finding.nodes if n not in known
        ]
        issues = [
            NicIssue(
                node=inc.node,
                device=ev.device,
                signal=ev.signal,
                count=inc.count,
                last_unix_s=inc.updated_unix_s,
                detail=inc.summary,
            )
            for inc in self._state.incidents.values()
            if inc.kind in ("hw_degraded", "nic_errors")
            and inc.node is not None
            and isinstance(ev := inc.evidence, HwEvidence)
            and ev.device
        ]
        nodes = {i.node for i in involved}
        inventory = {node: self.nic_ports(node) for node in self.nic_inventory if node in nodes}
        return nic_evidence(issues, inventory, involved, now_unix_s)

    def nic_ports(self, node: str) -> list[NicPort]:
        """The RDMA ports ``node``'s agent last reported (empty: none, or never reported)."""
        return [
            NicPort(
                device=n.device,
                port=n.port,
                pci_bus_id=n.pci_bus_id,
                gpu_affinity=dict(n.gpu_affinity),
            )
            for n in self.nic_inventory.get(node, [])
        ]

    def _sample(self, node: str | None, gpu_index: int | None) -> wire.GpuSample | None:
        node_state = self._state.nodes.get(node) if node else None
        if node_state is None or gpu_index is None:
            return None
        gpu = node_state.gpus.get(gpu_index)
        return gpu.latest if gpu else None

    async def _start_round(
        self,
        job: str,
        pairs: tuple[tuple[int, int], ...],
        reason: str,
        now_unix_s: float,
        *,
        after: str | None = None,
        source: str | None = None,
        attempt: int = 1,
        lead_s: float | None = None,
    ) -> None:
        tracker = self.trackers.jobs.get(job)
        if tracker is None:
            return
        lead_s = self.probe_lead_s if lead_s is None else lead_s
        step_s = tracker.stragglers.last.median_step_s if tracker.stragglers.last else 1.0
        lead = max(MIN_LEAD_STEPS, math.ceil(lead_s / max(step_s, 1e-3)))
        at_step = tracker.newest_step + lead
        probe_round = ProbeRound(
            job=job,
            round_id=uuid.uuid4().hex[:16],
            at_step=at_step,
            pairs=pairs,
            deadline_unix_s=now_unix_s + lead * step_s + PROBE_DEADLINE_S,
            after=after,
            reason=reason,
            source=source,
            attempt=attempt,
            lead_s=lead_s,
        )
        for node in sorted(set(tracker.rank_node.values())):
            request = wire.JobLinkProbe(
                id="assigned-by-server", job=job, at_step=at_step, pairs=list(pairs), reason=reason
            )
            try:
                command = await self._commands.create(node, request, by="detector:c4d")
            except Exception:
                log.exception("could not queue link probe", extra={"fields": {"node": node}})
                continue
            probe_round.command_ids.add(command.id)
            self._round_of_command[command.id] = probe_round.round_id
        if probe_round.command_ids:
            self.rounds[probe_round.round_id] = probe_round
            log.info(
                "link probe scheduled",
                extra={
                    "fields": {
                        "job": job,
                        "at_step": at_step,
                        "round": probe_round.round_id,
                        "attempt": attempt,
                    }
                },
            )

    async def _finish_round(self, probe_round: ProbeRound, now_unix_s: float) -> None:
        del self.rounds[probe_round.round_id]
        for command_id in probe_round.command_ids:
            self._round_of_command.pop(command_id, None)
        tracker = self.trackers.jobs.get(probe_round.job)
        if tracker is None:
            return
        fields = {"job": probe_round.job, "round": probe_round.round_id}
        # A rank that missed the round never joined its pairs as receiver either: its
        # partner's transfer timed out (ok=False) through no fault of the link.
        late = {src for src, _ in probe_round.missed_pairs}
        unusable = {p for p in probe_round.pairs if late & set(p)}
        results = [
            r
            for r in tracker.probes.get(probe_round.round_id, [])
            if r.ok or not late & {r.src_rank, r.dst_rank}
        ]
        tracker.probes[probe_round.round_id] = results
        if not results:
            tracker.probes.pop(probe_round.round_id, None)
            why = (
                f"{len(unusable)} of {len(probe_round.pairs)} pairs involve a rank that "
                "missed it (its command came after the step), the others did not answer"
                if unusable
                else "no results"
            )
            log.warning(
                f"link probe round told nothing: {why}",
                extra={"fields": fields},
            )
            await self._probe_again(probe_round, now_unix_s)
            return
        missing = set(probe_round.pairs) - probe_round.seen_pairs - unusable
        for src, dst in sorted(missing):
            tracker.observe_probe(
                wire.ProbeResult(
                    job=probe_round.job,
                    probe_id=probe_round.round_id,
                    src_rank=src,
                    dst_rank=dst,
                    size_bytes=0,
                    duration_s=0.0,
                    ok=False,
                    error="no result before the probe deadline",
                )
            )
        finding = tracker.finish_probe(probe_round.round_id)
        if finding is not None and probe_round.after is not None:
            finding = replace(
                finding,
                summary=f"{finding.summary} (probed after the communication hang)",
                evidence=finding.evidence.model_copy(update={"after_incident": probe_round.after}),
            )
        if finding is not None:
            await self._record(finding, now_unix_s)
        elif probe_round.after is not None and probe_round.attempt >= MAX_PROBE_ROUNDS:
            log.warning(
                "the probes after the communication hang found every link healthy; the hang "
                "was transient or is outside the probed paths",
                extra={
                    "fields": {
                        "job": probe_round.job,
                        "incident": probe_round.after,
                        "rounds": probe_round.attempt,
                    }
                },
            )
        else:
            # After a hang too: one round on a loaded host can miss the slow link (seen
            # in the e2e under make test's load: the round after the restart found every
            # link healthy, and no later round looked again).
            log.info("link probe found every probed link healthy", extra={"fields": fields})
            await self._probe_again(probe_round, now_unix_s)

    async def _probe_again(self, probe_round: ProbeRound, now_unix_s: float) -> None:
        """Run ``probe_round`` once more, with twice the lead, if it told nothing or found
        every link healthy while the incident that asked for it is still open, or after a
        communication hang (a loaded host can hide a slow link from one round), up to
        ``MAX_PROBE_ROUNDS`` rounds."""
        if probe_round.attempt >= MAX_PROBE_ROUNDS:
            log.warning(
                "link probe rounds exhausted: the slow communication stays unlocalized",
                extra={"fields": {"job": probe_round.job, "rounds": probe_round.attempt}},
            )
            return
        source = probe_round.source
        if source is not None and self._incidents.find_open(source) is None:
            return  # the condition ended: nothing left to localize
        await self._start_round(
            probe_round.job,
            probe_round.pairs,
            probe_round.reason,
            now_unix_s,
            after=probe_round.after,
            source=source,
            attempt=probe_round.attempt + 1,
            lead_s=2 * probe_round.lead_s,
        )


class JobFindingsCollector(SafeCollector):
    """``trainguard_job_findings_held_total{outcome}``: job findings not recorded at once
    (``held``: their incident write failed, or an earlier reading of their condition was
    still held), recorded at a later tick (``recorded``) or given up (``dropped``);
    ``trainguard_job_findings_waiting``: held now. ``dropped`` above zero is a lost
    finding: alert on it."""

    def __init__(self, detector: JobDetector) -> None:
        self._detector = detector

    def _collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "trainguard_job_findings_held",
            "Job findings whose incident write failed, by what became of them",
            labels=["outcome"],
        )
        for outcome, count in sorted(self._detector.held_counts.items()):
            family.add_metric([outcome], count)
        yield family
        yield GaugeMetricFamily(
            "trainguard_job_findings_waiting",
            "Job findings held for a later try of their incident write",
            value=self._detector.waiting,
        )
