"""What a straggler verdict rests on, typed, so an operator can check that it is fair.

The incident's evidence JSON is ``StragglerEvidence.model_dump(mode="json")``: the culprit's
compute, collective-wait and step times next to its peers' (median, spread, steps counted),
the peer group it was compared with and why, whether times were normalized by the bytes
each rank moved, and how the verdict held over time (flagged steps, flaps).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from controller.logic.detection.c4d.peers import PeerBasis


class Normalization(StrEnum):
    """How a rank's compute time was turned into the ratio its verdict rests on."""

    #: Divided by the median compute of its peers in the same step.
    PEER_MEDIAN = "peer_median"
    #: Divided by what its peers' compute predicts for the bytes this rank moved (the peers
    #: moved different volumes: MoE all-to-all with uneven routing).
    BYTES = "bytes"
    #: A rank alone in its peer group: its compute relative to the rest of the job's median,
    #: divided by the same ratio over its own first steps (it has no peer to be compared
    #: with; ``compute_s.peers`` etc. then hold its own reference steps).
    OWN_HISTORY = "own_history"


class TimeStats(BaseModel):
    """Median and spread (median absolute deviation) of a window of values."""

    model_config = ConfigDict(frozen=True)

    median: float
    spread: float
    steps: int
    """How many step values went into it (for peers: all peers' steps pooled)."""


class Comparison(BaseModel):
    """The culprit's values beside its peers' (seconds, or bytes for ``bytes_moved``)."""

    model_config = ConfigDict(frozen=True)

    culprit: TimeStats
    peers: TimeStats


class PeerGroupEvidence(BaseModel):
    model_config = ConfigDict(frozen=True)

    label: str
    basis: PeerBasis
    role: str | None
    ranks: list[int]
    """Every rank of the group that was scored in the window (the culprit included)."""
    why: str


class StragglerEvidence(BaseModel):
    """Evidence of one straggler incident (also on its refreshes and its resolution)."""

    model_config = ConfigDict(frozen=True)

    rank: int
    node: str
    gpu_index: int | None
    slowdown_pct: float
    """Windowed median of the rank's compute over its peers', minus one, in percent."""
    step_cost_pct: float
    """Share of each step the job loses waiting for this rank, in percent."""
    score: float
    z: float
    """Standard errors the score lies above 1 (the group's pooled per-step noise)."""
    confidence: float
    window_steps: int
    peer_group: PeerGroupEvidence
    normalization: Normalization
    compute_s: Comparison
    collective_wait_s: Comparison
    step_time_s: Comparison
    bytes_moved: Comparison | None
    """Collective bytes per step, when the group's volumes differ (normalized by them)."""
    flagged_steps: int
    """Of the last ``of_steps`` compared steps, how many marked the rank slow."""
    of_steps: int
    flaps: int
    """Times the rank went back to slow after looking normal while the incident was open."""
    at_step: int | None = None
    """The job step whose comparison gave this reading (the step that completed the verdict
    when the incident opened): with ``flagged_steps`` it tells how many steps of data the
    verdict took, apart from the seconds its summaries spent on their way."""
    verdict: str

    def as_json(self) -> dict[str, object]:
        return self.model_dump(mode="json")
