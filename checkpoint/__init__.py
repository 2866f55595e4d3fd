"""Checkpoints that cost training almost nothing and load into any parallel layout.

Faces: :class:`Checkpointer` (lazy asynchronous saves, restore), :class:`CheckpointStore`
(find, open and verify checkpoints), :class:`ShardingSpec` with :class:`RuleSpec`,
:class:`ParallelLayout` and :class:`ZeroPartition` (where each shard belongs globally),
:func:`load_resharded` (load into another layout), ``trainguard checkpoint``
(:mod:`checkpoint.cli`: inspect, verify, convert, import). The format and the commit
protocol are specified in docs/checkpoint.md.

Importing this package does not import torch (the CLI and the writer process rely on it);
the torch-based names are loaded on first use.

Exceptions::

    CheckpointError
     ├── CheckpointConfigError      bad config or call; fix the code (also a ValueError)
     ├── CheckpointNotFoundError    no (complete) checkpoint where asked
     ├── CheckpointIncompleteError  never committed / a rank's part or manifest missing
     ├── CheckpointCorruptError     checksum, size or parse mismatch; names file and tensor
     ├── CheckpointLayoutError      fragments cannot be mapped onto the requested layout
     │    └── ShardingRuleError     rule spec invalid or a parameter matched no rule
     └── CheckpointWriteError       a save failed; temporary, the previous checkpoint stands
          └── CheckpointSupersededError  a newer run fenced the root; this writer stops
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpoint.config import CheckpointConfig
from checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointLayoutError,
    CheckpointNotFoundError,
    CheckpointSupersededError,
    CheckpointWriteError,
    ShardingRuleError,
)
from checkpoint.rules import ParallelLayout, RuleSpec
from checkpoint.store import CheckpointReader, CheckpointStore

if TYPE_CHECKING:
    from checkpoint.engine import Checkpointer
    from checkpoint.reshard import ReshardResult, load_resharded
    from checkpoint.restore import Restored, load_state
    from checkpoint.sharding import ShardingSpec, ZeroPartition

__all__ = [
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointSupersededError",
    "CheckpointWriteError",
    "Checkpointer",
    "ParallelLayout",
    "ReshardResult",
    "Restored",
    "RuleSpec",
    "ShardingRuleError",
    "ShardingSpec",
    "ZeroPartition",
    "load_resharded",
    "load_state",
]

_LAZY = {
    "Checkpointer": "checkpoint.engine",
    "Restored": "checkpoint.restore",
    "load_state": "checkpoint.restore",
    "ReshardResult": "checkpoint.reshard",
    "load_resharded": "checkpoint.reshard",
    "ShardingSpec": "checkpoint.sharding",
    "ZeroPartition": "checkpoint.sharding",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
