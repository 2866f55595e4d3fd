"""Loading a rank's own state back (same layout); resharding loads live in ``universal``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint._skeleton import read_entry
from checkpoint._snapshot import apply, rebuild
from checkpoint._store import CheckpointReader, CheckpointStore, open_candidate
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
)
from checkpoint.manifest import SKELETON_ENTRY, Entry

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Restored:
    step: int
    path: Path
    #: Values of ``state`` keys that were not stateful objects (data position, extras).
    values: dict[str, Any] = field(default_factory=dict)
    #: Checkpoints skipped as broken on the way, with the reason.
    skipped: list[str] = field(default_factory=list)
    #: Why ``latest`` was not followed (missing, garbage, naming an incomplete or older
    #: step); "" when it named the newest committed checkpoint or a step was asked for.
    latest_note: str = ""
    #: The tier the checkpoint came from: ``local`` or ``object_store``.
    source: str = "local"


def dtype_of(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"{where}: unknown dtype {name!r}")
    return dtype


def tensor_from_bytes(data: bytes, entry: Entry, where: str) -> torch.Tensor:
    dtype = dtype_of(entry.dtype, where)
    if not data:
        return torch.empty(entry.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(entry.shape)


def read_rank_tree(reader: CheckpointReader, rank: int) -> dict[str, Any]:
    """Every tensor and value rank ``rank`` saved, as one nested dict."""
    entries = reader.entries(rank)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = b""
    where = str(reader.path / reader.rank_manifest(rank).data_file.name)
    for entry in entries:
        data = read_entry(reader, rank, entry)
        if entry.name == SKELETON_ENTRY:
            skeleton = data
        else:
            tensors[entry.name] = tensor_from_bytes(data, entry, where)
    if not skeleton:
        raise CheckpointCorruptError(f"{where}: no state skeleton")
    return rebuild(skeleton, tensors, where=where)


def load_state(
    root: str | Path,
    state: Mapping[str, Any],
    *,
    rank: int = 0,
    step: int | None = None,
    restore_rng: bool = True,
) -> Restored:
    """Restore ``state`` in place from checkpoint ``step``, or from the newest one that loads.

    With ``step=None`` a newest checkpoint that does not open (damaged, never committed,
    removed since it was listed) or whose read fails (CRC mismatch, missing shard) is
    skipped with a warning and the previous complete one is used; with an explicit step the
    error is raised.
    """
    store = CheckpointStore(root)
    steps, note = ([step], "") if step is not None else store.resolve()
    skipped: list[str] = []
    for candidate in steps:
        opened = open_candidate(store, candidate, explicit=step is not None, skipped=skipped)
        if opened is None:
            continue
        try:
            with opened as reader:
                if rank >= reader.manifest.world_size:
                    raise CheckpointNotFoundError(
                        f"{reader.path}: saved by {reader.manifest.world_size} ranks, no rank "
                        f"{rank}; load it with checkpoint.reshard"
                    )
                tree = read_rank_tree(reader, rank)
                values = apply(tree, state, restore_rng=restore_rng, where=str(reader.path))
                if note or skipped:
                    log.warning("loaded checkpoint step %d (%s)", candidate, note or "fallback")
                return Restored(
                    step=candidate,
                    path=reader.path,
                    values=values,
                    skipped=skipped,
                    latest_note=note,
                )
        except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
            if step is not None:
                raise
            log.warning("skipping checkpoint step %d: %s", candidate, exc)
            skipped.append(str(exc))
    detail = "; ".join(skipped) if skipped else "none found"
    raise CheckpointNotFoundError(f"{root}: no complete checkpoint ({detail})")
