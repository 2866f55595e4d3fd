"""The power policy in the controller: readings in, commands out, every cap an Action.

``PowerLoop`` is a :class:`~controller.services.detection.ReportObserver` (it keeps each node's
inventory and its latest power) and a :class:`~controller.services.detection.Ticker` (it runs the
policy). A report also starts a tick at once, so a cap goes out with the reporting node's
next reply instead of waiting for the timer; the timer still ticks when reports stop, which
is how stale telemetry is noticed.

Each tick: readings and GPU statuses from the cache, acknowledgements from the commands'
final statuses (the ingest path already applied the agents' acks to them), then
``PowerPolicy.tick``. Its decisions go out through :class:`CommandService` like an
operator's commands, each recorded as a ``power_cap``/``power_uncap`` Action; its incidents
go through :class:`IncidentService`; its effects (the domain's power after a level change
and how long the readings took to show it) are written onto the actions they belong to.

The reading of a server is the highest power among the samples of the reports received in
the last ``READING_WINDOW_S`` (at least the last report), timed at the controller's receive
time: a training step's dip between two iterations must not look like room to uncap, and a
spike inside the window counts. The price is that a drop shows up to one window late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.errors import ControllerError, TemporaryError
from controller.logic.detection.incident_evidence import EvidenceEvent, PowerEvidence
from controller.logic.incident_kinds import IncidentKind
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService, IncidentSpec
from controller.services.power.tracking import ActionTracker
from controller.state import ClusterState
from power import (
    Decision,
    DomainStatus,
    DomainTree,
    GpuStatus,
    Level,
    PolicyIncident,
    PowerPolicy,
    Priority,
    Reading,
    apply_job_priorities,
    gpu_statuses,
    readings_from_sample,
)
from power.reports import Placement
from power.tick_io import PolicyIncidentKind
from trainguard import wire

log = logging.getLogger(__name__)

#: Incidents of the policy, by its kind: (our incident kind, severity).
INCIDENT_KINDS: dict[PolicyIncidentKind, tuple[IncidentKind, str]] = {
    "brake": (IncidentKind.POWER_BRAKE, "critical"),
    "telemetry_stale": (IncidentKind.POWER_TELEMETRY_STALE, "warning"),
    "clock_command_failed": (IncidentKind.POWER_CLOCK_COMMAND_FAILED, "warning"),
    "power_limit_command_failed": (IncidentKind.POWER_LIMIT_COMMAND_FAILED, "critical"),
    "gpu_uncappable": (IncidentKind.POWER_GPU_UNCAPPABLE, "warning"),
}

#: Peak-hold window of a server's reading (s): longer than a training step's dip (0.3 s in
#: the simulator, ~1 s on real jobs) sampled at the agents' 1 s default.
READING_WINDOW_S = 1.0

#: Don't start a report-driven tick sooner than this after the last one.
MIN_TICK_GAP_S = 0.05


@dataclass(slots=True)
class NodePower:
    """What the loop keeps per node: inventory, latest sample and the window's peak."""

    identity: wire.NodeIdentity
    sample: wire.NodeSample | None = None
    readings: dict[str, Reading] = field(default_factory=dict)
    #: (receive time, per-domain peak of one report), newest last, within the window.
    window: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)


