"""Guard rails that hold even when a rule says act.

A remediation engine that is wrong is worse than none: a bad detector threshold or a
fabric-wide event could otherwise cordon half the cluster in a minute, or restart a job in a
loop. Each guard answers "may I?" with ``None`` or a one-line reason that is recorded as the
skipped action's outcome, so an operator sees exactly which rail held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from controller.logic.remediation.rules import Guards


def isolated_in_window(
    isolated_since: Mapping[str, float | None],
    history: Iterable[tuple[str, float]],
    *,
    now_unix_s: float,
    window_s: float,
) -> tuple[set[str], set[str]]:
    """The nodes that count against an isolation budget of ``window_s``: those isolated now
    (``isolated_since``: node -> when, ``None`` when not isolated), and those remediation
    isolated within the window (``history``: (node, when) of its isolation actions), even
    if released since. Returns (every node counted, those of them not isolated now).

    Released isolations count because the budget bounds how much of the fleet remediation
    *drains* per window: counting only current isolations let a flapping fleet (isolate,
    release, isolate another) take out any number of nodes within one window. A node counts
    once however often it was isolated."""
    now = {n for n, t in isolated_since.items() if t is not None and now_unix_s - t <= window_s}
    before = {n for n, t in history if now_unix_s - t <= window_s} - now
    return now | before, before


def circuit_breaker(
    node: str,
    *,
    isolated_since: Mapping[str, float | None],
    known_nodes: int,
    now_unix_s: float,
    guards: Guards,
    history: Iterable[tuple[str, float]] = (),
) -> str | None:
    """Refuse to isolate ``node`` if that would put more than the allowed share of the
    cluster's nodes into isolation within the window: nodes isolated now, and nodes that
    remediation isolated within the window and that were released since
    (:func:`isolated_in_window`), ``node`` itself counted once."""
    counted, released = isolated_in_window(
        isolated_since, history, now_unix_s=now_unix_s, window_s=guards.isolation_window_s
    )
    total = len(counted | {node})
    limit = breaker_limit(guards, known_nodes)
    if total > limit:
        return (
            f"circuit breaker open: isolating {node} would make {total} of {known_nodes} "
            f"nodes isolated within {guards.isolation_window_s:.0f} s "
            f"(limit {guards.max_isolated_fraction:.0%} = {limit})" + released_note(released)
        )
    return None


def breaker_limit(guards: Guards, known_nodes: int) -> int:
    """How many nodes the circuit breaker lets be isolated within its window."""
    return int(guards.max_isolated_fraction * max(known_nodes, 1) + 1e-9)


def released_note(released: set[str]) -> str:
    """What a refusal adds when nodes not isolated now are part of its count (released
    since, or an isolation still under way): an operator looking at the fleet sees fewer
    isolated nodes than the refusal counts, and is told which."""
    if not released:
        return ""
    return f"; counted though not isolated now: {', '.join(sorted(released))}"


class RestartBudget:
    """At most ``max_restarts_per_job`` restarts of one job within the window.

    A job has an entry only while a restart of it is inside the window: :meth:`refuse` and
    :meth:`expire` drop the others, so the budget does not keep one entry for every job
    ever restarted (a new leader records the last 1000 restarts, of jobs long gone too).
    """

    def __init__(self) -> None:
        self._times: dict[str, deque[float]] = {}

    def refuse(self, job: str, now_unix_s: float, guards: Guards) -> str | None:
        times = self._times.get(job)
        while times and now_unix_s - times[0] > guards.restart_window_s:
            times.popleft()
        if times is not None and not times:
            del self._times[job]  # all outside the window: nothing left to count
        count = len(times) if times else 0
        if count >= guards.max_restarts_per_job:
            return (
                f"rate limit: job {job} was restarted {count} times in the last "
                f"{guards.restart_window_s:.0f} s (limit {guards.max_restarts_per_job})"
            )
        return None

    def record(self, job: str, now_unix_s: float) -> None:
        self._times.setdefault(job, deque()).append(now_unix_s)

    def count(self, job: str) -> int:
        return len(self._times.get(job, ()))

    def expire(self, now_unix_s: float, window_s: float) -> None:
        """Drop every job whose restarts are all older than ``window_s`` (run on the
        engine's tick: one look at each job's newest restart)."""
        old = [job for job, times in self._times.items() if now_unix_s - times[-1] > window_s]
        for job in old:
            del self._times[job]


def stale(updated_unix_s: float, now_unix_s: float, guards: Guards) -> str | None:
    age = now_unix_s - updated_unix_s
    if age > guards.stale_after_s:
        return (
            f"stale evidence: the incident was last updated {age:.0f} s ago "
            f"(limit {guards.stale_after_s:.0f} s)"
        )
    return None
