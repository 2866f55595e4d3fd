"""Bucket-level helpers of the object-storage tier (keys, listing, deletion), shared by the
uploader (:mod:`checkpoint._tier`) and the restore side (:mod:`checkpoint._tier_restore`).
No torch here."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

from checkpoint._commit import build_manifest, parse_step_name, rank_record
from checkpoint._validate import parse_rank_manifest
from checkpoint.config import ObjectStoreConfig
from checkpoint.errors import CheckpointCorruptError, CheckpointWriteError
from checkpoint.manifest import rank_manifest_name, step_dir_name, to_json_bytes

#: The remote commit record of one step, uploaded after every other object of the step.
TIER_RECORD = "TIER.json"


def _key(cfg: ObjectStoreConfig, step: int, name: str = "") -> str:
    prefix = cfg.prefix.strip("/")
    parts = [p for p in (prefix, step_dir_name(step), name) if p]
    return "/".join(parts) + ("" if name else "/")


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    for upload in uploads.get("Uploads", []):
        with contextlib.suppress(Exception):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )


def list_step_prefixes(client: Any, cfg: ObjectStoreConfig) -> list[int]:
    """Every ``step-*/`` prefix in the bucket, complete or not, oldest first."""
    prefix = cfg.prefix.strip("/")
    base = f"{prefix}/" if prefix else ""
    steps = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=cfg.bucket, Prefix=base, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"][len(base) :].rstrip("/")
            step = parse_step_name(name)  # a stray "step-²/" prefix is not a step
            if step is not None:
                steps.append(step)
    return sorted(steps)


def remote_steps(client: Any, cfg: ObjectStoreConfig) -> list[int]:
    """Steps with a ``TIER.json`` in the bucket (complete uploads), oldest first."""
    out = []
    for step in list_step_prefixes(client, cfg):
        try:
            client.head_object(Bucket=cfg.bucket, Key=_key(cfg, step, TIER_RECORD))
        except Exception as exc:
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                continue
            raise
        out.append(step)
    return out


def remote_manifest(
    client: Any, cfg: ObjectStoreConfig, step: int, staging: Path, files: dict[str, Any]
) -> bytes:
    """Rank 0 with node-local roots: ``MANIFEST.json`` of ``step`` from its own staged rank
    manifest and the other ranks' manifests in the bucket (each checked against the
    SHA-256 its rank recorded in ``files``), as the local commit would have written it.
    The parts must be of one run, one step and one world size."""
    own_path = staging / rank_manifest_name(0)
    own_bytes = own_path.read_bytes()
    own = parse_rank_manifest(own_path, own_bytes)
    records = {0: rank_record(own_path, own_bytes, own, 0, step=step, world_size=own.world_size)}
    for peer in range(1, own.world_size):
        name = rank_manifest_name(peer)
        key = _key(cfg, step, name)
        where = f"s3://{cfg.bucket}/{key}"
        data = client.get_object(Bucket=cfg.bucket, Key=key)["Body"].read()
        if hashlib.sha256(data).hexdigest() != files.get(name, {}).get("sha256"):
            raise CheckpointCorruptError(f"{where}: SHA-256 differs from rank {peer}'s record")
        part = parse_rank_manifest(Path(where), data)
        if part.run_id != own.run_id or part.layout != own.layout:
            raise CheckpointWriteError(
                f"{where}: run {part.run_id!r} layout {part.layout}, rank 0 has run "
                f"{own.run_id!r} layout {own.layout}: not one save"
            )
        records[peer] = rank_record(where, data, part, peer, step=step, world_size=own.world_size)
    return to_json_bytes(build_manifest(step, own.world_size, own.layout, records))
