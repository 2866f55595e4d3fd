"""The object-storage tier: background upload of committed checkpoints to an S3-compatible
bucket, per-tier retention, and restores that take the nearest good copy. No torch here.

Why this shape:

* Local disk is the first tier (durable in seconds); the upload starts only after rank 0's
  local commit, on a thread of its own, so training never waits on the network. The step's
  files are hard-linked into ``<root>/.tier/staging/`` when the upload is queued, so local
  retention may delete the step directory while its upload is still running.
* A file larger than ``part_bytes`` is a multipart upload whose parts go up in parallel.
  Each part carries ``Content-MD5`` (the server refuses a part damaged in transit) and the
  ETag returned must equal the part's MD5. The upload id and the parts sent are journaled
  in ``<root>/.tier/step-<n>.json``; an interrupted upload (process killed, network gone)
  resumes with ``ListParts`` on that id and re-sends only the parts the server does not
  hold with the right MD5.
* Every rank uploads its own files (``rank-<r>.bin``, ``rank-<r>.json``) from its own
  root, so a job's upload bandwidth grows with its nodes; rank ``r > 0`` then puts
  ``step-<n>/TIER-rank-<r>.json`` (its files' sizes and SHA-256). Rank 0 uploads its own
  files, waits for every peer's record, and only then uploads ``MANIFEST.json``.
* ``step-<n>/TIER.json`` is the remote commit point, written last: it lists every file with
  its size, part size and whole-file SHA-256. A step without it is incomplete and never
  restored from. A restore downloads every file, checks size and SHA-256 against it, then
  the usual manifest chain (MANIFEST.json -> rank manifests -> per-chunk CRC-32) when the
  step is loaded; on any mismatch the next complete copy is used.
* The bucket's prefix is fenced per run (:mod:`checkpoint._tier_fence`): an uploader of an
  earlier start stops before it replaces or deletes anything of a later start's.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint._commit import parse_step_name
from checkpoint._tier_bucket import (
    TIER_RECORD,
    _delete_prefix,
    _error_code,
    _key,
    list_step_prefixes,
    remote_manifest,
    remote_steps,
)
from checkpoint._tier_fence import BucketFence
from checkpoint._write import write_atomic
from checkpoint.config import ObjectStoreConfig
from checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointSupersededError,
)
from checkpoint.manifest import (
    MANIFEST_NAME,
    rank_data_name,
    rank_manifest_name,
    step_dir_name,
)

log = logging.getLogger(__name__)

#: Rank ``r > 0``'s record that its files of a step are in the bucket (``.format(r)``).
RANK_RECORD = "TIER-rank-{:05d}.json"
#: Local state of the tier under the checkpoint root (ignored by ``step-*`` scans).
TIER_DIR = ".tier"
_READ_BYTES = 8 << 20


def make_client(cfg: ObjectStoreConfig) -> Any:
    """An S3 client with credentials from boto3's default chain (environment, profile,
    web identity, instance metadata); nothing secret passes through trainguard."""
    try:
        boto3 = importlib.import_module("boto3")
        botocore_config = importlib.import_module("botocore.config")
    except ImportError as exc:
        raise CheckpointConfigError(
            "object_store needs boto3: pip install 'trainguard[s3]'"
        ) from exc
    session = boto3.session.Session(profile_name=cfg.profile, region_name=cfg.region)
    return session.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        config=botocore_config.Config(
            max_pool_connections=max(10, 2 * cfg.max_concurrency),
            retries={"max_attempts": 5, "mode": "standard"},
            # Our own Content-MD5 per part and SHA-256 per file; no extra trailer checksums
            # (not every S3-compatible server accepts them).
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _md5(data: bytes | memoryview) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


@dataclass(kw_only=True, slots=True)
class UploadStats:
    """What the uploader did since it started (read by tests, ``inspect`` and callers)."""

    steps_uploaded: list[int] = field(default_factory=list)
    parts_sent: int = 0
    parts_reused: int = 0
    bytes_sent: int = 0
    steps_dropped: int = 0
    errors: list[str] = field(default_factory=list)
    #: Steps refused by the bucket's fence: a later start owns the prefix.
    superseded: list[int] = field(default_factory=list)
    #: Object keys this uploader completed, in order (the commit records come last).
    keys: list[str] = field(default_factory=list)


class _Journal:
    """``<root>/.tier/step-<n>.json``: the upload state of one step, written atomically
    after every change that a resume needs (upload ids, parts sent)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.data: dict[str, Any] = {"step": step, "state": "queued", "files": {}}
        with contextlib.suppress(FileNotFoundError, ValueError):
            raw = json.loads(path.read_bytes())
            if isinstance(raw, dict) and raw.get("step") == step:
                self.data = raw

    def file(self, name: str) -> dict[str, Any]:
        files: dict[str, Any] = self.data.setdefault("files", {})
        entry: dict[str, Any] = files.setdefault(name, {})
        return entry

    def save(self) -> None:
        with self.lock:
            self.data["updated_unix_s"] = time.time()
            write_atomic(self.path, json.dumps(self.data, sort_keys=True).encode())


