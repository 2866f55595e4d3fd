"""Guard rails that hold even when a rule says act.

A remediation engine that is wrong is worse than none: a bad detector threshold or a
fabric-wide event could otherwise cordon half the cluster in a minute, or restart a job in a
loop. Each guard answers "may I?" with ``None`` or a one-line reason that is recorded as the
skipped action's outcome, so an operator sees exactly which rail held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from controller.logic.remediation.rules import Guards


def circuit_breaker(
    node: str,
    *,
    isolated_since: Iterable[float | None],
    known_nodes: int,
    now_unix_s: float,
    guards: Guards,
) -> str | None:
    """Refuse to isolate ``node`` if that would put more than the allowed share of the
    cluster's nodes into isolation within the window."""
    recent = sum(
        1 for t in isolated_since if t is not None and now_unix_s - t <= guards.isolation_window_s
    )
    limit = int(guards.max_isolated_fraction * max(known_nodes, 1) + 1e-9)
    if recent + 1 > limit:
        return (
            f"circuit breaker open: isolating {node} would make {recent + 1} of {known_nodes} "
            f"nodes isolated within {guards.isolation_window_s:.0f} s "
            f"(limit {guards.max_isolated_fraction:.0%} = {limit})"
        )
    return None


class RestartBudget:
    """At most ``max_restarts_per_job`` restarts of one job within the window."""

    def __init__(self) -> None:
        self._times: dict[str, deque[float]] = {}

    def refuse(self, job: str, now_unix_s: float, guards: Guards) -> str | None:
        times = self._times.setdefault(job, deque())
        while times and now_unix_s - times[0] > guards.restart_window_s:
            times.popleft()
        if len(times) >= guards.max_restarts_per_job:
            return (
                f"rate limit: job {job} was restarted {len(times)} times in the last "
                f"{guards.restart_window_s:.0f} s (limit {guards.max_restarts_per_job})"
            )
        return None

    def record(self, job: str, now_unix_s: float) -> None:
        self._times.setdefault(job, deque()).append(now_unix_s)

    def count(self, job: str) -> int:
        return len(self._times.get(job, ()))


def stale(updated_unix_s: float, now_unix_s: float, guards: Guards) -> str | None:
    age = now_unix_s - updated_unix_s
    if age > guards.stale_after_s:
        return (
            f"stale evidence: the incident was last updated {age:.0f} s ago "
            f"(limit {guards.stale_after_s:.0f} s)"
        )
    return None
