"""Tunables of the job detectors, with the reasoning behind each default."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class C4DConfig:
    window_steps: int = 20
    """Steps kept per rank for straggler scores and job-wide wait statistics. A rank's score
    is the median of its last 20 per-step compute ratios: 20 steps average away ±20% per-step
    jitter, yet a 10% straggler crosses the median after ~10 steps."""

    straggler_min_slowdown: float = 0.05
    """A rank's score must exceed its peers' by at least this fraction. MegaScale's
    stragglers were ~10% slower; 5% catches them with margin."""

    straggler_z: float = 5.0
    """How many standard errors a rank's score must lie above its peers'. The standard
    error comes from the job's pooled per-step noise; 5 keeps healthy jobs of 2 to 32 ranks with
    ±20% per-step jitter free of false stragglers over 160,000 simulated steps."""

    straggler_scale_floor: float = 0.01
    """Lower bound of the spread estimate, as a fraction of the peers' score, so identical
    peers (MAD = 0) do not turn a 0.1% difference into an infinite z-score."""

    straggler_confirm_steps: int = 3
    """Steps (of the last ``straggler_confirm_of_steps``) a rank must look slow before a
    straggler opens; after that many calm steps in a row an open straggler counts as
    "looking normal", so its next slow phase is counted as a flap."""

    straggler_confirm_of_steps: int = 5
    """...out of this many recent compared steps (k-of-n): a rank that looks slow in 3 of
    its last 5 steps opens, so one noisy normal-looking step inside a slow phase does not
    restart the count, while 3 scattered flags in a long run do not add up."""

    straggler_clear_windows: int = 3
    """An open straggler resolves only after this many full windows (``window_steps``
    each) of consecutive calm steps: a node that flaps between slow and normal every few
    tens of steps stays one open incident (its flaps counted) instead of a new one per
    slow phase."""

    bytes_skew: float = 0.1
    """Peers whose collective bytes per step differ by more than this fraction (MoE
    all-to-all with uneven routing) are compared on compute normalized by bytes moved."""

    confirm_min_s: float = 5.0
    """Seconds on the controller's clock a slow-communication condition must persist,
    besides its steps, before it opens or clears: a few seconds of network contention
    should not start a probe round however short the steps. Stragglers do not use it: their
    persistence is counted in steps (``straggler_confirm_steps``, and the window median,
    which needs the rank slow in half of ``window_steps``), because summaries reach the
    controller in batches (an agent's report: 8 steps, or 1 s of a job with shorter steps,
    or its 5 s timer: ``agents.cadence``), so a rule in seconds measured the report timers,
    not the rank."""

    min_step_coverage: float = 0.9
    """Share of the job's ranks that must have reported a step before it is compared."""

    step_wait_s: float = 12.0
    """How long (controller clock, from a step's first summary) an incomplete step waits for
    its missing ranks' summaries. Agents report on their own timers with independent
    phases (5 s, sooner for step summaries of short steps), so one node's summaries of a
    step can arrive ~5 s after another's; two report intervals plus delivery margin keep
    such steps whole. A step is compared as soon as every rank reported it, so this wait
    costs nothing while all nodes report; it only bounds how long a silent node holds
    the comparison up (a rank having reported a later step does not end the wait: a
    retried batch from a spool can arrive after a newer one)."""

    max_pending_steps: int = 512
    """Bound on steps held waiting for late summaries (memory per job); the oldest is
    compared (or dropped) first when more arrive."""

    max_pending_records: int = 1_000_000
    """Bound on step summaries held waiting, all steps together (a summary with its peer
    list is ~0.5-1 KB, so a few hundred MB at most): a 16k-rank job with 0.1 s steps holds
    ~800k summaries over one 5 s report interval; beyond the bound the oldest steps are
    compared early rather than memory growing."""

    hang_timeout_s: float = 6.0
    """Floor on how long a collective must be stuck before the controller calls a hang.
    The rank's own watchdog already waits an adaptive time (5x the op's recent median,
    at least 2 s) before it reports the call; this floor guards against very short steps
    and keeps detection within ~10 s, against NCCL's default 10-minute timeout."""

    inflight_ttl_s: float = 30.0
    """An in-flight record not refreshed for this long is dropped (the rank moved on or its
    agent went away; the agent-silence detector covers the latter)."""

    comm_slow_factor: float = 0.5
    """The job-wide median collective wait must rise this fraction above its healthy
    reference (and by several standard errors of its noise) before a slow-communication
    finding opens."""

    comm_slow_min_step_share: float = 0.05
    """...and by at least this share of the step time: a rise too small to cost the job
    throughput is not worth a probe round."""

    comm_slow_window_steps: int = 8
    """Recent steps whose median wait is compared with the reference."""

    nonfinite_grace_s: float = 10.0
    """How long a NaN/Inf report waits for an earlier step's reports before its step is
    taken as the first (unless every rank already reported that step and the one before).
    Agents report every 5 s; twice that lets a slower node's summaries arrive."""

    probe_slow_fraction: float = 0.5
    """A probed pair is slow when its bandwidth is below this fraction of the median pair."""

    def __post_init__(self) -> None:
        if self.window_steps < 4:
            raise ValueError("window_steps must be at least 4")
        if not 0 < self.straggler_confirm_steps <= self.window_steps:
            raise ValueError("need 0 < straggler_confirm_steps <= window_steps")
        if self.straggler_confirm_of_steps < self.straggler_confirm_steps:
            raise ValueError("need straggler_confirm_of_steps >= straggler_confirm_steps")
        if self.straggler_clear_windows < 1:
            raise ValueError("straggler_clear_windows must be at least 1")
        if self.step_wait_s < 0 or self.max_pending_steps < 1 or self.max_pending_records < 1:
            raise ValueError(
                "step_wait_s must be >= 0, max_pending_steps and max_pending_records >= 1"
            )
        if not 0 < self.min_step_coverage <= 1:
            raise ValueError("min_step_coverage must be in (0, 1]")
        if self.hang_timeout_s <= 0 or self.inflight_ttl_s <= 0:
            raise ValueError("hang_timeout_s and inflight_ttl_s must be positive")
        if not 0 < self.probe_slow_fraction < 1:
            raise ValueError("probe_slow_fraction must be in (0, 1)")
