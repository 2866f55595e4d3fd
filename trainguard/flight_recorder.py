"""PyTorch Flight Recorder dumps, read without torch: where the ranks of a hung job diverged.

Flight Recorder (``TORCH_FR_BUFFER_SIZE``) keeps each rank's last collectives per process
group; on a hang the ranks dump it (``collectives.flight``, on the controller's
``JobDumpTrace`` command). :func:`analyze` reads the dumps of all ranks and returns, per
process group, the collective (Flight Recorder's sequence id, op, sizes) where the ranks
diverged and which ranks never entered it. It lives here, apart from torch, because both
the job side (tests, benchmark) and the controller (which never imports torch) use it.
torch's own analysis (``torch.distributed.flight_recorder``) expects NCCL dumps that carry
process-group membership, which gloo's dumps lack (``pg_config`` is empty), so this one
reads the same dump format with membership given by the caller (the wrapper's groups).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Op names of the same collective as the wrapper and as backends record it. gloo runs
#: reduce_scatter as an all_reduce and records it so.
_FAMILY = {
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
    "recv_": "recv",
}
_BACKEND_ALIASES = {("reduce_scatter", "all_reduce")}


def family(op: str) -> str:
    """``gloo:all_gather`` / ``all_gather_single`` -> ``all_gather``."""
    name = op.rsplit(":", 1)[-1].strip().lower()
    return _FAMILY.get(name, name)


def same_collective(ours: str, theirs: str) -> bool:
    a, b = family(ours), family(theirs)
    return a == b or (a, b) in _BACKEND_ALIASES


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where one process group's ranks stopped agreeing."""

    group: str
    """torch's process-group name."""
    seq: int
    """Flight Recorder's per-group collective sequence id of the collective some ranks
    entered and others never did (all entered: the last one, none finished)."""
    op: str
    input_sizes: list[Any]
    output_sizes: list[Any]
    entered: list[int]
    missing: list[int]
    """Member ranks that never entered it (their last entry in this group is older)."""
    completed: bool | None
    """Whether any entering rank saw it complete (None: the backend does not say)."""
    time_created_ns: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "seq": self.seq,
            "op": self.op,
            "input_sizes": self.input_sizes,
            "output_sizes": self.output_sizes,
            "entered": self.entered,
            "missing": self.missing,
            "completed": self.completed,
        }


def analyze(
    dumps: Mapping[int, Mapping[str, Any]],
    members: Mapping[str, Sequence[int]] | None = None,
) -> list[Divergence]:
    """Per process group, the collective where the ranks' Flight Recorder buffers diverge,
    earliest first. ``members``: group name -> global ranks (Flight Recorder's own
    ``pg_config`` when it has them, else the wrapper's; else the ranks that dumped entries)."""
    last: dict[str, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for rank, data in dumps.items():
        for entry in data.get("entries", []):
            if entry.get("is_p2p"):
                continue
            group = str(entry["process_group"][0])
            prev = last[group].get(rank)
            if prev is None or entry["collective_seq_id"] > prev["collective_seq_id"]:
                last[group][rank] = entry
    out: list[Divergence] = []
    for group, by_rank in last.items():
        ranks = _members(group, dumps, members) or sorted(by_rank)
        dumped = [r for r in ranks if r in dumps]
        seqs = {r: int(by_rank[r]["collective_seq_id"]) if r in by_rank else 0 for r in dumped}
        top = max(seqs.values(), default=0)
        entered = sorted(r for r, s in seqs.items() if s == top)
        missing = sorted(r for r, s in seqs.items() if s < top)
        head = by_rank[entered[0]]
        done = [_completed(by_rank[r]) for r in entered]
        completed = None if any(d is None for d in done) else any(done)
        if not missing and completed is not False:
            continue  # in step: nothing stuck here
        out.append(
            Divergence(
                group=group,
                seq=top,
                op=str(head.get("profiling_name", "")),
                input_sizes=list(head.get("input_sizes", [])),
                output_sizes=list(head.get("output_sizes", [])),
                entered=entered,
                missing=missing,
                completed=completed,
                time_created_ns=min(int(by_rank[r].get("time_created_ns", 0)) for r in entered),
            )
        )
    out.sort(key=lambda d: d.time_created_ns)
    return out


def _members(
    group: str, dumps: Mapping[int, Mapping[str, Any]], members: Mapping[str, Sequence[int]] | None
) -> list[int]:
    if members and group in members:
        return sorted(members[group])
    for data in dumps.values():
        config = data.get("pg_config", {}).get(group) or {}
        raw = config.get("ranks", "[]")
        try:
            ranks = json.loads(raw) if isinstance(raw, str) else list(raw)
        except ValueError:
            continue
        if ranks:
            return sorted(int(r) for r in ranks)
    return []


def _completed(entry: Mapping[str, Any]) -> bool | None:
    state = str(entry.get("state", ""))
    if state == "completed" or entry.get("time_discovered_completed_ns"):
        return True
    if state in ("started",):
        return False
    return None  # gloo's entries stay "scheduled": completion is not recorded


__all__ = ["Divergence", "analyze", "family", "same_collective"]