def read_tier_state(root: Path) -> dict[int, dict[str, Any]]:
    """The uploader's journal per step (``state``: queued, uploading, uploaded, failed,
    superseded; ``parts_done`` / ``parts_total``) as this node last wrote it."""
    out: dict[int, dict[str, Any]] = {}
    tier = root / TIER_DIR
    if not tier.is_dir():
        return out
    for path in tier.glob("step-*.json"):
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(path.read_bytes())
            if not isinstance(raw, dict) or not isinstance(raw.get("step"), int):
                continue
            files = raw.get("files", {})
            total = sum(int(f.get("parts_total", 0)) for f in files.values())
            done = sum(len(f.get("parts", {})) for f in files.values())
            out[raw["step"]] = {
                "state": raw.get("state", "?"),
                "parts_done": done,
                "parts_total": total,
                "error": raw.get("error", ""),
            }
    return out


class TierUploader:
    """Uploads committed steps of ``root`` to the bucket, one step at a time, on a thread.

    :meth:`submit` only hard-links the step's files and queues it (milliseconds); a step
    queued while another one waits replaces it (the newer one is what a restore wants), and
    :attr:`stats` counts it in ``steps_dropped``.
    """

    def __init__(
        self,
        root: Path,
        cfg: ObjectStoreConfig,
        *,
        client: Any | None = None,
        rank: int = 0,
        world_size: int = 1,
        on_state: Callable[[int, str, str], None] | None = None,
        local_commit: bool = True,
    ) -> None:
        """``rank``/``world_size``: this uploader sends rank ``rank``'s files; rank 0 also
        ``MANIFEST.json`` and the commit record, after the other ranks' records.
        ``local_commit=False`` (node-local roots): there is no local ``MANIFEST.json``;
        rank 0 builds it from the ranks' manifests in the bucket and reports
        ``committed`` once ``TIER.json`` is up.
        ``on_state(step, state, error)``: each change of a step's upload state
        (``upload_pending``, ``uploading``, ``uploaded``, ``upload_failed``), for the
        engine's ``CheckpointEvent``; called on the caller's or the uploader's thread."""
        cfg.validate()
        self._on_state = on_state
        self.root = Path(root)
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.local_commit = local_commit
        self.client = client if client is not None else make_client(cfg)
        self.stats = UploadStats()
        self._fence = BucketFence(self.client, cfg, claimant=rank == 0)
        self._submitted: set[int] = set()  # saved by this process, not leftovers
        # Ranks sharing a root keep their staging and journals apart; rank 0's stay where
        # ``inspect`` reads them.
        self.tier_dir = self.root / TIER_DIR / (f"rank-{rank:05d}" if rank else "")
        self.tier_dir.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self._queued: int | None = None
        self._active: int | None = None
        self._closed = False
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="ckpt-upload")
        self._thread = threading.Thread(target=self._loop, name="ckpt-tier", daemon=True)
        self._thread.start()
        self._resume_leftovers()

    # ------------------------------------------------------------------ queueing
    def _staging(self, step: int) -> Path:
        return self.tier_dir / "staging" / step_dir_name(step)

    def own_files(self) -> set[str]:
        """The files of a step this rank uploads."""
        own = {rank_data_name(self.rank), rank_manifest_name(self.rank)}
        return own | {MANIFEST_NAME} if self.rank == 0 and self.local_commit else own

    def submit(self, step: int) -> None:
        """Queue ``step`` for upload (rank 0: committed; others: this rank's part durable);
        cheap enough for a writer callback."""
        src = self.root / step_dir_name(step)
        staging = self._staging(step)
        staging.mkdir(parents=True, exist_ok=True)
        own = self.own_files()
        for path in src.iterdir():
            if path.is_file() and path.name in own:
                target = staging / path.name
                target.unlink(missing_ok=True)
                try:
                    os.link(path, target)
                except OSError:  # a file system without hard links: copy instead
                    shutil.copyfile(path, target)
        if not own <= {p.name for p in staging.iterdir()}:
            what = "not committed" if self.rank == 0 else f"rank {self.rank}'s part missing"
            raise CheckpointIncompleteError(f"{src}: {what}, nothing to upload")
        journal = _Journal(self.tier_dir / f"{step_dir_name(step)}.json", step)
        journal.save()
        self._submitted.add(step)
        self._enqueue(step)
        self._report(step, "upload_pending")

    def _report(self, step: int, state: str, error: str = "") -> None:
        if self._on_state is None:
            return
        try:
            self._on_state(step, state, error)
        except Exception:  # instrumentation never stops an upload
            log.exception("checkpoint upload state callback failed")

    def _enqueue(self, step: int) -> None:
        with self._cond:
            if self._queued is not None and self._queued != step:
                self._drop(self._queued)
            self._queued = step
            self._cond.notify_all()

    def _drop(self, step: int) -> None:
        self.stats.steps_dropped += 1
        log.info("checkpoint step %d: upload superseded by a newer step", step)
        shutil.rmtree(self._staging(step), ignore_errors=True)
        (self.tier_dir / f"{step_dir_name(step)}.json").unlink(missing_ok=True)
        self._report(step, "upload_failed", "superseded by a newer step before it was sent")

    def _resume_leftovers(self) -> None:
        """A previous process's unfinished upload (its staging still here) is queued again;
        its journal lets the parts already stored be reused."""
        staging_root = self.tier_dir / "staging"
        if not staging_root.is_dir():
            return
        steps = sorted(
            step for p in staging_root.iterdir() if (step := parse_step_name(p.name)) is not None
        )
        for step in steps:
            self._enqueue(step)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or uploading; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queued is not None or self._active is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self, *, wait: bool = True) -> None:
        if wait:
            self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=None if wait else 5.0)
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._queued is None:
                    return
                step, self._queued, self._active = self._queued, None, self._queued
            try:
                self.upload_step(step)
            except CheckpointSupersededError as exc:  # a zombie: final, not a failure
                log.warning("checkpoint upload refused: %s", exc)  # names the step, both runs
                self.stats.superseded.append(step)
            except Exception as exc:  # the upload is retried at the next start
                message = f"step {step}: upload failed ({type(exc).__name__}: {exc})"
                log.error("checkpoint %s", message)
                self.stats.errors.append(message)
            finally:
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    # ------------------------------------------------------------------ upload
    def upload_step(self, step: int) -> None:
        """Upload ``step`` from its staging directory, resuming from the journal; then
        write ``TIER.json`` and apply the bucket's retention."""
        staging = self._staging(step)
        journal = _Journal(self.tier_dir / f"{step_dir_name(step)}.json", step)
        journal.data["state"] = "uploading"
        journal.data.pop("error", None)
        journal.save()
        self._report(step, "uploading")
        try:
            own = step in self._submitted  # a leftover of an earlier process is not
            self._fence.begin(staging / rank_manifest_name(self.rank), step, own=own)
            names = sorted(p.name for p in staging.iterdir() if p.is_file())
            record: dict[str, Any] = {"step": step, "files": {}}
            for name in names:
                if name != MANIFEST_NAME:
                    record["files"][name] = self._upload_file(staging / name, step, name, journal)
            if self.rank == 0:  # the commit point only once every rank's files are there
                for peer in range(1, self.world_size):
                    record["files"].update(self._peer_files(step, peer))
                manifest = staging / MANIFEST_NAME
                if not self.local_commit:  # built from the ranks' manifests in the bucket
                    body = remote_manifest(self.client, self.cfg, step, staging, record["files"])
                    write_atomic(manifest, body)
                if not self.local_commit or MANIFEST_NAME in names:  # last: it publishes
                    record["files"][MANIFEST_NAME] = self._upload_file(
                        manifest, step, MANIFEST_NAME, journal
                    )
            record["uploaded_unix_s"] = time.time()
            self._put_record(step, record)
        except Exception as exc:  # superseded: the local copy stays, its staging too
            fenced = isinstance(exc, CheckpointSupersededError)
            journal.data["state"] = "superseded" if fenced else "failed"
            journal.data["error"] = f"{type(exc).__name__}: {exc}"[:500]
            journal.save()
            why = f"superseded: {exc}" if fenced else journal.data["error"]
            self._report(step, "upload_failed", why)
            raise
        journal.data["state"] = "uploaded"
        journal.save()
        if self.rank == 0 and not self.local_commit:
            self._report(step, "committed")  # the bucket is the only place it is complete
        self._report(step, "uploaded")
        shutil.rmtree(staging, ignore_errors=True)
        self.stats.steps_uploaded.append(step)
        self._forget_older_failures(step)
        if self.rank == 0:
            for gone in self.apply_retention(newest=step):  # the bucket's copy: gone
                self._report(gone, "deleted")

    def _put_record(self, step: int, record: dict[str, Any]) -> None:
        """Rank 0: ``TIER.json`` (the remote commit point); others: their rank record."""
        name = TIER_RECORD if self.rank == 0 else RANK_RECORD.format(self.rank)
        body = json.dumps(record, sort_keys=True, indent=1).encode()
        key = _key(self.cfg, step, name)
        self._fence.check(f"step {step}: {name} not uploaded")
        self.client.put_object(
            Bucket=self.cfg.bucket,
            Key=key,
            Body=body,
            ContentMD5=base64.b64encode(_md5(body)).decode(),
        )
        self.stats.keys.append(key)

    def _peer_files(self, step: int, peer: int) -> dict[str, Any]:
        """Rank ``peer``'s files of ``step`` as its record in the bucket lists them, polled
        until it appears (``peer_timeout_s``; a peer that dropped or failed this step)."""
        key = _key(self.cfg, step, RANK_RECORD.format(peer))
        deadline = time.monotonic() + self.cfg.peer_timeout_s
        while True:
            try:
                body = self.client.get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read()
                break
            except Exception as exc:
                if _error_code(exc) not in ("404", "NoSuchKey", "NotFound"):
                    raise
            if time.monotonic() > deadline:
                raise CheckpointIncompleteError(
                    f"s3://{self.cfg.bucket}/{key}: rank {peer}'s files of step {step} not in "
                    f"the bucket after {self.cfg.peer_timeout_s:g} s"
                )
            time.sleep(0.2)
        files = json.loads(body).get("files")
        own = {rank_data_name(peer), rank_manifest_name(peer)}
        if not isinstance(files, dict) or set(files) != own:
            raise CheckpointCorruptError(f"s3://{self.cfg.bucket}/{key}: not rank {peer}'s files")
        return files

    def _forget_older_failures(self, step: int) -> None:
        """Steps older than ``step`` whose upload failed are superseded: free their hard
        links (the bucket's retention removes their partial objects and uploads)."""
        staging_root = self.tier_dir / "staging"
        if not staging_root.is_dir():
            return
        for path in staging_root.iterdir():
            name = path.name
            staged = parse_step_name(name)
            if staged is not None and staged < step:
                shutil.rmtree(path, ignore_errors=True)
                (self.tier_dir / f"{name}.json").unlink(missing_ok=True)

    def _upload_file(self, path: Path, step: int, name: str, journal: _Journal) -> dict[str, Any]:
        size = path.stat().st_size
        sha = _file_sha256(path)
        key = _key(self.cfg, step, name)
        entry = journal.file(name)
        part_bytes = self.cfg.part_bytes
        if entry.get("sha256") not in (None, sha) or entry.get("part_bytes") not in (
            None,
            part_bytes,
        ):
            entry.clear()  # a different file under the same name: start over
        entry.update(size=size, sha256=sha, part_bytes=part_bytes)
        described = {"size": size, "sha256": sha, "part_bytes": part_bytes}
        if entry.get("done"):
            return described
        if size <= part_bytes:
            data = path.read_bytes()
            digest = _md5(data)
            self._fence.check(f"step {step}: {name} not uploaded")
            reply = self.client.put_object(
                Bucket=self.cfg.bucket,
                Key=key,
                Body=data,
                ContentMD5=base64.b64encode(digest).decode(),
                Metadata={"sha256": sha},
            )
            if reply.get("ETag", "").strip('"') != digest.hex():
                raise CheckpointCorruptError(f"s3://{self.cfg.bucket}/{key}: ETag mismatch")
            self.stats.parts_sent += 1
            self.stats.bytes_sent += size
            entry.update(parts_total=1, parts={"1": digest.hex()}, done=True)
            journal.save()
            self.stats.keys.append(key)
            return described
        count = -(-size // part_bytes)
        entry["parts_total"] = count
        stored = self._stored_parts(key, entry)
        if "upload_id" not in entry:
            reply = self.client.create_multipart_upload(
                Bucket=self.cfg.bucket, Key=key, Metadata={"sha256": sha}
            )
            entry["upload_id"] = reply["UploadId"]
            entry["parts"] = {}
            journal.save()
        upload_id = entry["upload_id"]
        parts: dict[str, str] = entry.setdefault("parts", {})
        parts.clear()
        parts.update({str(n): etag for n, etag in stored.items()})
        journal.save()

        def send(number: int) -> None:
            with open(path, "rb") as f:
                f.seek((number - 1) * part_bytes)
                data = f.read(part_bytes)
            digest = _md5(data)
            if stored.get(number) == digest.hex():
                self.stats.parts_reused += 1
                return
            reply = self.client.upload_part(
                Bucket=self.cfg.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ContentMD5=base64.b64encode(digest).decode(),
            )
            if reply.get("ETag", "").strip('"') != digest.hex():
                raise CheckpointCorruptError(
                    f"s3://{self.cfg.bucket}/{key}: part {number} ETag mismatch"
                )
            with journal.lock:
                parts[str(number)] = digest.hex()
                self.stats.parts_sent += 1
                self.stats.bytes_sent += len(data)
            journal.save()

        futures = [self._pool.submit(send, n) for n in range(1, count + 1)]
        errors = []
        for future in futures:
            try:
                future.result()
            except Exception as exc:  # wait for the others: their parts count on resume
                errors.append(exc)
        if errors:
            raise errors[0]
        self._fence.check(f"step {step}: {name} not completed")
        self.client.complete_multipart_upload(
            Bucket=self.cfg.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={
                "Parts": [
                    {"PartNumber": n, "ETag": f'"{parts[str(n)]}"'} for n in range(1, count + 1)
                ]
            },
        )
        head = self.client.head_object(Bucket=self.cfg.bucket, Key=key)
        if int(head["ContentLength"]) != size:
            raise CheckpointCorruptError(
                f"s3://{self.cfg.bucket}/{key}: {head['ContentLength']} bytes stored, {size} sent"
            )
        entry["done"] = True
        journal.save()
        self.stats.keys.append(key)
        return described

    def _stored_parts(self, key: str, entry: dict[str, Any]) -> dict[int, str]:
        """Parts the server holds for the journaled upload id (``ListParts``): part number ->
        MD5 hex. An upload id the server no longer knows is forgotten."""
        upload_id = entry.get("upload_id")
        if not upload_id:
            return {}
        stored: dict[int, str] = {}
        marker = 0
        try:
            while True:
                reply = self.client.list_parts(
                    Bucket=self.cfg.bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
                )
                for part in reply.get("Parts", []):
                    if int(part.get("Size", -1)) in (
                        self.cfg.part_bytes,
                        entry["size"] - (entry["parts_total"] - 1) * self.cfg.part_bytes,
                    ):
                        stored[int(part["PartNumber"])] = str(part["ETag"]).strip('"')
                if not reply.get("IsTruncated"):
                    break
                marker = int(reply["NextPartNumberMarker"])
        except Exception as exc:
            if _error_code(exc) not in ("NoSuchUpload", "404"):
                raise
            entry.pop("upload_id", None)
            return {}
        return stored

    # ------------------------------------------------------------------ retention
    def apply_retention(self, *, newest: int) -> list[int]:
        """Keep the ``keep_last`` newest complete steps in the bucket; delete older ones and
        incomplete ones older than ``newest`` (``TIER.json`` first, so a crash mid-delete
        leaves an incomplete step, never a "complete" one with missing objects). Each delete
        is fenced: a later start owning the prefix stops it (logged, not raised: the step
        just uploaded stands)."""
        complete = [s for s in remote_steps(self.client, self.cfg) if s <= newest]
        keep = set(sorted(complete)[-self.cfg.keep_last :]) | {newest}
        deleted = []
        for step in list_step_prefixes(self.client, self.cfg):
            if step in keep or step > newest:
                continue
            prefix = _key(self.cfg, step)
            if not self._fence.allows(f"step {step}: not deleted by retention"):
                break
            with contextlib.suppress(Exception):
                self.client.delete_object(Bucket=self.cfg.bucket, Key=prefix + TIER_RECORD)
            _delete_prefix(self.client, self.cfg.bucket, prefix)
            deleted.append(step)
            (self.tier_dir / f"{step_dir_name(step)}.json").unlink(missing_ok=True)
        return deleted
