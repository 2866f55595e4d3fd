"""Typed evidence of the job detectors' incidents (issue 13): hangs, crashes, NaN/Inf, slow
communication, slow links and stragglers, with what the controller adds to them.

The C4D detectors (:mod:`controller.logic.detection.c4d`) state a finding's evidence; the job
detection service adds ``nodes`` (every finding), the GPU cause of a straggler (``gpu``,
``causes``), the NIC suspects of slow communication (``nic``), the probe round that followed
a communication hang (``after_incident``); the Flight Recorder service adds
``flight_recorder`` to hangs. The shape of each kind is the one the detectors wrote since
they were introduced; fields added later have defaults so older rows load.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from controller.logic.detection.c4d.evidence import StragglerEvidence
from controller.logic.detection.incident_evidence import IncidentEvidence
from controller.logic.detection.nic_evidence import NicEvidence
from controller.logic.given import OnlyGiven


class JobEvidence(IncidentEvidence):
    """Common to every job incident: the nodes the finding named, and how sure it is."""

    #: The finding's nodes (added by the job detection service).
    nodes: list[str] | None = None
    #: 0..1: how unambiguous the evidence is (1: one culprit among clean peers).
    confidence: float | None = None


class StuckCall(OnlyGiven):
    """One collective some ranks are stuck in (``passed``: ranks already past it)."""

    model_config = ConfigDict(extra="allow")

    group: str
    seq: int
    op: str
    elapsed_s: float
    entered: list[int]
    passed: list[int]
    absent: list[int]


class FlightDivergence(BaseModel):
    """Where one process group's ranks stopped agreeing, per their Flight Recorder buffers
    (:class:`trainguard.flight_recorder.Divergence`)."""

    model_config = ConfigDict(extra="allow")

    group: str
    seq: int
    op: str
    input_sizes: list[object]
    output_sizes: list[object]
    entered: list[int]
    missing: list[int]
    completed: bool | None


class FlightRecorderEvidence(BaseModel):
    """What the ranks' PyTorch Flight Recorder dumps say, next to trainguard's verdict."""

    model_config = ConfigDict(extra="allow")

    divergences: list[FlightDivergence]
    verdict: str
    #: ``None``: no dump to compare with.
    agrees_with_trainguard: bool | None
    trainguard_ranks: list[int]
    dumps_from: list[int]
    dumps_missing: list[int]
    #: Rank (as a string) -> the dump's error.
    errors: dict[str, str]
    #: Rank (as a string) -> where the rank wrote its dump.
    paths: dict[str, str]

    def as_json(self) -> dict[str, object]:
        return self.model_dump(mode="json")


class FlightRecorderUpdate(IncidentEvidence):
    """What the Flight Recorder service merges into an open hang's evidence."""

    flight_recorder: FlightRecorderEvidence


class HangEvidence(JobEvidence, StuckCall):
    """``hang`` / ``comm_hang``: the longest-stuck call, every stuck call when there are
    several, and the Flight Recorder's reading once the ranks' dumps arrived."""

    BRIEF = ("op", "seq", "group", "absent", "confidence")

    stuck_calls: list[StuckCall] | None = None
    #: ``comm_hang``: why the link probe waits.
    probe: str | None = None
    #: ``hang``: the culprits wait for each other (collectives issued in different
    #: orders). The job's code, not a node: remediation restarts but never isolates.
    deadlock: bool | None = None
    flight_recorder: FlightRecorderEvidence | None = None


class RankCrashEvidence(JobEvidence):
    """``rank_crash``: how the rank died, and the ranks that died after it because of it."""

    BRIEF = ("exit_code", "signal", "error", "collateral_ranks", "confidence")

    exit_code: int | None
    #: The signal's name (``SIGKILL``), as the agent reports it (``wire.RankEvent.signal``).
    signal: str | None
    pid: int | None
    error: str | None
    #: The agent saw the process vanish without an exit record.
    disconnected: bool
    collateral_ranks: list[int]


class CommFailureEvidence(JobEvidence):
    """``comm_failure``: each rank's error (rank as a string) from inside a collective."""

    BRIEF = ("errors", "confidence")

    errors: dict[str, str | None]


