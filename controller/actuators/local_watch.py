"""A local job whose ranks never met: relaunch its generation, as a pod restart would.

The ranks of a generation meet in ``init_process_group`` (rank 0 binds ``MASTER_PORT``, the
others connect). A rank that exits with an error before that (rank 0 finding its port
taken, an import failing on a loaded host) leaves the others waiting in the rendezvous for
its whole timeout, and no detector hears of it: the collectives wrapper speaks only once
the group exists. On Kubernetes the pod's restart policy starts such a rank again; here the
local actuator does, for the whole generation on a fresh port (the ranks already waiting
hold the old one), at most ``launch_retries`` times, and then says once that it gave up.

A failed launch is told apart from a crash of a running job by the ranks' own word: the
first ``started`` rank event after the launch (:class:`~trainguard.wire.RankEvent`, sent
through the agent) marks the generation *joined*, and a joined generation is never
relaunched here. A rank's exit is judged only after ``grace_s``, so an agent's report of a
crash right after the start (``started`` then ``exited``) reaches the controller first; and
only within ``window_s`` of the launch, so a job run without agents (no ``started`` ever
comes) is not relaunched for a crash an hour in.
"""

from __future__ import annotations

import signal
from pathlib import Path

from controller.actuators.local_launch import Generation, Rank, peek

#: How much of a rank's log is read for its last line.
_TAIL_BYTES = 4096


def launch_failure(
    gen: Generation, now_unix_s: float, *, window_s: float, grace_s: float
) -> tuple[Rank, int] | None:
    """The first rank of ``gen`` whose error exit counts as a failed launch, with its status."""
    if gen.stopped or gen.joined or gen.gave_up:
        return None
    for rank in gen.ranks:
        code = peek(rank.proc)
        if code is None or code == 0:
            continue
        seen = gen.failed_seen.setdefault(rank.rank, now_unix_s)
        if seen - gen.launched_unix_s > window_s:
            continue  # exited long after the launch: a crash of the job, not of its start
        if now_unix_s - seen >= grace_s:
            return rank, code
    return None


def describe_exit(code: int) -> str:
    """``exit code 1`` / ``signal SIGKILL``, as :mod:`subprocess` statuses read."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a rank's log, printable and bounded ("" if none)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    for line in reversed(tail.splitlines()):
        text = "".join(c if c.isprintable() else " " for c in line).strip()
        if text:
            return text[:limit]
    return ""


__all__ = ["describe_exit", "last_line", "launch_failure"]
