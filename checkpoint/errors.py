"""Every error the checkpoint package raises (the tree is drawn in ``checkpoint/__init__``).

Each class says whether retrying can help: a write that failed on I/O may succeed next step
(``CheckpointWriteError``), while a corrupt file or a layout that cannot be mapped stays
broken until a person acts (the others).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error raised by :mod:`checkpoint`."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A configuration or argument that can never work (fix the call, do not retry)."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint at all, or no complete one, where the caller looked."""


class CheckpointIncompleteError(CheckpointError):
    """A checkpoint whose commit never finished: a manifest or a rank's part is missing."""


class CheckpointCorruptError(CheckpointError):
    """Bytes on disk differ from what the manifest promised (checksum, size, parse error)."""


class CheckpointUntrustedError(CheckpointError):
    """A checkpoint's pickled state names a class or function outside the allowed set (a
    crafted file could run code through it). Not damage: allow the name explicitly
    (``load(..., allowed_globals=)``, ``checkpoint.add_safe_globals``) if you trust it."""


class CheckpointLayoutError(CheckpointError):
    """Saved fragments cannot be mapped onto the requested layout (shape, missing tensor)."""


class ShardingRuleError(CheckpointLayoutError):
    """A per-parameter rule spec is invalid, or a parameter matches no rule."""


class CheckpointWriteError(CheckpointError):
    """A save failed (I/O error, commit timeout). Temporary: the previous checkpoint stands
    and the next save may succeed."""


class CheckpointSupersededError(CheckpointWriteError):
    """A newer run of the job has fenced the checkpoint root: this (older) run's writer
    must not commit there any more. Final for that writer."""
