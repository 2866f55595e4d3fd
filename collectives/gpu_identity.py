"""Which GPU this rank runs on, in terms the node agent can match.

The agent (a DaemonSet that sees every GPU of the node) keys its NVML samples by the host's
NVML index. CUDA numbers devices relative to ``CUDA_VISIBLE_DEVICES``, which the Kubernetes
device plugin sets per pod (as indices or UUIDs), so a pod's CUDA device 0 is often host
GPU 5: the number alone would tie a straggler to the wrong GPU's readings. A GPU's UUID is
the same for CUDA and NVML, so the rank sends it too (``LocalHello.gpu_uuid``) and the agent
maps it to its own index (:mod:`agents.local_endpoint`).

The torch calls stay in :func:`gpu_uuid`; the spelling and the ``CUDA_VISIBLE_DEVICES``
parsing around them are pure functions, testable without a GPU.
"""

from __future__ import annotations

import logging
import os
import re
import uuid

import torch

log = logging.getLogger("trainguard.collectives")

#: A UUID as CUDA and NVML print it after their prefix: 8-4-4-4-12 hex digits.
_UUID_HEX = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_PREFIXES = ("GPU-", "MIG-")
#: The MIG naming of drivers before R470: ``MIG-GPU-<parent's UUID>/<GPU instance>/<compute
#: instance>``. It names the parent GPU outright.
_LEGACY_MIG = re.compile(
    r"^MIG-GPU-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/\d+/\d+$",
    re.IGNORECASE,
)


def gpu_index() -> int | None:
    """The NVML index this rank claims: ``TRAINGUARD_GPU_INDEX`` when a launcher that knows
    it set it, else CUDA's current device (relative to ``CUDA_VISIBLE_DEVICES``: the agent
    corrects it from :func:`gpu_uuid`), on CPU none."""
    given = os.environ.get("TRAINGUARD_GPU_INDEX", "")
    if given.isdigit():
        return int(given)
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def visible_entry(visible: str | None, device: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry that CUDA's ``device`` is ("" when unset or short).

    CUDA reads the list left to right, spaces around commas ignored; device k is entry k.
    """
    if not visible or device < 0:
        return ""
    entries = [e.strip() for e in visible.split(",")]
    return entries[device] if device < len(entries) else ""


def nvml_uuid(raw: object, entry: str = "") -> str:
    """NVML's spelling (``GPU-<hex>`` or ``MIG-<hex>``, lower case) of the UUID torch gives.

    ``raw`` is ``get_device_properties(d).uuid``: torch's ``_CUuuid`` (its ``bytes`` are the
    16 raw bytes, its ``str`` the bare 8-4-4-4-12 form without NVML's prefix), a
    ``uuid.UUID`` or a string. CUDA cannot say whether the device is a MIG instance; its
    ``CUDA_VISIBLE_DEVICES`` ``entry`` can (``MIG-...``). When ``raw`` is unreadable, a full
    UUID in ``entry`` is used; otherwise "" (the agent then keeps the rank's number).

    An entry in the naming of drivers before R470 (``MIG-GPU-<uuid>/<gi>/<ci>``) gives the
    parent GPU's UUID (``GPU-<uuid>``): those drivers' NVML names the instances the same
    way, so no ``MIG-<hex>`` the rank could send would match, and the parent is what the
    agent's samples are keyed by anyway.
    """
    legacy = _LEGACY_MIG.match(entry.strip())
    if legacy:
        return "GPU-" + legacy.group(1).lower()
    prefix = "MIG-" if entry.upper().startswith("MIG-") else "GPU-"
    text = _bare(raw)
    if text:
        return prefix + text
    given = entry.strip()
    head, bare = given[:4].upper(), given[4:].lower()
    return head + bare if head in _PREFIXES and _UUID_HEX.match(bare) else ""


def _bare(raw: object) -> str:
    """``raw`` as a bare lower-case 8-4-4-4-12 UUID, or "" when it is none."""
    packed = getattr(raw, "bytes", None)
    if packed is not None:
        try:
            return str(uuid.UUID(bytes=bytes(packed)))
        except (TypeError, ValueError):
            pass  # not 16 bytes: fall back to its text
    text = str(raw).strip().lower() if raw is not None else ""
    if text[:4].upper() in _PREFIXES:
        text = text[4:]
    return text if _UUID_HEX.match(text) else ""


def gpu_uuid() -> str:
    """The NVML UUID of this rank's current CUDA device; "" on CPU or when CUDA cannot say
    (instrumentation never fails a job over it: the agent then keeps the rank's number)."""
    if not torch.cuda.is_available():
        return ""
    try:
        device = torch.cuda.current_device()
        raw = torch.cuda.get_device_properties(device).uuid
    except (RuntimeError, AssertionError, AttributeError) as exc:
        log.warning("trainguard: cannot read this GPU's UUID (%s); sending its index only", exc)
        return ""
    return nvml_uuid(raw, visible_entry(os.environ.get("CUDA_VISIBLE_DEVICES"), device))


__all__ = ["gpu_index", "gpu_uuid", "nvml_uuid", "visible_entry"]