class PowerLoop:
    def __init__(
        self,
        state: ClusterState,
        commands: CommandService,
        incidents: IncidentService,
        actions: ActionService,
        *,
        tick_interval_s: float = 1.0,
        enabled: bool = True,
        rank_active_within_s: float = 120.0,
    ) -> None:
        self._state = state
        self._commands = commands
        self._incidents = incidents
        self.tracker = ActionTracker(actions)
        self.tick_interval_s = tick_interval_s
        self.enabled = enabled
        self.nodes: dict[str, NodePower] = {}
        self.priorities: dict[str, Priority] = {}
        """Priority overrides set through the API; they beat the node label."""
        self.job_priorities: dict[str, Priority] = {}
        """Job priorities set through the API; they beat the node's class on the GPUs the
        job's running ranks report from."""
        self.rank_active_within_s = rank_active_within_s
        self.policy: PowerPolicy | None = None
        self.last: dict[str, DomainStatus] = {}
        self.latencies_s: tuple[float, ...] = ()
        """The policy's command latencies as of the last tick, for the views: the policy's own
        deque may be appended to by a tick running in a worker thread."""
        self.last_tick_unix_s: float | None = None
        self.released: dict[str, str] = {}
        """node:gpuN outside every domain whose trainguard caps are being released, or were
        ("releasing"/"released"), as of the last tick: a snapshot for the views."""
        self.lock = asyncio.Lock()
        self._kick: asyncio.Task[None] | None = None
        #: Controller command id -> the policy's id for the same command.
        self._policy_ids: dict[str, str] = {}
        #: Failures of commands that never reached the command queue, for the next tick.
        self._unsent: list[wire.CommandAck] = []
        # A job that leaves memory (job retention) takes its priority with it.
        state.job_forgotten.append(self.forget_job)

    def forget_job(self, job: str) -> None:
        """Drop a forgotten job's priority (``ClusterState.forget_job``): the API sets one
        only for a job in memory, and a job of the same name reporting later is a new job
        (docs/controller.md, job retention). Without this every job ever given a priority
        stayed here, and in the tree's stored root row, for good. The stored row loses it
        at the next write of the tree; a start reads back only those of jobs in memory."""
        self.job_priorities.pop(job, None)

    # ------------------------------------------------------------------ configuration

    def set_tree(self, tree: DomainTree | None, ours: Iterable[tuple[str, int]] = ()) -> None:
        """Start over with a new tree; caps in force are adopted by the new policy, and the
        caps trainguard set on servers the new tree leaves out are released by it: those
        of the old policy in this process, and ``ours``, the (server, GPU) a previous
        controller capped (read back from the actions table at start,
        :meth:`ActionTracker.restore`), which no policy in this process knows of."""
        ours = set(ours) | (self.policy.ours() if self.policy is not None else set())
        self.policy = None if tree is None else PowerPolicy(tree, id_prefix="pw", ours=ours)
        self._policy_ids.clear()
        self.last = {}
        self.latencies_s = ()
        self.released = {}
        if ours and tree is not None:
            left = sorted({s for s, _ in ours if s not in tree.by_name})
            if left:
                log.warning(
                    "power: servers left the tree with caps trainguard set; releasing them",
                    extra={"fields": {"servers": left}},
                )

    @property
    def tree(self) -> DomainTree | None:
        return None if self.policy is None else self.policy.tree

    # ------------------------------------------------------------------ observer

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        node = report.node.name
        entry = self.nodes.get(node)
        if entry is None:
            entry = self.nodes[node] = NodePower(identity=report.node)
        entry.identity = report.node
        if report.samples:
            entry.sample = max(report.samples, key=lambda s: s.time_unix_s)
            peak: dict[str, Reading] = {}
            for sample in report.samples:
                got = readings_from_sample(node, sample, time_s=received_unix_s, tree=self.tree)
                for name, reading in got.items():
                    if name not in peak or reading.power_w > peak[name].power_w:
                        peak[name] = reading
            entry.window.append((received_unix_s, {k: r.power_w for k, r in peak.items()}))
            while entry.window and entry.window[0][0] < received_unix_s - READING_WINDOW_S:
                entry.window.popleft()
            # Only names the newest report has: a report without a server reading (a GPU
            # did not answer) lets the old one age out, so the domain goes stale rather
            # than trusting a partial sum.
            entry.readings = {
                name: Reading(max(p.get(name, 0.0) for _, p in entry.window), received_unix_s)
                for name in peak
            }
        if self.policy is None or not self.enabled:
            return
        if self.last_tick_unix_s is not None and (
            received_unix_s - self.last_tick_unix_s < MIN_TICK_GAP_S
        ):
            return
        if self._kick is None or self._kick.done():
            # Not awaited: the reporting agent's reply must not wait for our commands.
            self._kick = asyncio.create_task(self._tick_logged(time.time()))

    async def _tick_logged(self, now: float) -> None:
        try:
            await self.tick(now)
        except Exception:
            log.exception("power tick failed")

    # ------------------------------------------------------------------ ticker

    async def tick(self, now_unix_s: float) -> None:
        if self.policy is None:
            return
        if not self.enabled:
            self._watch(self.policy.tree, now_unix_s)
            return
        async with self.lock:
            await self._tick(self.policy, now_unix_s)

    def _watch(self, tree: DomainTree, now: float) -> None:
        """Disabled: keep the domains' power current for the views, decide nothing."""
        readings: dict[str, Reading] = {}
        for entry in self.nodes.values():
            readings.update(entry.readings)
        stale_s = min(d.policy.stale_after_s for d in tree.by_name.values())
        agg = tree.aggregate(readings, now_s=now, stale_after_s=stale_s)
        self.last = {
            name: DomainStatus(
                name,
                dom.budget_w,
                agg[name].power_w,
                agg[name].power_w / dom.budget_w,
                Level.NONE,
                float("-inf"),
                agg[name].complete,
            )
            for name, dom in tree.by_name.items()
        }
        self.last_tick_unix_s = now

    async def _tick(self, policy: PowerPolicy, now: float) -> None:
        readings: dict[str, Reading] = {}
        gpus: list[GpuStatus] = []
        for name, entry in self.nodes.items():
            readings.update(entry.readings)
            gpus.extend(
                gpu_statuses(entry.identity, entry.sample, priority=self.priorities.get(name))
            )
        gpus = apply_job_priorities(gpus, self.job_placements(now))
        acks = self._acks(now)
        # Off the event loop: a tick plans every GPU under the tree, 0.3-0.6 s for a tree at
        # MAX_DOMAINS with 8 GPUs a server, which would stall every request meanwhile. The
        # policy is touched only here (under ``self.lock``) and by ``withdraw`` below, after
        # the thread is done; views read the snapshots taken here, never the policy itself.
        result = await asyncio.to_thread(policy.tick, now, readings, gpus, acks)
        self.latencies_s = tuple(policy.latencies_s)
        self.released = policy.released()
        self.last = result.domains
        self.last_tick_unix_s = now
        for i, decision in enumerate(result.decisions):
            dom = result.domains.get(decision.domain) if decision.domain is not None else None
            if not await self._send(policy, decision, dom, now):
                # The database is away: don't try each of the others in turn this tick.
                for later in result.decisions[i + 1 :]:
                    policy.withdraw(later.command.id)
                log.warning(
                    "power commands not stored (database unavailable); decided again next tick",
                    extra={"fields": {"commands": len(result.decisions) - i}},
                )
                break
        for incident in result.incidents:
            await self._open_incident(incident)
        await self._resolve_recovered(result.domains)
        try:
            await self.tracker.on_effects(result.effects, policy.tree)
            await self.tracker.on_statuses(result.domains, now)
            await self.tracker.on_commands(self._state.commands, now)
        except TemporaryError as exc:
            # Nothing was marked done that is not stored: a later tick writes it.
            log.warning("power action update not stored; tried again next tick: %s", exc)

    async def _send(
        self, policy: PowerPolicy, decision: Decision, dom: DomainStatus | None, now: float
    ) -> bool:
        """Queue a decision's command with its action row (one transaction), then track it;
        False when the database is away.

        The database away: nothing is queued, stored or tracked, and the policy forgets the
        command, so the next tick decides again. A command that can never be created (a
        node the controller does not know): the policy hears "failed" and a ``failed``
        action records it."""
        planned = self.tracker.plan(decision, dom, now)
        try:
            command, action_id = await self._commands.create_with(
                decision.node, decision.command, by="power-policy", also=planned.inserting
            )
        except TemporaryError as exc:
            policy.withdraw(decision.command.id)
            log.debug("power command not stored: %s", exc)
            return False
        except ControllerError as exc:
            self._unsent.append(
                wire.CommandAck(
                    command_id=decision.command.id,
                    status=wire.CommandStatus.FAILED,
                    reason=str(exc)[:1024],
                    finished_unix_s=now,
                )
            )
            try:
                await self.tracker.record_failed(planned, str(exc))
            except TemporaryError:
                log.warning("failed power action not recorded (database unavailable)")
            return True
        assert action_id is not None
        self._policy_ids[command.id] = decision.command.id
        self.tracker.publish(planned, action_id, command.id)
        return True

    def _acks(self, now: float) -> list[wire.CommandAck]:
        """Final statuses of our commands, as the acks the policy understands."""
        acks, self._unsent = self._unsent, []
        for cid in list(self._policy_ids):
            command = self._state.commands.get(cid)
            if command is None:
                del self._policy_ids[cid]  # forgotten after KEEP_FINISHED_S
                continue
            if command.status in ("pending", "sent"):
                continue
            policy_id = self._policy_ids.pop(cid)
            if command.status == "expired":
                continue  # the policy re-sends after its own command timeout
            status = (
                wire.CommandStatus.SUCCEEDED
                if command.status == "succeeded"
                else wire.CommandStatus.FAILED
            )
            acks.append(
                wire.CommandAck(
                    command_id=policy_id,
                    status=status,
                    reason=command.reason[:1024],
                    finished_unix_s=command.finished_unix_s or now,
                )
            )
        return acks

    # ------------------------------------------------------------------ incidents

    async def _open_incident(self, incident: PolicyIncident) -> None:
        kind, severity = INCIDENT_KINDS[incident.kind]
        if incident.kind == "power_limit_command_failed" and "no knob left" not in incident.message:
            severity = "warning"
        gpu = "" if incident.gpu_index is None else str(incident.gpu_index)
        key = f"power:{incident.kind}:{incident.domain or ''}:{incident.node or ''}:{gpu}"
        evidence = PowerEvidence(domain=incident.domain, policy_kind=incident.kind)
        if incident.domain is not None and incident.domain in self.last:
            st = self.last[incident.domain]
            evidence.budget_w = st.budget_w
            evidence.power_w = round(st.power_w, 1)
            evidence.level = st.level.name
        await self._incidents.open_or_bump(
            IncidentSpec(
                kind=kind,
                severity=severity,
                summary=incident.message,
                dedupe_key=key,
                node=incident.node,
                gpu_index=incident.gpu_index,
                evidence=evidence,
            ),
            events=[EvidenceEvent(time_unix_s=time.time(), message=incident.message)],
        )

    async def _resolve_recovered(self, statuses: dict[str, DomainStatus]) -> None:
        """Close stale-telemetry and brake incidents once their domain is past them."""
        for name, st in statuses.items():
            if st.complete:
                found = self._incidents.find_open(f"power:telemetry_stale:{name}::")
                if found is not None:
                    await self._incidents.resolve(found, note="telemetry is fresh again")
            if st.level < Level.BRAKE:
                found = self._incidents.find_open(f"power:brake:{name}::")
                if found is not None:
                    await self._incidents.resolve(
                        found, note=f"{name} released from the brake ({st.level.name})"
                    )

    def job_placements(self, now: float, job: str | None = None) -> list[Placement]:
        """(node, GPU, priority) of every running rank of a job with a priority (of ``job``
        only, if given): ranks that exited, failed or went silent for
        ``rank_active_within_s`` no longer count."""
        out: list[Placement] = []
        for job_name, prio in self.job_priorities.items():
            if job is not None and job_name != job:
                continue
            state = self._state.jobs.get(job_name)
            if state is None:
                continue
            for rank in state.ranks.values():
                if rank.state != "running":
                    continue
                if now - rank.last_seen_unix_s > self.rank_active_within_s:
                    continue
                out.append((rank.node, rank.gpu_index, prio))
        return out

    # ------------------------------------------------------------------ views

    def capped_gpus(self) -> dict[str, list[str]]:
        """Per server: the GPUs whose latest sample shows a clock lock or a lowered limit."""
        out: dict[str, list[str]] = {}
        for name, entry in self.nodes.items():
            if entry.sample is None:
                continue
            maxima = {g.index: g.power_limit_max_w for g in entry.identity.gpus}
            for g in entry.sample.gpus:
                top = maxima.get(g.index)
                limited = (
                    g.power_limit_w is not None and top is not None and g.power_limit_w < top - 0.5
                )
                if g.locked_sm_clock_mhz is not None or limited:
                    out.setdefault(name, []).append(f"{name}:gpu{g.index}")
        return out


__all__ = ["INCIDENT_KINDS", "NodePower", "PowerLoop"]
