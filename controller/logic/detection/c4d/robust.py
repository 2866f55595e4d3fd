"""Robust statistics for comparing ranks: medians and MAD, with leave-one-out for small jobs.

Means and standard deviations are pulled by the very outlier we are looking for; the median
and the median absolute deviation are not. In a job of a handful of ranks even the median
moves with the outlier (with 2 ranks it is their mean), so there each rank is compared with
the median of its *peers* instead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from statistics import median

from controller.logic.detection.c4d.evidence import TimeStats

#: Scale factor that makes the MAD estimate the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826

#: Above this many ranks, one rank hardly moves the median, and leave-one-out (quadratic)
#: is not worth its cost.
LEAVE_ONE_OUT_MAX_RANKS = 16


def fmedian(values: Iterable[float]) -> float:
    """The median, without :func:`statistics.median`'s generality (it is called per rank per
    step: for small groups its overhead is most of the detector's cost)."""
    s = sorted(values)
    n = len(s)
    if not n:
        raise ValueError("median of no values")
    mid = n // 2
    # Halves first: two finite values near the float maximum (a hostile report's 1e308 s)
    # must not sum to inf, which turned a window's spread into NaN.
    return s[mid] if n % 2 else s[mid - 1] / 2 + s[mid] / 2


def mad(values: Iterable[float], center: float) -> float:
    return fmedian(abs(v - center) for v in values)


def peer_centers(values: Sequence[float]) -> list[float]:
    """For each value, the median of the values it is compared with (see
    :func:`peer_baselines`), in O(n log n): leave-one-out medians read off one sort."""
    n = len(values)
    if n < 2:
        return list(values)
    if n > LEAVE_ONE_OUT_MAX_RANKS:
        return [fmedian(values)] * n
    order = sorted(range(n), key=values.__getitem__)
    srt = [values[i] for i in order]
    pos = {idx: p for p, idx in enumerate(order)}
    m = n - 1
    lo, hi = (m - 1) // 2, m // 2
    out = []
    for i in range(n):
        p = pos[i]
        a = srt[lo if lo < p else lo + 1]
        b = srt[hi if hi < p else hi + 1]
        out.append((a + b) / 2)
    return out


def peer_baselines(values: Sequence[float]) -> list[tuple[float, float]]:
    """For each value, the (median, MAD) of the values it is compared with.

    Small groups: the median and MAD of the *other* values. Large groups: of all values.
    """
    n = len(values)
    if n < 2:
        return [(values[0], 0.0)] if n else []
    if n > LEAVE_ONE_OUT_MAX_RANKS:
        center = median(values)
        spread = mad(values, center)
        return [(center, spread)] * n
    out: list[tuple[float, float]] = []
    for i in range(n):
        peers = [v for j, v in enumerate(values) if j != i]
        center = median(peers)
        out.append((center, mad(peers, center)))
    return out


def robust_z(value: float, center: float, spread: float, floor: float) -> float:
    """How many robust standard deviations ``value`` lies above ``center``.

    ``floor`` bounds the scale from below (as an absolute value) so identical peers do not
    make any difference infinitely significant.
    """
    scale = max(MAD_TO_SIGMA * spread, floor, 1e-12)
    return (value - center) / scale


#: Weight of one step in the moving estimate of per-step noise (a memory of ~50 steps).
NOISE_ALPHA = 0.02


def window_stderr(
    windows: Sequence[deque[float]], scores: Sequence[float], sigma: float, steps: int
) -> tuple[float, float]:
    """Standard error of a windowed (log) score under the no-straggler hypothesis, and the
    moving noise estimate ``sigma`` updated with this step (the ``steps``-th).

    A rank's per-step ratio already holds both its own noise and its peers' median's,
    and one rank's ratios are independent across steps, so the median of ``n`` of them
    has a standard error of about 1.2533 * sigma / sqrt(n). Sigma is the typical
    deviation of a step's ratio from its rank's score (a MAD, so multi-x spikes do not
    inflate it), tracked as a slow moving average over steps: estimated from one window
    alone it shrinks exactly when a rank's ratios cluster by chance, which is also when
    its score looks extreme. The larger of the two estimates is used.
    """
    pairs = list(zip(windows, scores, strict=True))
    latest = [abs(q[-1] - score) for q, score in pairs]
    # A plain mean until the average has ~1/alpha steps behind it, then a moving one.
    weight = max(NOISE_ALPHA, 1 / steps)
    sigma += weight * (MAD_TO_SIGMA * fmedian(latest) - sigma)
    spread = [abs(x - score) for q, score in pairs for x in q]
    n = min(len(q) for q in windows)
    return 1.2533 * max(sigma, MAD_TO_SIGMA * fmedian(spread)) / math.sqrt(n), sigma


#: Ratios are clamped to this factor either way before their log is taken (see
#: :func:`log_ratio`).
LOG_RATIO_BOUND = 1e3


def log_ratio(ratio: float) -> float:
    """Natural log of a compute ratio. Step times are multiplicative and right-skewed, so
    their ratios are symmetric only in logs; a non-positive ratio (a zero compute time) is
    taken as a 1000x fast step rather than raising, and one beyond 1000x slow as 1000x slow.

    The upper bound keeps the scores finite: a rank reporting a compute time of 1e300 s
    (finite, so valid on the wire) gave a log-ratio near 690, and in a peer group of two
    ``math.exp`` of its window score plus the noise margin (and of the sporadic rule's
    noise limit) raised OverflowError on every tick, so the job's detector (hangs and
    crashes included) failed until the rank stopped (found by the fault-pattern sweep).
    A rank 1000x slower than its peers is flagged just the same."""
    bound = LOG_RATIO_BOUND
    return math.log(min(max(ratio, 1 / bound), bound))


def binom_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely ``k`` or more hits in ``n`` tries are
    by chance at the rate ``p`` (exact sum; ``n`` is a few tens of steps)."""
    if k <= 0:
        return 1.0
    if p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def window_of(store: dict[int, deque[float]], rank: int, size: int) -> deque[float]:
    """The rank's bounded window in ``store``, created empty on first use."""
    q = store.get(rank)
    if q is None:
        q = store[rank] = deque(maxlen=size)
    return q


def time_stats(values: list[float]) -> TimeStats:
    """Median and MAD of a window of times, for an incident's evidence."""
    if not values:
        return TimeStats(median=0.0, spread=0.0, steps=0)
    center = fmedian(values)
    return TimeStats(
        median=round(center, 6), spread=round(mad(values, center), 6), steps=len(values)
    )
