"""Job shapes and noise the straggler detector must survive, simulated on a virtual clock.

A job of ``world`` ranks (``per_node`` per node) steps synchronously: each rank computes,
then everyone waits for the slowest rank plus the transfer. Layouts: pure data parallel,
pipeline stages x data-parallel replicas (the last stage computes the loss, the first may
embed), MoE experts whose token share (so compute and all-to-all bytes) is skewed, and TP
groups of different sizes. Noise: uniform jitter plus Pareto-tailed multi-x spikes on random
ranks. Faults: persistently slow ranks, ranks flapping between slow and normal, a hang whose
waiting node's agent goes quiet. Each node's agent reports on its own timer with its own
phase (and, optionally, jitter), so one step's summaries reach the controller seconds apart
and in different batches, as deployed agents' do.

The records go through the controller's real detectors (``JobTrackers``); a plain per-rank
threshold detector (:class:`ThresholdBaseline`) is fed the same steps, complete and in order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.logic.detection.c4d import C4DConfig, Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.job_evidence import StragglerIncidentEvidence
from trainguard.wire import InflightCollective, JobRecords, StepSummary

JOB = "sim"
COMM_S = 0.1


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the job's ranks are organised and what each rank's healthy work is."""

    kind: str = "dp"
    """``dp``, ``pp`` (stages x replicas, rank = stage * dp + replica), ``moe`` (experts)
    or ``tp_mixed`` (half the ranks in TP groups of 4, the rest in TP groups of 2)."""
    world: int = 16
    per_node: int = 4
    pp: int = 1
    last_stage_factor: float = 1.3
    """Healthy compute of the last pipeline stage (the loss) relative to the others."""
    first_stage_factor: float = 1.0
    moe_skew: float = 2.0
    """Token share of the most popular expert over the least popular one."""
    moe_rotate_every: int = 0
    """Re-draw which expert is popular every this many steps (0: fixed)."""
    declare_roles: bool = True
    """Summaries carry role / peer group (as collectives derive or the job declares)."""
    report_bytes: bool = True
    """Summaries carry the collective bytes each rank moved (MoE: its token share)."""

    def stage(self, rank: int) -> int:
        return rank // (self.world // self.pp)

    def role_fields(self, rank: int) -> dict[str, object]:
        if not self.declare_roles:
            return {}
        if self.kind == "pp":
            dp = self.world // self.pp
            stage = self.stage(rank)
            members = list(range(stage * dp, (stage + 1) * dp))
            return {
                "role": f"pp_stage={stage}",
                "pp_stage": stage,
                "dp_rank": rank % dp,
                "group_ranks": members,
            }
        if self.kind == "moe":
            return {"role": "expert"}
        if self.kind == "tp_mixed":
            return {"role": "tp=4" if rank < self.world // 2 else "tp=2"}
        return {}

    def base_compute(self, rank: int) -> float:
        if self.kind == "pp":
            stage = self.stage(rank)
            if stage == self.pp - 1:
                return self.last_stage_factor
            if stage == 0:
                return self.first_stage_factor
        if self.kind == "tp_mixed" and rank >= self.world // 2:
            return 1.35  # half the shards per rank: more work per rank
        return 1.0


@dataclass(frozen=True, kw_only=True)
class Noise:
    jitter: float = 0.05
    spike_p: float = 0.0
    """Chance per rank per step of a heavy-tailed spike."""
    spike_alpha: float = 1.5
    """Pareto shape of the spike factor (smaller: heavier tail)."""
    spike_max: float = 20.0


@dataclass(frozen=True, kw_only=True)
class Delivery:
    interval_s: float = 5.0
    """Each agent's report interval; its phase is drawn uniformly per node."""
    send_jitter_s: float = 0.0
    latency_s: float = 0.05


@dataclass(kw_only=True)
class SimScenario:
    name: str
    layout: Layout = field(default_factory=Layout)
    noise: Noise = field(default_factory=Noise)
    delivery: Delivery = field(default_factory=Delivery)
    steps: int = 400
    fault_step: int = 60
    slow: dict[int, float] = field(default_factory=dict)
    #: rank -> (slowdown, slow steps, normal steps): alternates from ``fault_step`` on.
    flap: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    #: (culprit rank, node whose agent goes quiet while its ranks wait in the hang)
    hang: tuple[int, int] | None = None

    @property
    def culprits(self) -> tuple[int, ...]:
        if self.hang is not None:
            return (self.hang[0],)
        return tuple(sorted(set(self.slow) | set(self.flap)))


@dataclass
class SimOutcome:
    #: (opening step, finding) for every finding that opened an incident (no refresh/resolve)
    opened: list[tuple[int, Finding]]
    #: every straggler finding, refreshes included (evidence over time)
    straggler_updates: list[Finding]
    baseline_opened: list[tuple[int, int]]
    steps: int
    #: Steps the detector compared (the rest were dropped or still waiting at the end).
    steps_compared: int = 0
    #: Replays only: virtual controller time of each opening (parallel to ``opened``) and
    #: the end time of each step, so detection can be told in seconds as well as steps.
    opened_s: list[float] = field(default_factory=list)
    step_end_s: dict[int, float] = field(default_factory=dict)
    #: Newest step the detector had compared when each finding opened (parallel to
    #: ``opened``): how many steps of data it needed, apart from their delivery.
    opened_data_step: list[int] = field(default_factory=list)

    def stragglers(self) -> list[tuple[int, int]]:
        """(step the job was at when the incident opened, rank) per straggler incident."""
        return [(step, f.ranks[0]) for step, f in self.opened if f.kind is FindingKind.STRAGGLER]

    def straggler_data_steps(self) -> list[tuple[int, int]]:
        """(step whose data completed the verdict, rank) per straggler incident: the
        detector's own latency in steps, without the summaries' delivery."""
        return [
            (data, f.ranks[0])
            for (_, f), data in zip(self.opened, self.opened_data_step, strict=True)
            if f.kind is FindingKind.STRAGGLER
        ]


class ThresholdBaseline:
    """The plain detector many teams start with: a rank whose step compute exceeds the
    job's median by ``threshold`` for ``confirm`` consecutive steps is a straggler, until it
    is under it for as many steps. No peers, no windows, no byte normalization."""

    def __init__(self, threshold: float = 0.2, confirm: int = 3) -> None:
        self.threshold = threshold
        self.confirm = confirm
        self.streak: dict[int, int] = {}
        self.calm: dict[int, int] = {}
        self.open: set[int] = set()

    def add(self, compute: dict[int, float]) -> list[int]:
        values = sorted(compute.values())
        med = values[len(values) // 2]
        opened = []
        for rank, c in compute.items():
            slow = c > (1 + self.threshold) * med
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            self.calm[rank] = 0 if slow else self.calm.get(rank, 0) + 1
            if rank not in self.open and self.streak[rank] >= self.confirm:
                self.open.add(rank)
                opened.append(rank)
            elif rank in self.open and self.calm[rank] >= self.confirm:
                self.open.discard(rank)
        return opened


def _node(rank: int, per_node: int) -> str:
    return f"node-{rank // per_node}"


def _moe_popularity(world: int, skew: float, rng: random.Random) -> list[float]:
    shares = [1 + (skew - 1) * i / max(1, world - 1) for i in range(world)]
    rng.shuffle(shares)
    return shares


def run_sim(sc: SimScenario, seed: int, cfg: C4DConfig | None = None) -> SimOutcome:
    rng = random.Random(seed)
    lay, noise, dl = sc.layout, sc.noise, sc.delivery
    trackers = JobTrackers(cfg or C4DConfig())
    baseline = ThresholdBaseline()
    nodes = sorted({_node(r, lay.per_node) for r in range(lay.world)})
    phase = {n: rng.uniform(0, dl.interval_s) for n in nodes}
    next_send = dict(phase)
    buffers: dict[str, list[StepSummary]] = {n: [] for n in nodes}
    opened: list[tuple[int, Finding]] = []
    data_step: list[int] = []
    updates: list[Finding] = []
    base_opened: list[tuple[int, int]] = []
    roles = {r: lay.role_fields(r) for r in range(lay.world)}
    popularity = _moe_popularity(lay.world, lay.moe_skew, rng)
    quiet: set[str] = set()
    t, next_tick, step = 0.0, 1.0, 0

    def advance(until: float) -> None:
        nonlocal next_tick
        while next_tick <= until:
            for n in nodes:
                while next_send[n] <= next_tick:
                    if buffers[n] and n not in quiet:
                        trackers.observe(n, JobRecords(steps=buffers[n]), next_tick)
                        buffers[n] = []
                    next_send[n] += dl.interval_s + rng.uniform(-dl.send_jitter_s, dl.send_jitter_s)
            for f in trackers.evaluate(next_tick):
                if f.kind is FindingKind.STRAGGLER and not f.resolved:
                    updates.append(f)
                if not (f.resolved or f.refresh):
                    opened.append((step, f))
                    data_step.append(_data_step(f, trackers))
            next_tick += 1.0

    while step < sc.steps:
        faulty = step >= sc.fault_step
        if faulty and sc.hang is not None:
            _hang(sc, trackers, t, step, quiet, advance, opened)
            break
        if lay.kind == "moe" and lay.moe_rotate_every and step % lay.moe_rotate_every == 0:
            popularity = _moe_popularity(lay.world, lay.moe_skew, rng)
        load = [p * (1 + rng.uniform(-0.1, 0.1)) for p in popularity]
        mean_load = sum(load) / len(load)
        compute: dict[int, float] = {}
        nbytes: dict[int, int] = {}
        for r in range(lay.world):
            c = lay.base_compute(r)
            if lay.kind == "moe":
                share = load[r] / mean_load
                c = 0.4 + 0.6 * share  # attention alike on every rank, experts by tokens
                nbytes[r] = int(64e6 * share) if lay.report_bytes else 0
            c *= 1 + rng.uniform(-noise.jitter, noise.jitter)
            if noise.spike_p and rng.random() < noise.spike_p:
                c *= min(rng.paretovariate(noise.spike_alpha) * 1.5, noise.spike_max)
            if faulty:
                c *= 1 + sc.slow.get(r, 0.0)
                if r in sc.flap:
                    slowdown, slow_n, normal_n = sc.flap[r]
                    if (step - sc.fault_step) % (slow_n + normal_n) < slow_n:
                        c *= 1 + slowdown
            compute[r] = c
        comm = COMM_S * (1 + rng.uniform(-noise.jitter, noise.jitter))
        slowest = max(compute.values())
        end = t + slowest + comm
        for r, c in compute.items():
            buffers[_node(r, lay.per_node)].append(
                StepSummary(
                    job=JOB,
                    rank=r,
                    world_size=lay.world,
                    step=step,
                    step_time_s=slowest + comm,
                    compute_time_s=c,
                    collective_wait_s=slowest - c + comm,
                    collective_bytes=nbytes.get(r, 0),
                    gpu_index=r % lay.per_node,
                    **roles[r],
                )
            )
        base_opened += [(step, r) for r in baseline.add(compute)]
        t = end
        step += 1
        advance(t)
    advance(t + 3 * dl.interval_s)
    tracker = trackers.jobs.get(JOB)
    compared = tracker.stragglers.steps_seen if tracker else 0
    return SimOutcome(opened, updates, base_opened, step, compared, opened_data_step=data_step)


def _data_step(f: Finding, trackers: JobTrackers) -> int:
    """The step whose data completed the finding: a straggler's evidence says (``at_step``;
    one evaluation may compare a whole report's worth of steps); otherwise the newest step
    the detectors compared so far (-1: none)."""
    ev = f.evidence
    if isinstance(ev, StragglerIncidentEvidence) and ev.at_step is not None:
        return ev.at_step
    return max((t.last_compared_step for t in trackers.jobs.values()), default=-1)


def _hang(
    sc: SimScenario,
    trackers: JobTrackers,
    t: float,
    step: int,
    quiet: set[str],
    advance: Callable[[float], None],
    opened: list[tuple[int, Finding]],
) -> None:
    """Every rank but the culprit enters all_reduce and waits; their watchdogs re-report it
    every second. Twenty seconds in, the agent of node ``quiet_node`` goes silent."""
    culprit, quiet_node = sc.hang or (0, 0)
    lay = sc.layout
    seq = (step + 1) * 4
    since = t + 1.0
    now = since + 2.0
    while now < since + 90:
        if now >= since + 20:
            quiet.add(_node(quiet_node * lay.per_node, lay.per_node))
        for r in range(lay.world):
            node = _node(r, lay.per_node)
            if r == culprit or node in quiet:
                continue
            rec = InflightCollective(
                job=JOB,
                rank=r,
                group="world",
                op="all_reduce",
                seq=seq,
                elapsed_s=now - since,
                group_ranks=list(range(lay.world)),
                last_completed_seq={"world": seq - 1},
                step=step,
            )
            trackers.observe(node, JobRecords(inflight=[rec]), now + 0.3)
        advance(now + 1.0)
        now += 1.0


def replay(
    steps: list[list[StepSummary]],
    per_node: int,
    delivery: Delivery,
    seed: int,
    cfg: C4DConfig | None = None,
) -> SimOutcome:
    """Feed recorded step summaries (from a real run) to the detectors as agents on
    independent report phases would deliver them, on a virtual clock that advances by each
    step's measured duration; the threshold baseline sees the same steps in order."""
    rng = random.Random(seed)
    trackers = JobTrackers(cfg or C4DConfig())
    baseline = ThresholdBaseline()
    world = max((s.world_size for rows in steps for s in rows), default=1)
    nodes = sorted({_node(r, per_node) for r in range(world)})
    next_send = {n: rng.uniform(0, delivery.interval_s) for n in nodes}
    buffers: dict[str, list[StepSummary]] = {n: [] for n in nodes}
    opened: list[tuple[int, Finding]] = []
    opened_s: list[float] = []
    data_step: list[int] = []
    step_end_s: dict[int, float] = {}
    updates: list[Finding] = []
    base_opened: list[tuple[int, int]] = []
    t, next_tick = 0.0, 1.0

    def advance(until: float, index: int) -> None:
        nonlocal next_tick
        while next_tick <= until:
            for n in nodes:
                while next_send[n] <= next_tick:
                    if buffers[n]:
                        trackers.observe(n, JobRecords(steps=buffers[n]), next_tick)
                        buffers[n] = []
                    next_send[n] += delivery.interval_s + rng.uniform(
                        -delivery.send_jitter_s, delivery.send_jitter_s
                    )
            for f in trackers.evaluate(next_tick):
                if f.kind is FindingKind.STRAGGLER and not f.resolved:
                    updates.append(f)
                if not (f.resolved or f.refresh):
                    opened.append((index, f))
                    opened_s.append(next_tick)
                    data_step.append(_data_step(f, trackers))
            next_tick += 1.0

    for index, rows in enumerate(steps):
        for s in rows:
            buffers[_node(s.rank, per_node)].append(s)
        base_opened += [
            (rows[0].step, r) for r in baseline.add({s.rank: s.compute_time_s for s in rows})
        ]
        t += max(s.step_time_s for s in rows)
        step_end_s[rows[0].step] = t
        advance(t, index)
    advance(t + 3 * delivery.interval_s, len(steps) - 1)
    tracker = trackers.jobs.get(steps[0][0].job) if steps and steps[0] else None
    compared = tracker.stragglers.steps_seen if tracker else 0
    # ``opened`` carries the index of the step being fed; report the ranks' step numbers.
    first = steps[0][0].step if steps and steps[0] else 0
    opened = [(first + i, f) for i, f in opened]
    return SimOutcome(
        opened, updates, base_opened, len(steps), compared, opened_s, step_end_s, data_step
    )


@dataclass(frozen=True, kw_only=True)
class AgentCadence:
    """The agents' report settings a deployed replay runs with (their defaults unless
    told otherwise; ``agents.settings``), and the controller's tick."""

    report_interval_s: float = 5.0
    job_flush_steps: int = 8
    job_flush_min_interval_s: float = 1.0
    latency_s: float = 0.05
    tick_s: float = 1.0

    @classmethod
    def defaults(cls) -> AgentCadence:
        """The agent's and controller's shipped defaults, read from their settings."""
        from agents.settings import AgentSettings

        fields = AgentSettings.model_fields
        return cls(
            report_interval_s=float(fields["report_interval_s"].default),
            job_flush_steps=int(fields["job_flush_steps"].default),
            job_flush_min_interval_s=float(fields["job_flush_min_interval_s"].default),
        )


def agent_sends(
    arrivals: list[tuple[float, StepSummary]],
    cadence: AgentCadence,
    phase_s: float,
    sealed: list[float] | None = None,
) -> list[tuple[float, list[StepSummary]]]:
    """When one node's agent seals its reports, and what each carries: the agent's own
    rule (``agents.cadence.ReportCadence``, the code its main loop runs) applied to the
    times the summaries reached it. The agent started ``phase_s`` into its first interval,
    so nodes' timers have independent phases as deployed ones do. ``sealed`` receives the
    time of every report sealed, those without step summaries (samples only) too."""
    from agents.cadence import ReportCadence

    rule = ReportCadence(
        report_interval_s=cadence.report_interval_s,
        job_flush_steps=cadence.job_flush_steps,
        job_flush_min_interval_s=cadence.job_flush_min_interval_s,
        last_report_s=phase_s - cadence.report_interval_s,
    )
    sends: list[tuple[float, list[StepSummary]]] = []
    pending: list[StepSummary] = []
    now, i = 0.0, 0
    while i < len(arrivals) or pending:
        due = max(rule.due_s(), now)  # the loop notices a due report no sooner than now
        if i < len(arrivals) and arrivals[i][0] < due:
            now, s = arrivals[i]
            pending.append(s)
            rule.add(JobRecords(steps=[s]))
            i += 1
            continue
        now = due
        if pending:
            sends.append((now, pending))
            pending = []
        if sealed is not None:
            sealed.append(now)
        rule.reported(now)
    return sends


#: The ranks ship their summaries to the agent every 0.15 s (collectives' default), so a
#: step ended at most this long before its summary's recorded arrival.
SHIP_INTERVAL_S = 0.15


def node_arrivals(
    steps: list[list[StepSummary]], arrived_s: dict[tuple[int, int], float], per_node: int
) -> dict[str, list[tuple[float, StepSummary]]]:
    """A recorded run's summaries per node's agent (``per_node`` ranks to a node), by name,
    each node's with its recorded arrival time, in order of arrival."""
    nodes: dict[str, list[tuple[float, StepSummary]]] = {}
    for rows in steps:
        for s in rows:
            nodes.setdefault(_node(s.rank, per_node), []).append((arrived_s[(s.step, s.rank)], s))
    return {name: sorted(nodes[name], key=lambda a: a[0]) for name in sorted(nodes)}


def replay_deployed(
    steps: list[list[StepSummary]],
    arrived_s: dict[tuple[int, int], float],
    per_node: int,
    cadence: AgentCadence,
    seed: int,
    cfg: C4DConfig | None = None,
) -> SimOutcome:
    """A recorded real run delivered as deployed agents and controller would: each
    summary leaves its node's agent in the report the agent's cadence rule seals after the
    summary reached it (measured arrival times), each agent on its own phase; the
    controller observes a report on arrival and evaluates on its own 1 s tick.

    ``opened`` carries the job's step when each incident opened: the newest step any of
    whose summaries had reached an agent by then plus ``SHIP_INTERVAL_S`` (so it never
    understates how far the job had got)."""
    rng = random.Random(seed)
    trackers = JobTrackers(cfg or C4DConfig())
    events: list[tuple[float, int, list[StepSummary], str]] = []
    for name, arrivals in node_arrivals(steps, arrived_s, per_node).items():
        phase = rng.uniform(0, cadence.report_interval_s)
        events += [
            (t + cadence.latency_s, 0, batch, name)
            for t, batch in agent_sends(arrivals, cadence, phase)
        ]
    end = max(t for t, *_ in events) if events else 0.0
    tick = rng.uniform(0, cadence.tick_s)
    while tick <= end + 3 * cadence.tick_s:
        events.append((tick, 1, [], ""))
        tick += cadence.tick_s
    events.sort(key=lambda e: (e[0], e[1]))
    first_seen = sorted(
        (min(arrived_s[(rows[0].step, s.rank)] for s in rows), rows[0].step) for rows in steps
    )
    opened: list[tuple[int, Finding]] = []
    opened_s: list[float] = []
    data_step: list[int] = []
    updates: list[Finding] = []
    for t, kind, batch, name in events:
        if kind == 0:
            trackers.observe(name, JobRecords(steps=batch), t)
            continue
        for f in trackers.evaluate(t):
            if f.kind is FindingKind.STRAGGLER and not f.resolved:
                updates.append(f)
            if not (f.resolved or f.refresh):
                reached = [st for seen, st in first_seen if seen <= t + SHIP_INTERVAL_S]
                opened.append((max(reached, default=-1), f))
                opened_s.append(t)
                data_step.append(_data_step(f, trackers))
    step_end_s = {st: seen for seen, st in first_seen}
    tracker = trackers.jobs.get(steps[0][0].job) if steps and steps[0] else None
    compared = tracker.stragglers.steps_seen if tracker else 0
    return SimOutcome(opened, updates, [], len(steps), compared, opened_s, step_end_s, data_step)
