"""The link probe reports a pair's fastest timed round: a degraded link is slow in every
round, a busy host only in some (with the median of three, load on a shared machine hid the
slow link from the probe after a communication hang now and then). And a pair's rounds are
a pass over the pair list apart, so one burst of load cannot slow all of them."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from collectives.probe import late_results, run_probe
from trainguard.wire import JobLinkProbe


class _Transfer:
    """A finished send, or a receive that takes the next scripted time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self, _timeout: timedelta) -> bool:
        time.sleep(self.seconds)
        return True


def probe_pair(receive_s: list[float], link_delay_s: float = 0.0) -> float:
    rounds = iter(receive_s)

    def isend(*_args: Any, **_kw: Any) -> _Transfer:
        return _Transfer(0.0)

    def irecv(*_args: Any, **_kw: Any) -> _Transfer:
        return _Transfer(next(rounds))

    cmd = JobLinkProbe(id="p", job="j", at_step=1, pairs=[(0, 1)], size_bytes=1024)
    (result,) = run_probe(
        cmd,
        rank=0,
        world_size=2,
        isend=isend,
        irecv=irecv,
        link_delay_s=lambda _pair: link_delay_s,
        repeats=3,
    )
    assert result.ok and (result.src_rank, result.dst_rank) == (0, 1)
    return result.duration_s


def test_a_round_slowed_by_a_busy_host_does_not_make_the_link_look_slow() -> None:
    # Setup round, then three timed ones; two of them descheduled for 0.2 s.
    duration = probe_pair([0.0, 0.2, 0.0, 0.2])
    assert duration < 0.05  # the median would say 0.1 s one way


def test_a_degraded_link_is_slow_in_its_fastest_round_too() -> None:
    duration = probe_pair([0.0, 0.0, 0.0, 0.0], link_delay_s=0.06)
    assert duration >= 0.03  # 0.06 s per transfer, one way = round trip / 2


def test_one_burst_of_load_does_not_slow_every_round_of_a_pair() -> None:
    """Rank 0 leads two pairs; its 2nd-4th receives (in time order) are descheduled 0.2 s,
    a burst as long as three round trips. Back to back, those were all of (0, 1)'s timed
    rounds, and a healthy pair looked slow (a ring then blamed the rank between two slow
    pairs instead of the slow link, under make test's load)."""
    receives = iter([0.0, 0.2, 0.2, 0.2] + [0.0] * 4)

    def isend(*_args: Any, **_kw: Any) -> _Transfer:
        return _Transfer(0.0)

    def irecv(*_args: Any, **_kw: Any) -> _Transfer:
        return _Transfer(next(receives))

    cmd = JobLinkProbe(id="p", job="j", at_step=1, pairs=[(0, 1), (0, 2)], size_bytes=1024)
    results = run_probe(
        cmd,
        rank=0,
        world_size=3,
        isend=isend,
        irecv=irecv,
        link_delay_s=lambda _pair: 0.0,
        repeats=3,
    )
    assert [(r.src_rank, r.dst_rank, r.ok) for r in results] == [(0, 1, True), (0, 2, True)]
    assert max(r.duration_s for r in results) < 0.05  # a burst would make it >= 0.1 s


def test_a_rank_that_got_the_command_too_late_says_it_missed_the_round() -> None:
    """Not a failed transfer: the controller must neither wait for these pairs nor read
    them as a broken link (tests/controller/c4d/test_probe_rounds_again.py)."""
    cmd = JobLinkProbe(id="p", job="j", at_step=8, pairs=[(0, 1), (1, 2), (2, 0)])
    results = late_results(cmd, rank=1, step=9)
    assert [(r.src_rank, r.dst_rank) for r in results] == [(1, 2)]
    (late,) = results
    assert late.missed and not late.ok
    assert late.error == "probe command arrived at step 9, after at_step 8"
