"""A job's world size, as its ranks' recent reports agree on it.

Every step summary and ``started`` event carries the world size its rank runs with. A job
changes world size only by restarting (shrink or grow), so the value must be able to go
down as well as up; but one stray or hostile report must not decide it. The rule, used by
ingest (the job's public state), the C4D tracker and the dashboard's step recorder alike:

* each rank's latest claim counts once, and only while it is recent (``window_s``): ranks
  that stopped reporting (gone after a shrink) drop out of the vote;
* the world size is the one most recent claims agree on; a tie goes to the newest claim
  (so a restart's new size wins as soon as half of the ranks report it);
* with no recent claim the last decided value stands.
* a ``started`` event (a restart) of size W also drops the claims of ranks W and above:
  they cannot belong to the new run, so a shrink is followed at its first started rank.

A lone report disagreeing with the other ranks therefore never wins while they report.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

#: How long a rank's claim counts (s): well above an agent's flush interval, short enough
#: that ranks gone after a restart whose ``started`` events were lost soon stop counting.
CLAIM_WINDOW_S = 60.0


def outside_world(rank: int, world_size: int) -> bool:
    """A rank the job does not have: at or above its world size, once that is known (0:
    not yet). Rank numbers inside reports come from agents, which the wire cannot check
    against the world; what names such a rank is never blamed."""
    return 0 < world_size <= rank


@dataclass(slots=True)
class WorldSize:
    """O(1) per claim (amortised): a 16k-rank job sends 16k claims a step."""

    window_s: float = CLAIM_WINDOW_S
    value: int = 0
    #: rank -> (world size it claims, controller time of the claim), oldest first
    _claims: OrderedDict[int, tuple[int, float]] = field(default_factory=OrderedDict)
    _votes: Counter[int] = field(default_factory=Counter)
    #: world size -> arrival number of its newest claim (breaks ties)
    _newest: dict[int, int] = field(default_factory=dict)
    _order: int = 0
    #: no claim has a higher rank (an upper bound: pruning scans down to it once)
    _high_rank: int = -1

    def observe(self, rank: int, world_size: int, now_s: float, *, started: bool = False) -> int:
        """Count ``rank``'s claim at ``now_s``; returns the job's world size after it."""
        if started and self._high_rank >= world_size:
            span: Iterable[int] = range(world_size, self._high_rank + 1)
            if self._high_rank - world_size >= len(self._claims):  # a stray huge rank
                span = [r for r in self._claims if r >= world_size]
            for gone in span:
                claim = self._claims.pop(gone, None)
                if claim is not None:
                    self._drop(claim[0])
            self._high_rank = world_size - 1
        self._high_rank = max(self._high_rank, rank)
        old = self._claims.pop(rank, None)
        if old is not None:
            self._drop(old[0])
        self._order += 1
        self._claims[rank] = (world_size, now_s)
        self._votes[world_size] += 1
        self._newest[world_size] = self._order
        cutoff = now_s - self.window_s
        while self._claims:
            first = next(iter(self._claims.values()))
            if first[1] >= cutoff:
                break
            self._drop(self._claims.popitem(last=False)[1][0])
        votes, newest = self._votes, self._newest
        self.value = max(votes, key=lambda ws: (votes[ws], newest[ws]))
        return self.value

    def _drop(self, world_size: int) -> None:
        self._votes[world_size] -= 1
        if not self._votes[world_size]:
            del self._votes[world_size]
            del self._newest[world_size]
