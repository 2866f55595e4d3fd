"""Bucket-level helpers of the object-storage tier (keys, listing, deletion), shared by the
uploader (:mod:`checkpoint._tier`) and the restore side (:mod:`checkpoint._tier_restore`).
No torch here."""

from __future__ import annotations

import contextlib
from typing import Any

from checkpoint.config import ObjectStoreConfig
from checkpoint.manifest import step_dir_name

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
            if name.startswith("step-") and name[5:].isdigit():
                steps.append(int(name[5:]))
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
