"""Link-probe rounds: what the job detector (:mod:`.jobs`) keeps about each round it runs.

A round is one ``job_link_probe`` command per node hosting the job, all naming the same
future step; it ends once every probed pair answered or its deadline passed. A round that
tells nothing or finds every link healthy while the incident that asked is still open runs
again (``MAX_PROBE_ROUNDS``). A communication hang's round waits for the job's next run
(:class:`DeferredProbe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Commands reach ranks at the agent's next report reply, then the ranks' next poll, so a
#: probe is scheduled this many seconds of training ahead (at least ``MIN_LEAD_STEPS``);
#: the default of the ``probe_lead_s`` setting.
PROBE_LEAD_S = 15.0
MIN_LEAD_STEPS = 5
#: A probe round that has not heard back from every pair this long after its step is
#: localized from what arrived (missing pairs are treated as failed transfers).
PROBE_DEADLINE_S = 60.0
#: A round that told nothing (no rank ran it: each got the command after its step; or no
#: answer came) or found every link healthy, while the incident that asked for it is still
#: open, runs again with twice the lead, up to this many rounds in all: one unlucky round
#: (a loaded host, a late command) must not leave slow communication unlocalized for good.
MAX_PROBE_ROUNDS = 3
#: A communication hang's deferred probe is dropped if the job has not run again by then.
DEFERRED_PROBE_TTL_S = 6 * 3600.0


@dataclass(slots=True)
class ProbeRound:
    job: str
    round_id: str
    at_step: int
    pairs: tuple[tuple[int, int], ...]
    deadline_unix_s: float
    command_ids: set[str] = field(default_factory=set)
    seen_pairs: set[tuple[int, int]] = field(default_factory=set)
    #: Pairs whose source rank never ran the probe (its command came after ``at_step``):
    #: answered, so the round need not wait for them, but no evidence about the link.
    missed_pairs: set[tuple[int, int]] = field(default_factory=set)
    #: Incident key of the communication hang this round follows up (deferred rounds).
    after: str | None = None
    #: What the round is for, and the incident that asked for it (``None``: a deferred
    #: round, whose hang incident the restart closed): a later round runs only while it is
    #: open.
    reason: str = ""
    source: str | None = None
    attempt: int = 1
    lead_s: float = PROBE_LEAD_S
    #: ``pairs`` as a set: each answer is checked against it (up to 100,000 pairs).
    asked: frozenset[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.asked = frozenset(self.pairs)


@dataclass(slots=True)
class DeferredProbe:
    """A communication hang's probe, waiting for the job's next run."""

    job: str
    hang_key: str
    hang_summary: str
    #: The tracker's incarnation when the hang was seen; the probe runs in a later one.
    incarnation: int
    expires_unix_s: float
