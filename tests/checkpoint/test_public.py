"""The package's public face is pinned, and importing it does not import torch."""

from __future__ import annotations

import subprocess
import sys

import checkpoint

PUBLIC = {
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
}


def test_all_is_pinned_and_resolves() -> None:
    assert set(checkpoint.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(checkpoint, name) is not None


def test_package_import_is_torch_free() -> None:
    code = "import sys, checkpoint; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
