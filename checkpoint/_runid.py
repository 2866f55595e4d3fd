"""The default run id (the fence's, :mod:`checkpoint._commit`) of a multi-node torchrun.

On one node, torchrun's ``TORCHELASTIC_RESTART_COUNT`` names the start. Across nodes it does
not: each node's agent keeps its own count, and an agent that restarts its workers for
another node's failure or a membership change does not count it, so two ranks of one start
may hold different counts and a start may repeat the previous one's. Rank 0 therefore names
the start (``torchelastic-start<ns>-<TORCHELASTIC_RUN_ID>``: its clock, and never below
the stamp already in its root's fence, so starts stay ordered for ``_commit._newer`` even
on a node whose clock is behind) and one broadcast of a fixed 1 KiB tensor on the
default group hands it to every rank. That is one small collective per process (the result
is kept for the process's later ``Checkpointer``s), at construction, never per save.

Every rank must construct its ``Checkpointer`` (SPMD), after ``init_process_group``: a rank
that does not leaves the others waiting in the broadcast until the group's timeout. Where no
collective can run (no process group yet, a world of one, NCCL without CUDA, a broadcast
that fails) the id is what the environment alone gives (``_commit.default_run_id``: the
generation, or "" = no fence), as before, with one warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint._commit import (
    _DERIVED,
    default_run_id,
    elastic_run_id,
    multinode_torchrun,
    read_fence,
)

log = logging.getLogger(__name__)

#: Bytes broadcast: the longest id (generation, 19-digit stamp, 128-character run id, in
#: UTF-8) fits with room to spare.
WIDTH = 1024
#: The id this process's start agreed on (one broadcast per process).
_agreed: dict[str, str] = {}


def launcher_run_id(root: Path, env: Mapping[str, str] | None = None) -> str:
    """The run id of a ``Checkpointer`` given none: :func:`checkpoint._commit.default_run_id`,
    except on a multi-node torchrun, where it is rank 0's name for this start (module
    docstring); call it on every rank."""
    env = os.environ if env is None else env
    local = default_run_id(env)
    if not multinode_torchrun(env):
        return local
    if "id" in _agreed:
        return _agreed["id"]
    device, why = _collective_device()
    if device is None:
        fence = "generation only" if local else "not fenced"
        log.warning("multi-node torchrun, %s: checkpoint run id %r (%s)", why, local, fence)
        return local
    mine = _name_start(root, env, local) if dist.get_rank() == 0 else ""
    try:
        agreed = _broadcast(mine, device)
    except (RuntimeError, ValueError) as exc:  # a backend that cannot: as before, not a hang
        log.warning("checkpoint run id broadcast failed (%s): run id %r", exc, local)
        return local
    _agreed["id"] = agreed
    return agreed


def _collective_device() -> tuple[torch.device | None, str]:
    """Where the broadcast's tensor lives (CPU, or CUDA under a plain NCCL group), or None
    and why no collective can run."""
    if not dist.is_available():
        return None, "torch.distributed is not available"
    if not dist.is_initialized():
        return None, "no process group when the Checkpointer was made"
    if dist.get_world_size() < 2:
        return None, "a world of one rank"
    if str(dist.get_backend()) != "nccl":
        return torch.device("cpu"), ""
    if not torch.cuda.is_available():
        return None, "an NCCL group without CUDA"
    return torch.device("cuda", torch.cuda.current_device()), ""


def _name_start(root: Path, env: Mapping[str, str], local: str) -> str:
    """Rank 0's id for this start: after the generation (if any), a stamp from its clock,
    kept above the one its root's fence names for the same torchrun run."""
    rid = elastic_run_id(env)
    stamp = time.time_ns()
    try:
        seen = _DERIVED.match(read_fence(root))
    except (OSError, UnicodeDecodeError):  # unreadable: the claim will say so
        seen = None
    if seen is not None and seen[2] == "start" and seen[4] == rid:
        stamp = max(stamp, int(seen[3]) + 1)
    return "/".join(p for p in (local, f"torchelastic-start{stamp}-{rid}") if p)


def _broadcast(mine: str, device: torch.device) -> str:
    """Rank 0's ``mine`` on every rank: one fixed-size broadcast (no length exchange)."""
    data = mine.encode()
    buf = torch.zeros(WIDTH, dtype=torch.uint8)
    if 0 < len(data) <= WIDTH:  # else rank 0 sends nothing: every rank then fails alike
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=0)
    agreed = bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
    if not agreed:
        raise ValueError("rank 0 sent no run id")
    return agreed
