"""Which nodes the last preflight failed on: plain data in, a verdict per node out.

A node's *last* preflight decides (``trainguard preflight`` / ``POST
/api/v1/nodes/{name}/preflight``): a node that failed is kept out of every placement until a
newer preflight passes on it, the way an isolated node is. ``expired`` (the agent never
answered) is no verdict, so it neither excludes a node nor clears an earlier failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The command kind whose acks are preflight verdicts (``wire.RunPreflight``).
PREFLIGHT_KIND = "run_preflight"


@dataclass(frozen=True, kw_only=True, slots=True)
class PreflightVerdict:
    """The outcome of one finished preflight on one node."""

    node: str
    passed: bool
    #: The agent's reason (the failing checks when ``passed`` is false).
    reason: str
    #: When the agent finished the checks (seconds since the epoch).
    finished_unix_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class FinishedCommand:
    """What the verdicts need from a command row."""

    node: str
    kind: str
    status: str
    reason: str
    finished_unix_s: float | None


def verdict_of(command: FinishedCommand) -> PreflightVerdict | None:
    """The verdict a command carries, or ``None`` (another kind, unfinished or expired)."""
    if command.kind != PREFLIGHT_KIND or command.finished_unix_s is None:
        return None
    if command.status not in ("succeeded", "failed"):
        return None
    return PreflightVerdict(
        node=command.node,
        passed=command.status == "succeeded",
        reason=command.reason,
        finished_unix_s=command.finished_unix_s,
    )


def latest_verdicts(
    known: Mapping[str, PreflightVerdict], commands: Iterable[FinishedCommand]
) -> dict[str, PreflightVerdict]:
    """``known`` updated with every newer verdict found in ``commands`` (newest wins)."""
    out = dict(known)
    for command in commands:
        verdict = verdict_of(command)
        if verdict is None:
            continue
        held = out.get(verdict.node)
        if held is None or verdict.finished_unix_s >= held.finished_unix_s:
            out[verdict.node] = verdict
    return out


def failed_nodes(verdicts: Mapping[str, PreflightVerdict]) -> dict[str, str]:
    """Node -> the reason its last preflight failed, for every node whose last one failed."""
    return {node: v.reason for node, v in sorted(verdicts.items()) if not v.passed}


def describe_exclusions(failed: Mapping[str, str], considered: Iterable[str]) -> str:
    """The clause a placement's reason gains for the failed nodes it could have used."""
    named = [n for n in dict.fromkeys(considered) if n in failed]
    if not named:
        return ""
    return "not placed on " + "; ".join(
        f"{n} (last preflight failed: {failed[n] or 'no reason given'})" for n in named
    )


__all__ = [
    "PREFLIGHT_KIND",
    "FinishedCommand",
    "PreflightVerdict",
    "describe_exclusions",
    "failed_nodes",
    "latest_verdicts",
    "verdict_of",
]
