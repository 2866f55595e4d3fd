"""Restores from the object-storage tier: the nearest complete copy of a step (local first,
then the bucket's), verified by size and SHA-256 against the step's ``TIER.json`` before the
usual manifest chain loads it; and the per-step tier state ``checkpoint inspect`` shows.

Kept apart from the upload side (:mod:`checkpoint._tier`) so each module has one job: that
one writes copies, this one chooses and verifies them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from checkpoint._commit import committed_steps
from checkpoint._tier import TIER_DIR, _file_sha256, make_client, read_tier_state
from checkpoint._tier_bucket import TIER_RECORD, _error_code, _key, remote_steps
from checkpoint._write import fsync_dir
from checkpoint.config import ObjectStoreConfig
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
)
from checkpoint.manifest import MANIFEST_NAME, step_dir_name

log = logging.getLogger(__name__)


def _read_record(client: Any, cfg: ObjectStoreConfig, step: int) -> dict[str, Any]:
    key = _key(cfg, step, TIER_RECORD)
    where = f"s3://{cfg.bucket}/{key}"
    raw: Any
    try:
        raw = json.loads(client.get_object(Bucket=cfg.bucket, Key=key)["Body"].read())
    except ValueError as exc:
        raise CheckpointCorruptError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{where}: not a JSON object")
    files = raw.get("files")
    if raw.get("step") != step or not isinstance(files, dict) or MANIFEST_NAME not in files:
        raise CheckpointCorruptError(f"{where}: field step/files missing or wrong")
    for name, info in files.items():
        if (
            not isinstance(name, str)
            or "/" in name
            or name.startswith(".")
            or not isinstance(info, dict)
            or not isinstance(info.get("size"), int)
            or not isinstance(info.get("sha256"), str)
        ):
            raise CheckpointCorruptError(f"{where}: field files[{name!r:.40}] invalid")
    record: dict[str, Any] = raw
    return record


def _matches(path: Path, info: dict[str, Any], hashed: dict[tuple[int, ...], str]) -> bool:
    """``path`` is the file ``info`` describes (size, then SHA-256). ``hashed`` holds the
    digests already taken in this restore, by device, inode, size and mtime: a file checked
    again (a hard link of it included) is not read again, one replaced or rewritten is."""
    try:
        st = path.stat()
        if st.st_size != int(info["size"]):
            return False
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if ident not in hashed:
            hashed[ident] = _file_sha256(path)
    except OSError:
        return False
    return hashed[ident] == str(info["sha256"])


def _complete_copy(dest: Path, record: dict[str, Any], hashed: dict[tuple[int, ...], str]) -> bool:
    """``dest`` holds every file ``record`` lists, with its size and SHA-256 (another rank
    of this node restored the step first). Reads the files: only on a restore."""
    return (dest / MANIFEST_NAME).is_file() and all(
        _matches(dest / name, info, hashed) for name, info in sorted(record["files"].items())
    )


def download_step(client: Any, cfg: ObjectStoreConfig, step: int, root: Path) -> Path:
    """Fetch complete remote ``step`` into ``root/step-<n>`` (replacing a local copy),
    verifying every file's size and SHA-256 against ``TIER.json`` before it is moved in.
    Parts are fetched in parallel (``Range`` reads of ``part_bytes``). A file the local
    step directory already holds with the recorded size and SHA-256 (a node-local root's
    own parts) is linked, not fetched. Ranks of one node may restore at once: each fetches
    into a directory of its own, and the first complete copy moved in is the one kept."""
    record = _read_record(client, cfg, step)
    dest = root / step_dir_name(step)
    hashed: dict[tuple[int, ...], str] = {}  # each file is read for its SHA-256 once
    if _complete_copy(dest, record, hashed):
        return dest
    tmp = root / TIER_DIR / "restore" / f"{step_dir_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="ckpt-fetch") as pool:
        for name, info in sorted(record["files"].items()):
            key = _key(cfg, step, name)
            where = f"s3://{cfg.bucket}/{key}"
            size = int(info["size"])
            part = int(info.get("part_bytes") or cfg.part_bytes)
            path = tmp / name
            local = dest / name  # a node-local root already holds its own ranks' parts
            if name != MANIFEST_NAME and _matches(local, info, hashed):
                try:
                    os.link(local, path)
                except OSError:
                    shutil.copyfile(local, path)
                continue
            with open(path, "wb") as f:
                f.truncate(size)

            def fetch(
                start: int, key: str = key, path: Path = path, part: int = part, size: int = size
            ) -> None:
                end = min(start + part, size) - 1
                body = client.get_object(Bucket=cfg.bucket, Key=key, Range=f"bytes={start}-{end}")
                data = body["Body"].read()
                with open(path, "r+b") as out:
                    out.seek(start)
                    out.write(data)

            try:
                list(pool.map(fetch, range(0, size, part)) if size else [])
                head = client.head_object(Bucket=cfg.bucket, Key=key)
            except Exception as exc:
                if _error_code(exc) in ("404", "NoSuchKey", "InvalidRange"):
                    raise CheckpointIncompleteError(f"{where}: missing or short") from exc
                raise
            if int(head["ContentLength"]) != size or path.stat().st_size != size:
                raise CheckpointCorruptError(
                    f"{where}: {head['ContentLength']} bytes, TIER.json says {size}"
                )
            if not _matches(path, info, hashed):
                raise CheckpointCorruptError(f"{where}: SHA-256 differs from TIER.json")
            with open(path, "rb+") as synced:
                os.fsync(synced.fileno())
    if _complete_copy(dest, record, hashed):  # a rank of this node was faster
        shutil.rmtree(tmp, ignore_errors=True)
        return dest
    if (dest / MANIFEST_NAME).exists():  # a damaged complete copy: kept for forensics
        aside = root / TIER_DIR / "damaged" / f"{step_dir_name(step)}-{time.time_ns()}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        dest.rename(aside)
    else:  # a node-local root's own parts (linked into tmp above) or a torn save
        shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:  # another rank moved its copy in between the check and the rename
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete_copy(dest, record, hashed):
            raise
    fsync_dir(root)
    return dest


_UNUSABLE = (CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError)
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class TierChoice:
    """Which copy of which step :func:`load_nearest` used, and what it passed over."""

    step: int
    source: str
    skipped: list[str] = field(default_factory=list)


def load_nearest(
    root: Path,
    cfg: ObjectStoreConfig,
    try_load: Callable[[int], T],
    *,
    step: int | None = None,
    client: Any | None = None,
) -> tuple[T, TierChoice]:
    """Newest step first (or only ``step``), the nearest copy first: the local one, then
    the bucket's. ``try_load(step)`` loads a local step and raises
    :class:`CheckpointError` when it is damaged or incomplete; a damaged local copy is
    replaced by the remote one (after its checksums pass) and that is tried next."""
    client = client if client is not None else make_client(cfg)
    local = set(committed_steps(root))
    try:
        remote = set(remote_steps(client, cfg))
    except CheckpointError:
        raise
    except Exception as exc:  # the bucket unreachable: local copies still count
        log.warning("object store unreachable (%s: %s)", type(exc).__name__, exc)
        remote = set()
    steps = [step] if step is not None else sorted(local | remote, reverse=True)
    skipped: list[str] = []
    for candidate in steps:
        if candidate in local:
            try:
                return try_load(candidate), TierChoice(
                    step=candidate, source="local", skipped=skipped
                )
            except (
                CheckpointCorruptError,
                CheckpointIncompleteError,
                CheckpointNotFoundError,
            ) as exc:
                log.warning("local checkpoint step %d unusable: %s", candidate, exc)
                skipped.append(f"local step {candidate}: {exc}")
        if candidate in remote:
            try:
                download_step(client, cfg, candidate, root)
            except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
                log.warning("remote checkpoint step %d unusable: %s", candidate, exc)
                skipped.append(f"remote step {candidate}: {exc}")
                continue
            except CheckpointError:
                raise
            except Exception as exc:  # the network, the server: an older copy may still do
                message = f"{type(exc).__name__}: {exc}"
                log.warning("remote checkpoint step %d not fetched: %s", candidate, message)
                skipped.append(f"remote step {candidate}: not fetched ({message})")
                continue
            try:
                return try_load(candidate), TierChoice(
                    step=candidate, source="object_store", skipped=skipped
                )
            except _UNUSABLE as exc:
                log.warning("remote checkpoint step %d unusable: %s", candidate, exc)
                skipped.append(f"remote step {candidate}: {exc}")
    detail = "; ".join(skipped) if skipped else "none found"
    raise CheckpointNotFoundError(
        f"{root} and s3://{cfg.bucket}/{cfg.prefix}: no complete checkpoint ({detail})"
    )


def tier_rows(root: Path, remote: Mapping[int, bool] | None = None) -> dict[int, str]:
    """Per step, the object-store state for ``checkpoint inspect``: from the local journal
    (``uploaded``, ``uploading 3/7 parts``, ``failed: ...``, ``queued``), or from the bucket
    when ``remote`` (step -> complete) was listed."""
    out: dict[int, str] = {}
    for step, state in read_tier_state(root).items():
        text = state["state"]
        if text == "uploading":
            text = f"uploading {state['parts_done']}/{state['parts_total']} parts"
        elif text == "failed":
            text = f"failed: {state['error']}"[:80]
        out[step] = text
    if remote is not None:
        for step, complete in remote.items():
            out[step] = "uploaded" if complete else "incomplete"
    return out
