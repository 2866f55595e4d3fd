"""Checkpoints that cost training almost nothing and load into any parallel layout.

The public face (everything else is private machinery behind it)::

    Checkpointer(CheckpointConfig(root=...), rank=, world_size=, sharding=)   save / load
    load(root, state, rank=)             restore a rank's own state (same layout)
    add_safe_globals([cls, ...])         allow your own types in loaded state (untrusted input)
    reshard(root, targets, sharding=)    fill this rank's tensors from any saved layout
    verify(root, step=)                  re-read every byte against its checksums
    CheckpointStore(root)                list, open, and set aside checkpoints
    ObjectStoreConfig(bucket=, ...)      the S3-compatible tier (CheckpointConfig.object_store)
    ShardingSpec, RuleSpec, ParallelLayout, ZeroPartition   where each shard belongs

A save runs four private stages, one module each: ``_snapshot`` (walk the state),
``_stage`` (copy to a reused host buffer), ``_write`` (data file, checksums, fsync),
``_commit`` (``MANIFEST.json``, ``latest``, retention); ``_persist`` drives write and
commit for one rank's part, ``_backends`` / ``_writer_process`` run it on a thread or in a
separate process, ``_engine`` holds :class:`Checkpointer`. Reading: ``_store`` (find and
verify), ``_skeleton`` (the state skeleton held to the manifest, for load and verify),
``_load``, ``_reshard``; ``_convert`` backs ``trainguard checkpoint convert``
(:mod:`checkpoint.cli`). The format is :mod:`checkpoint.manifest`; docs/checkpoint.md
specifies it and the commit protocol.

Importing this package does not import torch (the CLI and the writer process rely on it);
the torch-based names are loaded on first use.

Exceptions::

    CheckpointError
     ├── CheckpointConfigError      bad config or call; fix the code (also a ValueError)
     ├── CheckpointNotFoundError    no (complete) checkpoint where asked
     ├── CheckpointIncompleteError  never committed / a rank's part or manifest missing
     ├── CheckpointCorruptError     checksum, size, parse or field mismatch; names the file
     │                              and the field or tensor
     ├── CheckpointUntrustedError   the pickled state names a type not allowed; opt in
     ├── CheckpointLayoutError      fragments cannot be mapped onto the requested layout
     │    └── ShardingRuleError     rule spec invalid or a parameter matched no rule
     └── CheckpointWriteError       a save failed; temporary, the previous checkpoint stands
          └── CheckpointSupersededError  a newer run fenced the root; this writer stops
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoint._store import CheckpointStore, verify_checkpoint
from checkpoint.config import CheckpointConfig, ObjectStoreConfig
from checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointLayoutError,
    CheckpointNotFoundError,
    CheckpointSupersededError,
    CheckpointUntrustedError,
    CheckpointWriteError,
    ShardingRuleError,
)
from checkpoint.rules import ParallelLayout, RuleSpec

if TYPE_CHECKING:
    from checkpoint._engine import Checkpointer
    from checkpoint._load import Restored
    from checkpoint._reshard import ReshardResult
    from checkpoint._snapshot import ShardingHook
    from checkpoint.sharding import ShardingSpec, ZeroPartition

__all__ = [
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CheckpointSupersededError",
    "CheckpointUntrustedError",
    "CheckpointWriteError",
    "Checkpointer",
    "ObjectStoreConfig",
    "ParallelLayout",
    "ReshardResult",
    "Restored",
    "RuleSpec",
    "ShardingRuleError",
    "ShardingSpec",
    "ZeroPartition",
    "add_safe_globals",
    "load",
    "reshard",
    "verify",
]

_LAZY = {
    "Checkpointer": "checkpoint._engine",
    "Restored": "checkpoint._load",
    "ReshardResult": "checkpoint._reshard",
    "ShardingSpec": "checkpoint.sharding",
    "ZeroPartition": "checkpoint.sharding",
    "add_safe_globals": "checkpoint._snapshot",
}


def load(
    root: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    rank: int = 0,
    step: int | None = None,
    restore_rng: bool = True,
    object_store: ObjectStoreConfig | None = None,
    allowed_globals: Sequence[str | type | Callable[..., Any]] = (),
    trusted: bool = False,
) -> Restored:
    """Restore ``state`` (modules, optimizers, ... in place) as rank ``rank`` saved it.

    With ``step=None`` the newest complete checkpoint that loads is used; ``latest`` is
    only a hint, and every checkpoint passed over is named in ``Restored.skipped`` (and
    logged). With an explicit step its error is raised. With ``object_store`` a step
    without a good local copy is downloaded from the bucket (checksummed) into ``root``
    first; ``Restored.source`` says which tier was used.

    A checkpoint is untrusted input: its pickled state may name only containers, scalars,
    tensors, torch dtypes and NumPy arrays, plus ``allowed_globals`` (classes, functions
    or ``"module.name"``) and :func:`add_safe_globals`; anything else raises
    :class:`CheckpointUntrustedError` naming it. ``trusted=True`` allows any (plain pickle,
    which runs code a crafted file names: only for checkpoints you wrote).
    """
    from checkpoint._load import load_state
    from checkpoint._snapshot import allowing

    def one(s: int | None) -> Restored:
        with allowing(allowed_globals, trusted=trusted):
            return load_state(Path(root), state, rank=rank, step=s, restore_rng=restore_rng)

    if object_store is None:
        return one(step)
    from checkpoint._tier_restore import load_nearest

    restored, choice = load_nearest(Path(root), object_store, one, step=step)
    restored.source = choice.source
    restored.skipped = choice.skipped + restored.skipped
    return restored


def reshard(
    root: str | os.PathLike[str],
    targets: Mapping[str, Any],
    *,
    sharding: ShardingHook | None = None,
    step: int | None = None,
) -> ReshardResult:
    """Fill ``targets`` from a checkpoint saved in any layout (another world size, mesh,
    TP/DP split), reading only the byte ranges this rank needs. ``targets`` maps entry
    names to this rank's tensors or DTensors, or is the same mapping as given to ``save``
    (modules, optimizers with their state, e.g. an FSDP2 or tensor-parallel model): their
    tensors are filled in place."""
    from checkpoint._reshard import load_resharded

    return load_resharded(Path(root), targets, sharding=sharding, step=step)


def verify(
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    deep: bool = True,
    skipped: list[str] | None = None,
) -> int:
    """Check checkpoint ``step`` and return its step: manifests and sizes, and with ``deep``
    every byte against its CRC (and SHA-256) and each rank's state skeleton against its
    manifest as :func:`load` holds it (a tensor's name, dtype and shape; read without torch
    and without running anything the file names). Raises :class:`CheckpointError` naming
    the first problem: a step raised here is one :func:`load` passes over as damaged.

    Without ``step``: the checkpoint :func:`load` would resume from, found as it and
    ``trainguard checkpoint verify`` find it (committed steps newest first, ``latest`` only
    a hint): a damaged newer step is passed over, logged and appended to ``skipped`` as
    ``step N: why``, and the step returned is the older one that verified, because "will a
    restart resume, and from where" is the question. A non-empty ``skipped`` means progress
    since then is lost. When none verifies, :class:`CheckpointCorruptError` names them all.
    """
    return verify_checkpoint(Path(root), step=step, deep=deep, skipped=skipped)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
