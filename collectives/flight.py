"""PyTorch's Flight Recorder as evidence: dump it on request, compare with it, read a hang from it.

With ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``) set before the process
group is created, torch keeps the last N collectives of every process group of the rank in a
ring buffer, in C++, for gloo as for NCCL (this torch build records gloo collectives, not
gloo point-to-point). This module:

* :func:`dump` reads this rank's buffer (``torch._C._distributed_c10d._dump_fr_trace_json``;
  it works while the training thread is stuck in a collective: the shipping thread calls it
  when the controller's ``JobDumpTrace`` command arrives);
* :func:`compare` checks the wrapper against it: every collective Flight Recorder lists for a
  step must be in the recorder's calls of that step, with the same process group and the same
  per-group sequence number (the bench's ``collectives_seen_ratio``);
* :func:`analyze` reads the dumps of all ranks and returns, per process group, the collective
  (sequence id, op, sizes) where the ranks diverged and which ranks never entered it: the
  evidence a hang incident carries. torch's own analysis
  (``torch.distributed.flight_recorder``) expects NCCL dumps with process-group membership,
  which gloo's dumps lack (``pg_config`` is empty), so the analysis is ours, over the same
  dump format, with membership from the wrapper's groups.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.flight_recorder import Divergence, analyze, family, same_collective
from trainguard.wire import FlightRecorderDump

ENV_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(env.get(name, "").strip() not in ("", "0") for name in ENV_BUFFER)


def dump() -> dict[str, Any]:
    """This rank's Flight Recorder buffer (``{}`` entries when it is off)."""
    raw = torch._C._distributed_c10d._dump_fr_trace_json()  # type: ignore[attr-defined]
    data = json.loads(raw)
    data.setdefault("entries", [])
    return dict(data)


# ---------------------------------------------------------------------- comparison


@dataclass(frozen=True, slots=True)
class Call:
    """One call as the wrapper saw it, keyed the way Flight Recorder keys it."""

    step: int | None
    group: str
    """torch's process-group name."""
    seq: int
    op: str


@dataclass(slots=True)
class Comparison:
    listed: int = 0
    """Collectives Flight Recorder lists for the steps compared."""
    seen: int = 0
    """...of which the wrapper recorded the same (group, sequence number, op) in that step."""
    missing: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return None if not self.listed else self.seen / self.listed


def compare(
    calls: Iterable[Call],
    entries: Sequence[Mapping[str, Any]],
    windows_ns: Mapping[int, tuple[int, int]],
) -> Comparison:
    """Every collective Flight Recorder created within a step's wall-clock window must be
    among the wrapper's calls of that step (same group, same per-group seq, same op).

    Sequence numbers of a group count from its creation in Flight Recorder and from
    ``instrument()`` in the wrapper; the offset is read per group from the first compared
    step (a call missed there shows up as mismatches, never as a pass)."""
    by_step: dict[int | None, list[Call]] = defaultdict(list)
    for call in calls:
        by_step[call.step].append(call)
    listed: list[tuple[int, Mapping[str, Any]]] = []
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        t = int(entry.get("time_created_ns", 0))
        for step, (t0, t1) in windows_ns.items():
            if t0 <= t <= t1:
                listed.append((step, entry))
                break
    offsets: dict[str, int] = {}
    for step, entry in sorted(listed, key=lambda x: (x[0], int(x[1]["collective_seq_id"]))):
        group = str(entry["process_group"][0])
        if group in offsets:
            continue
        ours = sorted((c for c in by_step.get(step, []) if c.group == group), key=lambda c: c.seq)
        if ours:
            offsets[group] = int(entry["collective_seq_id"]) - ours[0].seq
    out = Comparison(listed=len(listed))
    for step, entry in listed:
        group = str(entry["process_group"][0])
        seq = int(entry["collective_seq_id"]) - offsets.get(group, 0)
        hit = [c for c in by_step.get(step, []) if c.group == group and c.seq == seq]
        if hit and same_collective(hit[0].op, str(entry.get("profiling_name", ""))):
            out.seen += 1
        else:
            out.missing.append(
                {
                    "step": step,
                    "group": group,
                    "seq": int(entry["collective_seq_id"]),
                    "op": entry.get("profiling_name", ""),
                }
            )
    return out


def compare_counts(ours: Counter[str], theirs: Counter[str]) -> Comparison:
    """Per op family: how many of the calls another source (the profiler's ``c10d::`` ops)
    lists the wrapper also recorded. For point-to-point traffic, which Flight Recorder does not
    record under gloo."""
    out = Comparison(listed=sum(theirs.values()))
    for op, n in theirs.items():
        got = min(n, ours.get(op, 0))
        out.seen += got
        if got < n:
            out.missing.append({"op": op, "listed": n, "seen": ours.get(op, 0)})
    return out


def profiler_ops(events: Iterable[Any]) -> Counter[str]:
    """Families of the ``c10d::`` operators in profiler events (every frontend reaches the
    process group through them)."""
    out: Counter[str] = Counter()
    for event in events:
        name = str(getattr(event, "name", ""))
        if name.startswith("c10d::"):
            op = name.removeprefix("c10d::").rstrip("_")
            if op == "recv_any_source":
                op = "recv"
            out[family(op)] += 1
    return out


__all__ = [
    "Call",
    "Comparison",
    "Divergence",
    "analyze",
    "compare",
    "compare_counts",
    "dump",
    "dump_record",
    "enabled",
    "family",
    "profiler_ops",
    "same_collective",
]


def dump_record(
    *,
    job: str,
    rank: int,
    command_id: str,
    groups: Mapping[str, str],
    group_ranks: Mapping[str, Sequence[int]],
    max_entries: int,
    dump_dir: str = "",
) -> FlightRecorderDump:
    """This rank's answer to a ``JobDumpTrace``: its buffer's newest entries, the members of
    its groups (gloo's dumps do not carry them) and, optionally, the full dump on disk."""
    import time
    from pathlib import Path

    pg_ranks = {name: sorted(group_ranks.get(gid, [])) for gid, name in groups.items()}
    record = FlightRecorderDump(
        job=job,
        rank=rank,
        command_id=command_id,
        time_unix_s=time.time(),
        enabled=enabled(),
        pg_ranks=pg_ranks,
    )
    if not record.enabled:
        record.error = f"Flight Recorder is off: set {ENV_BUFFER[0]} (e.g. 2000) in the job's env"
        return record
    try:
        data = dump()
    except Exception as exc:  # a torch without the dump: say so, do not fail the rank
        record.error = f"{type(exc).__name__}: {exc}"[:1024]
        return record
    entries = list(data.get("entries", []))
    record.entries = [dict(e) for e in entries[-max_entries:]]
    if dump_dir:
        path = Path(dump_dir) / f"fr-{job}-rank{rank}-{command_id}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"rank": rank, **data, "pg_ranks": pg_ranks}))
            record.path = str(path)
        except OSError as exc:
            record.error = f"could not write {path}: {exc}"[:1024]
    return record
