"""POLCA's capping policy as a pure, clock-injected state machine.

The caller (the controller's power loop, or the simulator) owns time and I/O. Each tick it
passes the current readings, the GPUs it knows and the acknowledgements that arrived; the
policy returns the wire commands to send and why. Nothing here sleeps, reads a clock or
talks to a network, so the same object runs live and inside a six-week trace replay.

Per domain the state is one :class:`~power.config.Level`::

    NONE --p>=T1--> T1 --p>=T2--> T2_LP --still p>=T2 after escalate_after_s--> T2_HP
      any level --p>=brake--> BRAKE
    down one level at a time, only when p < (threshold of the level - hysteresis) AND the
    level has been held min_hold_s AND every reading under the domain is fresh.

A GPU gets the most restrictive cap of all the domains above it. Safety rules:

* stale or missing telemetry: the domain's power is taken as the sum of its fresh parts, a
  lower bound. That may still escalate (safe direction) but never uncaps;
* a failed clock command (no root, unsupported part) switches that GPU to the power-limit
  knob and raises an incident; a failed power limit falls back to clocks if they still
  work, else the GPU is reported uncontrollable;
* caps found on a GPU at first sight (a controller restart) are adopted, not lifted.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from power.clocks import ClockProfile, cap_key
from power.clocks import clock_profile as lookup_profile
from power.config import Knob, Level, PolicyConfig
from power.domains import Domain, DomainPower, DomainTree, Reading
from power.knobs import cap_fraction, choose_knob, power_limit_for_cap
from power.tick_io import (
    EFFECT_DELTA_FRAC,
    EFFECT_TIMEOUT_S,
    ActuationEffect,
    Decision,
    DomainStatus,
    GpuCommand,
    GpuStatus,
    PolicyIncident,
    TickResult,
)
from trainguard.wire import (
    CommandAck,
    CommandStatus,
    LockClocks,
    ResetPowerLimit,
    SetPowerLimit,
    UnlockClocks,
)

_LIMIT_TOLERANCE_W = 0.5

log = logging.getLogger(__name__)

#: Why a GPU's power limits are not used when its agent reports inverted bounds.
_INVERTED_LIMITS = "power-limit bounds inverted"


@dataclass(slots=True)
class _DomainState:
    level: Level = Level.NONE
    since_s: float = float("-inf")
    reason: str = ""
    threshold: float | None = None
    stale: bool = False
    effect: tuple[Level, Level, float, float] | None = None
    """Pending effect of the last level change: (from, to, started_s, power_before_w)."""


@dataclass(slots=True)
class _Pending:
    command_id: str
    target: float | None
    sent_s: float


@dataclass(slots=True)
class _GpuState:
    status: GpuStatus
    chain: list[Domain]
    applied_clock: int | None = None
    applied_limit: float | None = None
    clocks_failed: str | None = None
    limit_failed: str | None = None
    inflight: dict[Knob, _Pending] = field(default_factory=dict)
    hold_until_s: float = float("-inf")
    """Adopted caps are kept at least one hold time after first sight."""
    deferred: bool = False
    """An uncap is waiting on a hold or on fresh telemetry."""
    raw: GpuStatus | None = None
    """The status as reported, when ``status`` had to be cleaned (inverted limits)."""
    limits_bad: str | None = None
    """Why the power-limit knob is not used for this GPU's reported bounds (inverted)."""
    release_failed: set[Knob] = field(default_factory=set)
    """Knobs whose release (unlock, reset) failed: not tried again, so no command loop."""
    uncappable_said: bool = False
    """A cap was wanted and no knob was known: said once (``gpu_uncappable``)."""


