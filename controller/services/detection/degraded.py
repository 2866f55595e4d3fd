"""Degrading GPUs: correctable ECC errors piling up, or hardware throttling that persists.

A GPU can get worse for hours before it fails: single-bit (correctable) ECC errors that
come faster and faster precede row remapping and the fatal XIDs 48/63/94; a GPU that throttles
on temperature or on the board's power brake runs its rank slow, then often faults. Neither
makes a GPU unhealthy (``controller.services.detection.health`` keeps fatal faults), but both are a
reason to take a *protective checkpoint now*, while the job can still write one: the
default policy's rule for ``gpu_degraded`` does exactly that (``docs/remediation.md``).

Two conditions, each per GPU, open one ``gpu_degraded`` warning per GPU (dedupe key
``gpu_degraded:<node>:<index>``; later findings bump it):

* **ECC**: the ``ecc_corrected_total`` counter rose by at least ``ecc_rise`` within
  ``ecc_window_s``. Only rises count: a counter that drops (driver reload, GPU reset) or
  an agent that restarted (new ``agent_instance``) starts a new baseline, and so does a gap
  in the samples longer than the window, since errors that piled up during an outage
  cannot be placed in time. The first value a controller sees is a baseline too, so a
  controller restart never reads a GPU's lifetime count as a burst.
* **Throttling**: in the last ``throttle_s`` seconds of samples, more than half report a
  thermal, power-brake or hardware-slowdown clock-event reason (:data:`DEGRADING`).
  ``sw_power_cap`` is not among them: the POLCA power loop caps GPUs on purpose
  (``docs/power.md``), and a GPU that obeys our own cap is not degrading. Idle,
  application-clock, sync-boost and display reasons are configuration, not hardware.

Durations are measured on the samples' own clock (one agent's clock, so skew between nodes
does not matter); recovery on the controller's: an incident is resolved once the GPU has
reported with no condition active for ``clear_factor`` times the longer window of the
causes it showed (by default 2 x 10 min after ECC errors, 2 x 30 s after throttling). A
GPU that stops reporting stays open; its node's ``node_lost`` incident says why.

Memory per GPU is bounded: the ECC window is :data:`ECC_BUCKETS` time buckets, the
throttle window at most :data:`MAX_THROTTLE_SAMPLES` samples, and a GPU that is not
throttling keeps no samples at all.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from controller.logic.detection.incident_evidence import (
    DegradedEvidence,
    EccCause,
    EvidenceEvent,
    IncidentEvidence,
    ThrottleCause,
)
from controller.logic.incident_kinds import IncidentKind
from controller.services.incidents import IncidentService, IncidentSpec
from controller.state import ClusterState, IncidentState
from trainguard import wire
from trainguard.wire import THROTTLE_REASON_BITS, ThrottleReason

log = logging.getLogger(__name__)

KIND = IncidentKind.GPU_DEGRADED

#: Clock-event reasons that mean the hardware slows itself down: heat, the board's power
#: brake (PSU or power-delivery trouble), or an external slowdown signal.
DEGRADING: frozenset[ThrottleReason] = frozenset(
    {
        ThrottleReason.HW_SLOWDOWN,
        ThrottleReason.SW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    }
)
DEGRADING_MASK = sum(THROTTLE_REASON_BITS[r] for r in DEGRADING)

#: Time buckets per ECC window: the rise is counted to within one bucket (window / 60).
ECC_BUCKETS = 60
#: At most this many samples are kept per throttling GPU (30 s at 1 Hz needs 31).
MAX_THROTTLE_SAMPLES = 1024
#: An open incident is written at most this often while a storm keeps bumping it (the
#: default of ``bump_interval_s``, the ``degraded_bump_interval_s`` setting).
BUMP_INTERVAL_S = 2.0


@dataclass(slots=True)
class _Bucket:
    index: int
    first_unix_s: float
    count: int


@dataclass(slots=True)
class _Watch:
    """What the detector remembers about one GPU."""

    # ECC: the last counter value and when it was seen, the rises in the window.
    ecc_last: int | None = None
    ecc_last_unix_s: float = 0.0
    ecc_buckets: deque[_Bucket] = field(default_factory=deque)
    ecc_sum: int = 0
    ecc_active: bool = False
    ecc_since_unix_s: float | None = None
    # Throttling: (time, degrading reason bits, temperature) for the last throttle_s.
    throttle: deque[tuple[float, int, float | None]] = field(default_factory=deque)
    throttle_bad: int = 0
    throttle_active: bool = False
    throttle_since_unix_s: float | None = None
    last_sample_unix_s: float = float("-inf")
    # Recovery, on the controller's clock.
    last_active_unix_s: float | None = None
    last_seen_unix_s: float = 0.0
    #: Causes seen while the current incident is open ("ecc", "throttle").
    causes: set[str] = field(default_factory=set)
    # Bumps held back by the detector's bump_interval_s.
    pending: int = 0
    pending_events: list[EvidenceEvent] = field(default_factory=list)
    #: The newest evidence, for the incident once the held-back bump is written.
    pending_evidence: DegradedEvidence | None = None
    last_write_unix_s: float = 0.0


class DegradedGpuDetector:
    """A ``ReportObserver`` and ``Ticker`` opening ``gpu_degraded`` incidents."""

    def __init__(
        self,
        state: ClusterState,
        incidents: IncidentService,
        *,
        ecc_rise: int = 100,
        ecc_window_s: float = 600.0,
        throttle_s: float = 30.0,
        clear_factor: float = 2.0,
        tick_interval_s: float = 1.0,
        bump_interval_s: float = BUMP_INTERVAL_S,
    ) -> None:
        if (
            ecc_rise < 1
            or ecc_window_s <= 0
            or throttle_s <= 0
            or clear_factor <= 0
            or bump_interval_s <= 0
            or tick_interval_s <= 0
        ):
            raise ValueError(
                "ecc_rise must be >= 1 and ecc_window_s, throttle_s, clear_factor, "
                f"bump_interval_s, tick_interval_s > 0; got {ecc_rise}, {ecc_window_s}, "
                f"{throttle_s}, {clear_factor}, {bump_interval_s}, {tick_interval_s}"
            )
        self._state = state
        self._incidents = incidents
        #: Correctable ECC errors within ``ecc_window_s`` that make a GPU degrading.
        self.ecc_rise = ecc_rise
        self.ecc_window_s = ecc_window_s
        #: Seconds of mostly-throttled samples that make a GPU degrading.
        self.throttle_s = throttle_s
        self.clear_factor = clear_factor
        #: Seconds between two ticks (held-back bumps written, recovered GPUs resolved);
        #: the ``degraded_tick_interval_s`` setting. A zero would make the loop spin.
        self.tick_interval_s = tick_interval_s
        #: An open incident is written at most this often while bumps keep coming.
        self.bump_interval_s = bump_interval_s
        self._bucket_s = ecc_window_s / ECC_BUCKETS
        self._watches: dict[tuple[str, int], _Watch] = {}
        self._instances: dict[str, str] = {}

    # ------------------------------------------------------------------ reports

    async def on_report(self, report: wire.Report, received_unix_s: float) -> None:
        node = report.node.name
        if self._instances.get(node) != report.agent_instance:
            if node in self._instances:
                self._rebaseline(node)  # a restarted agent's counters may start anew
            self._instances[node] = report.agent_instance
        interval = report.sample_interval_s
        touched: dict[int, _Watch] = {}
        found: dict[int, list[EvidenceEvent]] = {}
        active: set[int] = set()
        for sample in report.samples:
            t = sample.time_unix_s
            for g in sample.gpus:
                watch = touched.get(g.index) or self._watches.get((node, g.index))
                if watch is None:
                    watch = self._watches[(node, g.index)] = _Watch()
                touched[g.index] = watch
                if t <= watch.last_sample_unix_s:
                    continue  # replayed or out of order: already counted
                watch.last_sample_unix_s = t
                for event in (
                    self._observe_ecc(watch, g.ecc_corrected_total, t),
                    self._observe_throttle(watch, g, t, interval),
                ):
                    if event is not None:
                        found.setdefault(g.index, []).append(event)
                if watch.ecc_active or watch.throttle_active:
                    active.add(g.index)
        failed: Exception | None = None
        for index, watch in sorted(touched.items()):
            watch.last_seen_unix_s = received_unix_s
            if index in active:
                watch.last_active_unix_s = received_unix_s
            if index in found:
                try:
                    await self._raise(node, index, watch, found[index], received_unix_s)
                except Exception as exc:  # one GPU's failed write must not skip the others
                    failed = failed or exc
        if failed is not None:
            raise failed

    def _rebaseline(self, node: str) -> None:
        for (name, _), watch in self._watches.items():
            if name == node:
                watch.ecc_last = None

    def _observe_ecc(self, watch: _Watch, value: int | None, t: float) -> EvidenceEvent | None:
        """Count a rise of the corrected-error counter; an event when it is (still) a burst."""
        rise = 0
        if value is not None:
            before, before_t = watch.ecc_last, watch.ecc_last_unix_s
            watch.ecc_last, watch.ecc_last_unix_s = value, t
            if before is not None and value > before and t - before_t <= self.ecc_window_s:
                rise = value - before  # a drop or a long gap is a new baseline, never a rise
        buckets = watch.ecc_buckets
        if rise:
            index = int(t // self._bucket_s)
            if buckets and buckets[-1].index == index:
                buckets[-1].count += rise
            else:
                buckets.append(_Bucket(index, t, rise))
            watch.ecc_sum += rise
        elif not buckets:
            return None  # the common case: no errors in the window
        oldest = int((t - self.ecc_window_s) // self._bucket_s)
        while buckets and buckets[0].index <= oldest:
            watch.ecc_sum -= buckets.popleft().count
        was = watch.ecc_active
        watch.ecc_active = watch.ecc_sum >= self.ecc_rise
        if not watch.ecc_active or (was and not rise):
            return None
        if not was:
            watch.ecc_since_unix_s = buckets[0].first_unix_s
        return EvidenceEvent(
            time_unix_s=t, cause="ecc", rise=watch.ecc_sum, ecc_corrected_total=value
        )

    def _observe_throttle(
        self, watch: _Watch, g: wire.GpuSample, t: float, interval_s: float
    ) -> EvidenceEvent | None:
        """Slide the throttle window; an event when throttling has just become persistent."""
        bits = g.throttle_reasons_mask & DEGRADING_MASK
        for reason in g.throttle_reasons:
            if reason in DEGRADING:
                bits |= THROTTLE_REASON_BITS[reason]
        window = watch.throttle
        if not bits and not window:
            return None  # the common case: not throttling, nothing kept
        if len(window) >= MAX_THROTTLE_SAMPLES:
            watch.throttle_bad -= 1 if window.popleft()[1] else 0
        window.append((t, bits, g.temperature_c))
        watch.throttle_bad += 1 if bits else 0
        while window[0][0] < t - self.throttle_s:
            watch.throttle_bad -= 1 if window.popleft()[1] else 0
        was = watch.throttle_active
        # Covered (to within half a sample interval) and throttled in most samples.
        watch.throttle_active = t - window[0][
            0
        ] >= self.throttle_s - interval_s / 2 and 2 * watch.throttle_bad > len(window)
        if not watch.throttle_bad:
            window.clear()
            return None
        if not watch.throttle_active or was:
            return None
        bad = [s for s in window if s[1]]
        watch.throttle_since_unix_s = bad[0][0]
        temps = [s[2] for s in window if s[2] is not None]
        return EvidenceEvent(
            time_unix_s=t,
            cause="throttle",
            reasons=_reason_names(_union(s[1] for s in bad)),
            throttled_fraction=round(watch.throttle_bad / len(window), 3),
            temperature_c=g.temperature_c,
            max_temperature_c=max(temps) if temps else None,
        )

    async def _raise(
        self,
        node: str,
        index: int,
        watch: _Watch,
        events: list[EvidenceEvent],
        now: float,
    ) -> None:
        key = f"{KIND}:{node}:{index}"
        existing = self._incidents.find_open(key)
        if existing is None:
            watch.causes.clear()
            watch.pending, watch.pending_events, watch.pending_evidence = 0, [], None
        watch.causes.update(e.cause for e in events if e.cause)
        evidence = self._evidence(watch, events)
        if existing is not None:
            old = existing.evidence
            since = old.since_unix_s if isinstance(old, DegradedEvidence) else None
            newer = evidence.since_unix_s
            if since is not None and newer is not None and since < newer:
                evidence.since_unix_s = since  # the fault began when it first began
            # Held with the pending bump; the incident takes it once the bump is stored.
            watch.pending_evidence = evidence
            watch.pending += len(events)
            watch.pending_events.extend(events)
            if now - watch.last_write_unix_s >= self.bump_interval_s:
                await self._flush(existing, watch, now)
            return
        summary = f"{node}: GPU {index} degrading: {'; '.join(evidence.causes)}"
        spec = IncidentSpec(
            kind=KIND,
            severity="warning",
            summary=summary[:500],
            dedupe_key=key,
            node=node,
            gpu_index=index,
            evidence=evidence,
        )
        watch.last_write_unix_s = now
        try:
            await self._incidents.open_or_bump(spec, count=1, events=events)
        except Exception:
            # Not stored: forget that the condition was seen, so the next sample that still
            # shows it is a new finding and the open is tried again.
            watch.ecc_active = watch.throttle_active = False
            raise
        log.warning(
            "gpu degrading",
            extra={"fields": {"node": node, "gpu": index, "causes": evidence.causes}},
        )

    def _evidence(self, watch: _Watch, events: list[EvidenceEvent]) -> DegradedEvidence:
        """The incident's evidence: each cause's numbers, and when the first one began."""
        evidence = DegradedEvidence(causes=[])
        causes = evidence.causes
        starts: list[float] = []
        if watch.ecc_active and watch.ecc_since_unix_s is not None:
            causes.append(f"{watch.ecc_sum} correctable ECC errors within {self.ecc_window_s:g} s")
            starts.append(watch.ecc_since_unix_s)
            evidence.ecc = EccCause(
                rise=watch.ecc_sum,
                threshold=self.ecc_rise,
                window_s=self.ecc_window_s,
                ecc_corrected_total=watch.ecc_last,
                since_unix_s=watch.ecc_since_unix_s,
            )
        if watch.throttle_active and watch.throttle_since_unix_s is not None:
            newest = next((e for e in reversed(events) if e.cause == "throttle"), None)
            reasons = (
                newest.reasons
                if newest is not None and newest.reasons is not None
                else _reason_names(_union(s[1] for s in watch.throttle))
            )
            temps = [s[2] for s in watch.throttle if s[2] is not None]
            last_t = watch.throttle[-1][0]
            hot = f" at {temps[-1]:.0f} °C" if temps else ""
            duration = last_t - watch.throttle_since_unix_s
            causes.append(f"{', '.join(reasons)} for {duration:.0f} s{hot}")
            starts.append(watch.throttle_since_unix_s)
            evidence.throttle = ThrottleCause(
                reasons=reasons,
                duration_s=round(duration, 1),
                min_duration_s=self.throttle_s,
                throttled_fraction=round(watch.throttle_bad / len(watch.throttle), 3),
                temperature_c=temps[-1] if temps else None,
                max_temperature_c=max(temps) if temps else None,
                since_unix_s=watch.throttle_since_unix_s,
            )
        if starts:
            evidence.since_unix_s = min(starts)
        return evidence

    async def _flush(self, incident: IncidentState, watch: _Watch, now: float) -> None:
        """Write the held-back bump; kept (and tried again at a tick) if it is not stored."""
        count, events, evidence = watch.pending, list(watch.pending_events), watch.pending_evidence
        watch.last_write_unix_s = now
        await self._incidents.open_or_bump(
            IncidentSpec(
                kind=KIND,
                severity="warning",
                summary=incident.summary,
                dedupe_key=incident.dedupe_key,
                node=incident.node,
                gpu_index=incident.gpu_index,
            ),
            count=count,
            events=events,
            evidence_update=evidence,
        )
        # Only what was flushed: a report may have added more while the write was waiting.
        watch.pending -= count
        watch.pending_events = watch.pending_events[len(events) :]
        if watch.pending_evidence is evidence:
            watch.pending_evidence = None

    # ------------------------------------------------------------------ time

    async def tick(self, now_unix_s: float) -> None:
        """Write held-back bumps, resolve recovered GPUs, forget GPUs of removed nodes."""
        for incident in list(self._state.incidents.values()):
            if incident.kind != KIND or incident.node is None or incident.gpu_index is None:
                continue
            watch = self._watches.get((incident.node, incident.gpu_index))
            if watch is None:
                # Opened before this controller started: recovery is timed from now on.
                watch = self._watches[(incident.node, incident.gpu_index)] = _Watch(
                    last_active_unix_s=now_unix_s, causes=_active_causes(incident.evidence)
                )
            if watch.pending and now_unix_s - watch.last_write_unix_s >= self.bump_interval_s:
                await self._flush(incident, watch, now_unix_s)
            await self._maybe_resolve(incident, watch, now_unix_s)
        for key in [k for k in self._watches if k[0] not in self._state.nodes]:
            if self._incidents.find_open(f"{KIND}:{key[0]}:{key[1]}") is None:
                del self._watches[key]

    def clear_after_s(self, causes: set[str]) -> float:
        """How long a GPU must report no condition before its incident is resolved."""
        windows = [self.ecc_window_s if c == "ecc" else self.throttle_s for c in causes]
        return self.clear_factor * max(windows or [self.ecc_window_s, self.throttle_s])

    async def _maybe_resolve(self, incident: IncidentState, watch: _Watch, now: float) -> None:
        if watch.ecc_active or watch.throttle_active or watch.last_active_unix_s is None:
            return
        if watch.last_seen_unix_s <= watch.last_active_unix_s:
            return  # no report since: absence of data is not recovery
        quiet_s = now - watch.last_active_unix_s
        clear_s = self.clear_after_s(watch.causes)
        if quiet_s < clear_s:
            return
        await self._incidents.resolve(
            incident, note=f"no ECC burst or hardware throttling for {quiet_s:.0f} s"
        )
        watch.causes.clear()  # once resolved: a failed resolution is tried again as it was


def _active_causes(evidence: IncidentEvidence) -> set[str]:
    """The causes an open incident's evidence holds numbers for (``ecc``, ``throttle``)."""
    if not isinstance(evidence, DegradedEvidence):
        return set()
    found = {"ecc": evidence.ecc, "throttle": evidence.throttle}
    return {cause for cause, numbers in found.items() if numbers is not None}


def _union(masks: Iterable[int]) -> int:
    bits = 0
    for mask in masks:
        bits |= mask
    return bits


def _reason_names(bits: int) -> list[str]:
    return [str(r) for r in wire.decode_throttle_reasons(bits)]


__all__ = ["DEGRADING", "KIND", "DegradedGpuDetector"]
