"""The bucket's fence: which start of the job may still write under the object store's
prefix. No torch here.

Why: a zombie of the previous start (its node lost the network, an old pod not yet killed)
keeps its upload thread. Unfenced, it would put its step ``N``'s ``TIER.json`` over the
new start's ``N`` after a rollback, let its retention delete the new start's remote steps,
and resume journaled uploads over them. The local roots and the mirror are fenced
(:mod:`checkpoint._commit`); the bucket is shared by every node, so it needs its own.

Protocol: ``<prefix>/FENCE`` holds one run id. A step is written under the run id stamped
in its rank manifest (what the engine's ``run_id`` put there; a resumed leftover keeps the
id of the run that saved it). Rank 0's uploader claims the fence before the first upload
of a step its own process saved, in the order :func:`checkpoint._commit.join_fence` uses
(a fence naming a later start stops the claimant; an earlier start's fence is replaced);
another rank waits, up to ``peer_timeout_s``, until the fence names its run. Every rank's
uploader then reads the fence right before each request that replaces or deletes remote
data (a small object, a multipart completion, the rank and commit records, each retention
delete) and stops with :class:`CheckpointSupersededError` when it names another run. A
step with no run id ("") is never fenced, as before.

The window: S3 has no compare-and-swap across objects (and not every S3-compatible server
honours conditional writes), so a check and the write after it are two requests. A zombie
that read the fence just before the new start claimed it can still land the one object it
was about to write, one round trip late; its next check stops it. The new start's own
upload of that step replaces the object again (the commit record goes last), so the damage
lasts until then.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from checkpoint._commit import _newer
from checkpoint._tier_bucket import _error_code
from checkpoint.config import ObjectStoreConfig
from checkpoint.errors import CheckpointSupersededError
from checkpoint.manifest import FENCE_NAME

log = logging.getLogger(__name__)

_POLL_S = 0.2


def fence_key(cfg: ObjectStoreConfig) -> str:
    prefix = cfg.prefix.strip("/")
    return f"{prefix}/{FENCE_NAME}" if prefix else FENCE_NAME


def read_remote_fence(client: Any, cfg: ObjectStoreConfig) -> str:
    """The run that owns the bucket's prefix ("" when none has claimed it). Any other
    error (the network) propagates: the write it guards fails and is retried later."""
    try:
        body = client.get_object(Bucket=cfg.bucket, Key=fence_key(cfg))["Body"].read()
    except Exception as exc:
        if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return ""
        raise
    return bytes(body).decode("utf-8", "replace").strip()


def write_remote_fence(client: Any, cfg: ObjectStoreConfig, run_id: str) -> None:
    if not run_id or "\n" in run_id:
        raise ValueError(f"run_id must be a non-empty single line, got {run_id!r}")
    client.put_object(Bucket=cfg.bucket, Key=fence_key(cfg), Body=(run_id + "\n").encode())


def check_remote_fence(client: Any, cfg: ObjectStoreConfig, run_id: str, what: str) -> None:
    """Raise :class:`CheckpointSupersededError` if another run has claimed the prefix. No
    run id, or a prefix nobody claimed, passes (and costs no request without a run id)."""
    if not run_id:
        return
    owner = read_remote_fence(client, cfg)
    if owner and owner != run_id:
        raise CheckpointSupersededError(
            f"{what}: run {owner!r} has taken over s3://{cfg.bucket}/{cfg.prefix.strip('/')}; "
            f"this uploader's step belongs to run {run_id!r}, an earlier start, and stops"
        )


def join_remote_fence(
    client: Any, cfg: ObjectStoreConfig, run_id: str, *, claim: bool, what: str
) -> None:
    """The bucket's :func:`checkpoint._commit.join_fence`: ``claim`` (rank 0) writes
    ``run_id`` unless the fence names a later start; another rank waits up to
    ``peer_timeout_s`` for the fence to name its run (rank 0 claims only after its local
    commit, which waits for this rank's part), and stops at once on a later start's."""
    if not run_id:
        return
    deadline = time.monotonic() + cfg.peer_timeout_s
    while (owner := read_remote_fence(client, cfg)) and owner != run_id and not claim:
        if _newer(owner, run_id) or time.monotonic() > deadline:
            check_remote_fence(client, cfg, run_id, what)
        time.sleep(_POLL_S)
    if claim and owner != run_id:
        if _newer(owner, run_id):
            check_remote_fence(client, cfg, run_id, what)
        write_remote_fence(client, cfg, run_id)


def staged_run_id(manifest: Path) -> str:
    """The run id stamped in a staged rank manifest ("" when it has none or cannot be
    read: such a step is not fenced, as before)."""
    try:
        run_id = json.loads(manifest.read_bytes()).get("run_id", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return run_id if isinstance(run_id, str) else ""


class BucketFence:
    """One uploader's side of the fence: the run of the step being uploaded, and the runs
    it has already joined (once per run and uploader; rank 0's is the ``claimant``)."""

    def __init__(self, client: Any, cfg: ObjectStoreConfig, *, claimant: bool) -> None:
        self.client, self.cfg, self.claimant = client, cfg, claimant
        #: The run id of the step being uploaded ("" = not fenced).
        self.run_id = ""
        self._joined: set[str] = set()

    def begin(self, manifest: Path, step: int, *, own: bool) -> None:
        """Start uploading ``step``, of the run its staged rank ``manifest`` names.
        ``own``: saved by this process; a leftover of an earlier one is checked, but never
        claims the fence or waits for it (its run may be long gone)."""
        self.run_id = run_id = staged_run_id(manifest)
        what = f"step {step}: not uploaded"
        if run_id and own and run_id not in self._joined:
            join_remote_fence(self.client, self.cfg, run_id, claim=self.claimant, what=what)
            self._joined.add(run_id)
        self.check(what)

    def check(self, what: str) -> None:
        check_remote_fence(self.client, self.cfg, self.run_id, what)

    def allows(self, what: str) -> bool:
        """:meth:`check` for a step of work that may stop half done (retention): a refusal
        is logged once, here, and the caller stops."""
        try:
            self.check(what)
        except CheckpointSupersededError as exc:
            log.warning("checkpoint bucket: %s", exc)
            return False
        return True