class PowerPolicy:
    """Tick it with readings; send what it returns; feed the acknowledgements back."""

    def __init__(
        self,
        tree: DomainTree,
        *,
        id_prefix: str = "pw",
        ours: Iterable[tuple[str, int]] = (),
    ) -> None:
        """``ours``: (server, GPU index) whose caps an earlier policy set (a replaced tree):
        those outside every domain of ``tree`` get their caps released, not left for good."""
        self.tree = tree
        self._ours: set[tuple[str, int]] = set(ours)
        self._domains: dict[str, _DomainState] = {n: _DomainState() for n in tree.by_name}
        self._gpus: dict[tuple[str, int], _GpuState] = {}
        self._pending: dict[str, tuple[tuple[str, int], Knob]] = {}
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix
        self._profiles: dict[tuple[object, ...], ClockProfile | None] = {}
        self._stale_after_s = min(d.policy.stale_after_s for d in tree.by_name.values())
        self.latencies_s: deque[float] = deque(maxlen=4096)
        """Issue-to-acknowledgement times of successful commands: the in-band latency."""
        self.brake_events = 0
        self._changed = True
        self._attention: set[tuple[str, int]] = set()

    # ------------------------------------------------------------------ public
    def withdraw(self, command_id: str) -> None:
        """Forget a command the caller could not send (its record was not stored): not a
        failure of the knob, so the next tick decides again and sends a new one."""
        entry = self._pending.pop(command_id, None)
        if entry is None:
            return
        key, knob = entry
        gpu = self._gpus.get(key)
        if gpu is None:
            return
        pending = gpu.inflight.get(knob)
        if pending is not None and pending.command_id == command_id:
            del gpu.inflight[knob]
        self._attention.add(key)

    def level(self, domain: str) -> Level:
        return self._domains[domain].level

    def ours(self) -> set[tuple[str, int]]:
        """GPUs with a cap this policy set or adopted, or a command of its in flight: what a
        policy for a replacing tree must release on the servers the new tree leaves out."""
        out = {
            key
            for key, gpu in self._gpus.items()
            if gpu.applied_clock is not None or gpu.applied_limit is not None or gpu.inflight
        }
        return out | (self._ours - set(self._gpus))

    def released(self) -> dict[str, str]:
        """node:gpuN outside every domain whose caps trainguard set -> "releasing"/"released"."""
        out: dict[str, str] = {}
        for (server, index), gpu in self._gpus.items():
            if gpu.chain:
                continue
            capped = gpu.applied_clock is not None or gpu.applied_limit is not None
            out[f"{server}:gpu{index}"] = "releasing" if capped or gpu.inflight else "released"
        return out

    def tick(
        self,
        now_s: float,
        readings: Mapping[str, Reading],
        gpus: Iterable[GpuStatus] = (),
        acks: Sequence[CommandAck] = (),
    ) -> TickResult:
        incidents: list[PolicyIncident] = []
        self._changed = self._update_inventory(gpus, now_s) or bool(acks)
        for ack in acks:
            self._apply_ack(ack, now_s, incidents)
        agg = self.tree.aggregate(readings, now_s=now_s, stale_after_s=self._stale_after_s)
        statuses: dict[str, DomainStatus] = {}
        effects: list[ActuationEffect] = []
        for name, dom in self.tree.by_name.items():
            st = self._domains[name]
            before = st.level
            if st.effect is not None:
                self._check_effect(dom, st, agg[name], now_s, effects)
            statuses[name] = self._step_domain(dom, agg[name], now_s, incidents)
            if st.level is not before:
                if st.effect is not None:  # superseded before it showed
                    effects.append(_effect(name, st.effect, agg[name].power_w, False, now_s))
                st.effect = (before, st.level, now_s, agg[name].power_w)
        decisions: list[Decision] = []
        # Re-plan every GPU only when something that decides a cap changed; otherwise only
        # those waiting on an acknowledgement or a hold (a trace replay ticks 10^5 times).
        keys = list(self._gpus) if self._changed else list(self._attention)
        for key in keys:
            gpu = self._gpus[key]
            decisions.extend(self._plan_gpu(key, gpu, now_s, agg, incidents))
            if gpu.inflight or gpu.deferred:
                self._attention.add(key)
            else:
                self._attention.discard(key)
        return TickResult(decisions, incidents, statuses, effects)

    def _check_effect(
        self,
        dom: Domain,
        st: _DomainState,
        agg: DomainPower,
        now_s: float,
        effects: list[ActuationEffect],
    ) -> None:
        assert st.effect is not None
        old, new, started, before = st.effect
        delta = EFFECT_DELTA_FRAC * dom.budget_w
        moved = agg.power_w <= before - delta if new > old else agg.power_w >= before + delta
        if agg.complete and moved:
            effects.append(_effect(dom.name, st.effect, agg.power_w, True, now_s))
            st.effect = None
        elif now_s - started >= EFFECT_TIMEOUT_S:
            effects.append(_effect(dom.name, st.effect, agg.power_w, False, now_s))
            st.effect = None

    def actuation_latency_s(self, quantile: float = 0.99) -> float | None:
        """A quantile of measured command latencies, for deriving T2 (None before any)."""
        return latency_quantile(self.latencies_s, quantile)

    # ------------------------------------------------------------------ domains
    def _step_domain(
        self, dom: Domain, agg: DomainPower, now_s: float, incidents: list[PolicyIncident]
    ) -> DomainStatus:
        st = self._domains[dom.name]
        cfg = dom.policy
        frac = agg.power_w / dom.budget_w
        old = st.level
        if old is Level.NONE and frac < cfg.t1_frac and agg.complete and not st.stale:
            # The common case, kept cheap: nothing capped here and nothing to cap.
            return DomainStatus(dom.name, dom.budget_w, agg.power_w, frac, old, st.since_s, True)
        up, threshold = Level.NONE, None
        if frac >= cfg.brake_frac:
            up, threshold = Level.BRAKE, cfg.brake_frac
        elif frac >= cfg.t2_frac:
            up, threshold = Level.T2_LP, cfg.t2_frac
            if old is Level.T2_LP and now_s - st.since_s >= cfg.escalate_after_s:
                up = Level.T2_HP
        elif frac >= cfg.t1_frac:
            up, threshold = Level.T1, cfg.t1_frac
        pct = f"{dom.name} at {frac:.1%} of {dom.budget_w:.0f} W" if up != old else ""
        if up > old:
            self._changed = True
            st.level, st.since_s, st.threshold = up, now_s, threshold
            st.reason = f"{pct} >= {up.name} threshold {threshold:.0%}"
            if up is Level.T2_HP:
                st.reason += (
                    f" and still above {cfg.escalate_after_s:g}s after capping low priority"
                )
            if up is Level.BRAKE:
                self.brake_events += 1
                incidents.append(PolicyIncident("brake", f"emergency brake: {pct}", dom.name))
        elif agg.complete and old > Level.NONE and now_s - st.since_s >= cfg.min_hold_s:
            release = _release_frac(old, cfg)
            if frac < release:
                pct = f"{dom.name} at {frac:.1%} of {dom.budget_w:.0f} W"
                self._changed = True
                st.level, st.since_s = Level(old - 1), now_s
                st.threshold = release
                st.reason = (
                    f"{pct} < {release:.0%} for {cfg.min_hold_s:g}s: down to {st.level.name}"
                )
        if not agg.complete and not st.stale and st.level > Level.NONE:
            incidents.append(
                PolicyIncident(
                    "telemetry_stale",
                    f"{dom.name}: readings missing or older than {cfg.stale_after_s:g}s; holding "
                    f"{st.level.name} caps until telemetry is back",
                    dom.name,
                )
            )
        if st.stale != (not agg.complete):
            self._changed = True
        st.stale = not agg.complete
        return DomainStatus(
            dom.name, dom.budget_w, agg.power_w, frac, st.level, st.since_s, agg.complete
        )

    # ------------------------------------------------------------------ GPUs
    def _update_inventory(self, gpus: Iterable[GpuStatus], now_s: float) -> bool:
        """Record the GPUs; True when one is new or its metadata changed."""
        changed = False
        for raw in gpus:
            key = (raw.server, raw.index)
            status, bad = _clean_limits(raw)
            gpu = self._gpus.get(key)
            if gpu is not None:
                seen = gpu.raw if gpu.raw is not None else gpu.status
                if seen is not raw and seen != raw:
                    self._follow_reported_caps(gpu, status)
                    gpu.status, gpu.raw = status, (raw if bad else None)
                    self._note_limits(gpu, bad)
                    changed = True
                continue
            server = self.tree.by_name.get(status.server)
            if server is None:
                if key not in self._ours or not _capped(status):
                    continue  # a node outside every power domain is not ours to cap
                # A server the tree dropped still shows the cap we set: release it.
                chain: list[Domain] = []
                log.warning(
                    "power: %s GPU %d is in no power domain but holds a cap trainguard "
                    "set; releasing it",
                    status.server,
                    status.index,
                )
            else:
                chain = server.ancestors()
                gdom = self.tree.gpu_domain(status.server, status.index)
                if gdom is not None:
                    chain.insert(0, gdom)
            gpu = _GpuState(status=status, chain=chain, raw=raw if bad else None)
            self._note_limits(gpu, bad)
            gpu.applied_clock = status.locked_sm_clock_mhz
            gpu.applied_limit = _lowered_limit(status)
            if chain and (gpu.applied_clock is not None or gpu.applied_limit is not None):
                gpu.hold_until_s = now_s + min(d.policy.min_hold_s for d in chain)
            self._gpus[key] = gpu
            changed = True
        return changed

    @staticmethod
    def _follow_reported_caps(gpu: _GpuState, now: GpuStatus) -> None:
        """Take what the reports show in force over what an ack once said, when they change.

        A lock or limit this policy set can vanish under it: the agent restarts (its lock
        record is gone), the GPU is reset or the driver reloaded (the limit is back at the
        maximum), someone unlocks it by hand. Believing the ack would leave the GPU uncapped
        for as long as its domain stays at the same level, with nothing re-sent. Only a
        *change* of the reported value counts, with no command of that knob in flight (a
        sample taken before the agent applied our command shows no change), and an
        unanswered limit (``None``) is not taken as "no limit".
        """
        before = gpu.status
        clock = now.locked_sm_clock_mhz
        if (
            Knob.CLOCKS not in gpu.inflight
            and clock != before.locked_sm_clock_mhz
            and not _same(gpu.applied_clock, clock)
        ):
            log.warning(
                "power: %s GPU %d reports clock lock %s, not the %s trainguard set; "
                "following the report",
                now.server,
                now.index,
                clock,
                gpu.applied_clock,
            )
            gpu.applied_clock = clock
        limit = _lowered_limit(now)
        if (
            Knob.POWER_LIMIT not in gpu.inflight
            and now.power_limit_w is not None
            and now.power_limit_w != before.power_limit_w
            and not _same(gpu.applied_limit, limit)
        ):
            log.warning(
                "power: %s GPU %d reports power limit %s W, not the %s W trainguard set; "
                "following the report",
                now.server,
                now.index,
                now.power_limit_w,
                gpu.applied_limit,
            )
            gpu.applied_limit = limit

    @staticmethod
    def _note_limits(gpu: _GpuState, bad: str | None) -> None:
        """Inverted power-limit bounds: the power-limit knob is unknown for this GPU (logged
        when it starts, cleared when a report has sane bounds again)."""
        if bad is not None and gpu.limits_bad is None:
            log.warning(
                "power: %s GPU %d: %s; its power limit is not used",
                gpu.status.server,
                gpu.status.index,
                bad,
            )
        gpu.limits_bad = bad

    def _profile(self, status: GpuStatus, policy: PolicyConfig) -> ClockProfile | None:
        ck = (
            status.model,
            status.sm_clock_min_mhz,
            status.sm_clock_max_mhz,
            status.power_limit_min_w,
            status.power_limit_max_w,
            id(policy),
        )
        if ck in self._profiles:
            return self._profiles[ck]
        self._profiles[ck] = profile = lookup_profile(
            status.model,
            sm_clock_max_mhz=status.sm_clock_max_mhz,
            sm_clock_min_mhz=status.sm_clock_min_mhz,
            power_limit_max_w=status.power_limit_max_w,
            power_limit_min_w=status.power_limit_min_w,
            overrides=policy.clock_overrides_mhz,
        )
        return profile

    def _plan_gpu(
        self,
        key: tuple[str, int],
        gpu: _GpuState,
        now_s: float,
        agg: Mapping[str, DomainPower],
        incidents: list[PolicyIncident],
    ) -> list[Decision]:
        status = gpu.status
        worst: tuple[float, Domain, Level, str] | None = None  # (clock fraction of max, ...)
        for dom in gpu.chain:
            level = self._domains[dom.name].level
            ck = cap_key(level, status.priority)
            if ck is None:
                continue
            frac = self._cap_fraction(status, dom.policy, ck)
            if worst is None or frac < worst[0]:
                worst = (frac, dom, level, ck)
        want_clock: int | None = None
        lowest = 0
        want_limit: float | None = None
        knob, note = Knob.CLOCKS, ""
        dom_name: str | None = None
        level = Level.NONE
        threshold = power = budget = None
        reason = "no domain above this GPU is capping it"
        held = False  # a looser cap waits for an adopted cap's hold to end
        if worst is not None:
            frac, dom, level, ck = worst
            st = self._domains[dom.name]
            dom_name, threshold, budget = dom.name, st.threshold, dom.budget_w
            power, reason = agg[dom.name].power_w, st.reason
            profile = self._profile(status, dom.policy)
            lowest = profile.min_mhz if profile is not None else 0
            knob, note = choose_knob(
                dom.policy.knob,
                profile,
                gpu.clocks_failed,
                gpu.limit_failed or gpu.limits_bad,
                status.model,
            )
            if knob is Knob.CLOCKS and profile is not None:
                want_clock = profile.caps_mhz[ck]
            else:
                want_limit = power_limit_for_cap(status, profile, frac, ck)
                if (
                    want_limit is None
                    and profile is not None
                    and profile.clocks_usable
                    and gpu.clocks_failed is None
                ):
                    # The domain prefers limits, but this GPU has none known (a model not in
                    # the table, no bounds reported): its clocks cap it rather than nothing.
                    want_clock = profile.caps_mhz[ck]
                    knob, note = Knob.CLOCKS, "clocks used: power limits unknown"
                elif want_limit is None:
                    knob, note = Knob.POWER_LIMIT, "no usable knob: power limits unknown"
            if now_s < gpu.hold_until_s:
                # An adopted cap is kept one hold time, loosening included: after a restart
                # or a tree replacement the draw is the one that cap holds down, so a fresh
                # level (T1 under an adopted T2 lock) would let it back up and cap again.
                if want_clock is not None and gpu.applied_clock is not None:
                    held = held or gpu.applied_clock < want_clock
                    want_clock = min(want_clock, gpu.applied_clock)
                if want_limit is not None and gpu.applied_limit is not None:
                    held = held or gpu.applied_limit < want_limit
                    want_limit = min(want_limit, gpu.applied_limit)
            self._say_uncappable(gpu, want_clock is None and want_limit is None, dom, level,
                                 note, incidents)  # fmt: skip
        elif not gpu.chain:
            reason = (
                f"{status.server} is in no power domain of the current tree: releasing the "
                "cap trainguard set under an earlier tree"
            )
        else:
            dom_name = gpu.chain[0].name
            st = self._domains[dom_name]
            if st.reason:
                reason = st.reason
        if (
            want_clock is None
            and want_limit is None
            and (now_s < gpu.hold_until_s or any(self._domains[d.name].stale for d in gpu.chain))
        ):
            gpu.deferred = True
            return []  # never lift a cap blindly: adopted caps wait, stale domains hold
        gpu.deferred = held
        out: list[Decision] = []

        def emit(cmd: GpuCommand, k: Knob, target: float | None) -> None:
            gpu.inflight[k] = _Pending(cmd.id, target, now_s)
            self._pending[cmd.id] = (key, k)
            why = reason + (f"; {note}" if note else "")
            out.append(
                Decision(
                    status.server,
                    status.index,
                    cmd,
                    k,
                    dom_name,
                    level,
                    threshold,
                    power,
                    budget,
                    why[:512],
                )
            )

        wants = (
            (Knob.CLOCKS, want_clock, gpu.clocks_failed),
            (Knob.POWER_LIMIT, want_limit, gpu.limit_failed or gpu.limits_bad),
        )
        # A knob that failed is not used to cap, but a cap it set before failing (a lock
        # that took at T1, then the T2 lock failed) must still be lifted once nothing is
        # wanted, or it stays on the GPU for good; tried once per knob, not in a loop.
        releasing = want_clock is None and want_limit is None
        for k, want, failed in wants:
            usable = failed is None or (releasing and k not in gpu.release_failed)
            if usable and self._needs(gpu, k, want, now_s):
                target = None if want is None else float(want)
                emit(self._command(k, target, status.index, lowest, reason, now_s), k, target)
        return out

    def _command(
        self, knob: Knob, want: float | None, index: int, lowest: int, reason: str, now_s: float
    ) -> GpuCommand:
        cid, why = self._next_id(), reason[:512]
        if knob is Knob.CLOCKS:
            if want is None:
                return UnlockClocks(id=cid, issued_unix_s=now_s, gpu_index=index, reason=why)
            mhz = int(want)
            return LockClocks(
                id=cid,
                issued_unix_s=now_s,
                gpu_index=index,
                reason=why,
                min_mhz=min(lowest, mhz),
                max_mhz=mhz,
            )
        if want is None:
            return ResetPowerLimit(id=cid, issued_unix_s=now_s, gpu_index=index, reason=why)
        return SetPowerLimit(id=cid, issued_unix_s=now_s, gpu_index=index, reason=why, limit_w=want)

    def _needs(self, gpu: _GpuState, knob: Knob, want: float | None, now_s: float) -> bool:
        applied = gpu.applied_clock if knob is Knob.CLOCKS else gpu.applied_limit
        if _same(applied, want):
            pending = gpu.inflight.get(knob)
            # A command still in flight towards another target must be superseded.
            return not (pending is None or _same(pending.target, want))
        pending = gpu.inflight.get(knob)
        if pending is not None and _same(pending.target, want):
            cfg = gpu.chain[-1].policy if gpu.chain else PolicyConfig()
            if now_s - pending.sent_s < cfg.command_timeout_s:
                return False
            self._pending.pop(pending.command_id, None)  # a late ack of it is ignored
        return True

    def _cap_fraction(self, status: GpuStatus, policy: PolicyConfig, ck: str) -> float:
        return cap_fraction(self._profile(status, policy), ck)

    @staticmethod
    def _say_uncappable(
        gpu: _GpuState,
        uncappable: bool,
        dom: Domain,
        level: Level,
        note: str,
        incidents: list[PolicyIncident],
    ) -> None:
        """A GPU that must be capped but has no knob known (neither a clock range nor power
        limits: a model not in the table that reports no bounds) draws uncapped while the
        others take its share; said once, as an incident, rather than only in a note on a
        decision that is never sent. A knob that failed has its own incident."""
        failed = gpu.clocks_failed is not None or gpu.limit_failed is not None
        if not uncappable or failed:
            gpu.uncappable_said = gpu.uncappable_said and uncappable
            return
        if gpu.uncappable_said:
            return
        gpu.uncappable_said = True
        st = gpu.status
        incidents.append(
            PolicyIncident(
                "gpu_uncappable",
                f"{st.server} GPU {st.index} ({st.model or 'model unknown'}): {dom.name} is at "
                f"{level.name} but this GPU cannot be capped ({note}); the other GPUs' caps "
                "take its share",
                dom.name,
                st.server,
                st.index,
            )
        )

    def _apply_ack(self, ack: CommandAck, now_s: float, incidents: list[PolicyIncident]) -> None:
        entry = self._pending.pop(ack.command_id, None)
        if entry is None:
            return  # not ours, or superseded by a re-send
        key, knob = entry
        gpu = self._gpus.get(key)
        if gpu is None:
            return
        pending = gpu.inflight.get(knob)
        if pending is None or pending.command_id != ack.command_id:
            return
        del gpu.inflight[knob]
        node, index = key
        if ack.status is CommandStatus.SUCCEEDED:
            target = pending.target
            if knob is Knob.CLOCKS:
                gpu.applied_clock = None if target is None else int(target)
            else:
                gpu.applied_limit = target
            gpu.release_failed.discard(knob)
            done = ack.finished_unix_s or now_s
            self.latencies_s.append(max(0.0, done - pending.sent_s))
            return
        if ack.status is not CommandStatus.FAILED:
            return
        why = ack.reason or "no reason given"
        if pending.target is None:
            gpu.release_failed.add(knob)
        releasing = pending.target is None
        if knob is Knob.CLOCKS:
            gpu.clocks_failed = why
            then = (
                "the lock stays until an operator resets the clocks (not tried again)"
                if releasing
                else "escalating to the power-limit knob"
            )
            incidents.append(
                PolicyIncident(
                    "clock_command_failed",
                    f"{node} GPU {index}: clock {'unlock' if releasing else 'command'} failed "
                    f"({why}); {then}",
                    None,
                    node,
                    index,
                )
            )
        else:
            gpu.limit_failed = why
            fallback = (
                "the limit stays until an operator resets it (not tried again)"
                if releasing
                else "falling back to clocks"
                if gpu.clocks_failed is None
                else ("no knob left: this GPU cannot be capped, others will take its share")
            )
            incidents.append(
                PolicyIncident(
                    "power_limit_command_failed",
                    f"{node} GPU {index}: power-limit command failed ({why}); {fallback}",
                    None,
                    node,
                    index,
                )
            )

    def _next_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids):010d}"