class NonfiniteEvidence(JobEvidence):
    """``nonfinite``: the first collective whose input held NaN/Inf, and whose input it was."""

    BRIEF = ("step", "op", "origin_ranks", "bad_steps", "confidence")

    step: int
    op: str | None
    group: str | None
    seq: int | None
    origin_ranks: list[int]
    nonfinite_ranks: list[int]
    first_seq_by_rank: dict[str, int | None]
    nonfinite_calls_by_rank: dict[str, int | None]
    clean_ranks: int
    gpu_index: int | None
    #: Steps seen with NaN/Inf while the incident was open (added with rollback).
    bad_steps: int | None = None
    #: Origin rank -> the process group of its first poisoned call; set only when the
    #: origins' first calls are in different groups, whose sequence numbers cannot be
    #: ordered against each other (confidence is then below 1).
    origin_group_by_rank: dict[str, str] | None = None


class CommSlowEvidence(JobEvidence):
    """``comm_slow``: collective wait per step before and now, risen beyond what compute
    explains (balanced compute, or more than the stragglers account for)."""

    BRIEF = ("reference_wait_s", "wait_s", "confidence")

    reference_wait_s: float
    wait_s: float
    step_s: float
    nic: NicEvidence | None = None
    #: Seconds per step of the rise that open or candidate stragglers account for (their
    #: extra compute plus a noise margin); set only when some straggler was there.
    straggler_explained_s: float | None = None


class SlowLinkEvidence(JobEvidence):
    """``slow_link``: what the link probe round found (``scope``: rank, node, link, failed)."""

    BRIEF = ("scope", "median_gbps", "slow_pairs", "confidence")

    scope: str
    median_gbps: float
    slow_pairs: list[list[int]]
    #: ``"a-b"`` -> measured GB/s between ranks a and b.
    pair_gbps: dict[str, float]
    #: Pairs slow against their kind, but far less than ``slow_pairs``: not what the
    #: probe localizes (a rank common to a 16x and a 2x slow pair is not the culprit).
    marginal_pairs: list[list[int]] = Field(default_factory=list)
    nic: NicEvidence | None = None
    #: The dedupe key of the communication hang the probe ran after.
    after_incident: str | None = None


class GpuCauseFacts(OnlyGiven):
    """The straggler's GPU readings behind its likely causes
    (:func:`controller.logic.detection.cause.straggler_cause`)."""

    model_config = ConfigDict(extra="allow")

    sm_clock_mhz: float | None = None
    temperature_c: float | None = None
    throttle_reasons: list[str] = Field(default_factory=list)
    peer_sm_clock_mhz: float | None = None
    ecc_corrected_total: int | None = None


class _StragglerAdded(JobEvidence):
    BRIEF = ("rank", "slowdown_pct", "step_cost_pct", "confidence", "causes")

    #: The GPU readings behind ``causes``.
    gpu: GpuCauseFacts | None = None
    #: Likely causes in words (thermal throttling, a locked clock, ECC errors).
    causes: list[str] | None = None


class StragglerIncidentEvidence(_StragglerAdded, StragglerEvidence):
    """``straggler``: the detector's verdict (:class:`StragglerEvidence`) and its GPU cause."""

    model_config = ConfigDict(extra="allow", frozen=False)

    #: ``"group"``: a whole peer group slowed together (all of a node's ranks running one
    #: pipeline stage), compared with its own recent steps (:mod:`.group_slow`); ``rank``
    #: and ``node`` then name its first rank and its node(s), ``peer_group.ranks`` all of
    #: it. ``None``: one rank slower than its peers.
    scope: str | None = None
    #: ``scope="group"``: how the other groups' compute changed meanwhile, in percent
    #: (near 0: the slowdown is this group's, not the job's).
    others_change_pct: float | None = None


class LegacyStragglerEvidence(_StragglerAdded):
    """``straggler`` as written before peer groups (issue 16): ratios without the peers'."""

    slowdown_pct: float
    step_cost_pct: float
    gpu_index: int | None
    score: float
    window_steps: int


__all__ = [
    "CommFailureEvidence",
    "CommSlowEvidence",
    "FlightDivergence",
    "FlightRecorderEvidence",
    "FlightRecorderUpdate",
    "GpuCauseFacts",
    "HangEvidence",
    "JobEvidence",
    "LegacyStragglerEvidence",
    "NonfiniteEvidence",
    "RankCrashEvidence",
    "SlowLinkEvidence",
    "StragglerIncidentEvidence",
    "StuckCall",
]