def _lowered_limit(status: GpuStatus) -> float | None:
    """The GPU's power limit when it sits below its maximum by more than
    ``_LIMIT_TOLERANCE_W`` (a cap someone set, not the read-back rounding), else ``None``."""
    limit, top = status.power_limit_w, status.power_limit_max_w
    if limit is not None and top is not None and limit < top - _LIMIT_TOLERANCE_W:
        return limit
    return None


def _capped(status: GpuStatus) -> bool:
    """The GPU reports a clock lock or a power limit below its maximum."""
    return status.locked_sm_clock_mhz is not None or _lowered_limit(status) is not None


def _clean_limits(status: GpuStatus) -> tuple[GpuStatus, str | None]:
    """``status`` with inverted power-limit bounds (min > max, a driver glitch) taken as
    unknown, and why; the report is kept, only its power-limit knob is not used."""
    lo, hi = status.power_limit_min_w, status.power_limit_max_w
    if lo is None or hi is None or lo <= hi:
        return status, None
    why = f"{_INVERTED_LIMITS} (min {lo:g} W > max {hi:g} W)"
    return dataclasses.replace(status, power_limit_min_w=None, power_limit_max_w=None), why


def latency_quantile(samples: Iterable[float], quantile: float) -> float | None:
    """A quantile of command latencies (None before any): one rule for the policy and for
    the controller's view, which reads a snapshot rather than the policy's live deque."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def _effect(
    name: str, pending: tuple[Level, Level, float, float], power_w: float, seen: bool, now_s: float
) -> ActuationEffect:
    old, new, started, before = pending
    return ActuationEffect(name, old, new, started, before, power_w, seen, now_s - started)


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= _LIMIT_TOLERANCE_W


def _release_frac(level: Level, cfg: PolicyConfig) -> float:
    if level is Level.BRAKE:
        return cfg.brake_frac - cfg.hysteresis_frac
    if level >= Level.T2_LP:
        return cfg.t2_frac - cfg.hysteresis_frac
    return cfg.t1_frac - cfg.hysteresis_frac


__all__ = [
    "ActuationEffect",
    "Decision",
    "DomainStatus",
    "GpuCommand",
    "GpuStatus",
    "PolicyIncident",
    "PowerPolicy",
    "TickResult",
    "latency_quantile",
]
