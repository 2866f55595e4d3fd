"""The on-disk metadata: one manifest per rank and one global manifest, both JSON.

Each rank's manifest lists the tensors in that rank's data file (byte offset, size, dtype,
shape), a CRC-32 for every 4 MiB chunk of that file, and, for universal checkpoints, how
each tensor maps onto a global tensor.
The global ``MANIFEST.json`` lists every rank's files with their SHA-256 and size; it is
written last, by rank 0, and its existence is what makes a checkpoint complete. JSON rather
than pickle so that ``inspect`` can read a checkpoint without torch and without trusting it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from checkpoint.errors import CheckpointCorruptError

FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
#: Folder under the root that step directories of an abandoned timeline are moved into; not
#: ``step-*``, so loading, listing and retention never see what is in it.
ABANDONED_NAME = "abandoned"
#: File naming the run that owns the root (see :func:`checkpoint.storage.check_fence`).
FENCE_NAME = "FENCE"
#: Entry holding the pickled skeleton of the state (everything that is not a tensor).
SKELETON_ENTRY = "__skeleton__"


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def rank_data_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass(kw_only=True, slots=True)
class Piece:
    """A box of the global tensor and where its elements sit in the stored local tensor.

    The element at global index ``g`` (inside the box) lives at local element
    ``base + sum(strides[d] * (g[d] - offsets[d]))``. Row-major strides of the local shape
    describe an ordinary shard; global row-major strides describe a flat (ZeRO) partition.
    """

    offsets: list[int]
    shape: list[int]
    base: int
    strides: list[int]


@dataclass(kw_only=True, slots=True)
class GlobalMap:
    """Where a stored tensor belongs in the global (unsharded) state."""

    name: str
    shape: list[int]
    #: ``shard`` (pieces tile the tensor), ``replicate`` (every copy is whole and equal),
    #: ``partial`` (copies are summed, or averaged when ``reduce`` is ``avg``).
    placement: str = "shard"
    reduce: str = "none"
    pieces: list[Piece] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    global_map: GlobalMap | None = None


@dataclass(kw_only=True, slots=True)
class DataFileInfo:
    name: str
    size_bytes: int
    sha256: str
    chunk_bytes: int
    chunk_crc32: list[int]


@dataclass(kw_only=True, slots=True)
class RankManifest:
    step: int
    rank: int
    world_size: int
    layout: dict[str, int]
    data_file: DataFileInfo
    entries: list[Entry]
    created_unix_s: float
    #: The run (one start of the job) that wrote this part; "" when the writer names none.
    run_id: str = ""
    format_version: int = FORMAT_VERSION

    def entry(self, name: str) -> Entry:
        for item in self.entries:
            if item.name == name:
                return item
        raise KeyError(name)


@dataclass(kw_only=True, slots=True)
class RankRecord:
    rank: int
    manifest: str
    manifest_sha256: str
    data_file: str
    size_bytes: int
    sha256: str


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    world_size: int
    layout: dict[str, int]
    ranks: list[RankRecord]
    total_bytes: int
    created_unix_s: float
    format_version: int = FORMAT_VERSION


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_LEAVES = frozenset({int, float, str, bool, type(None)})


def plain(obj: Any) -> Any:
    """``dataclasses.asdict`` without its deep copies (which cost the writer ~1.5 ms of CPU
    per save for a manifest of a few dozen tensors): dataclasses become dicts, lists and
    tuples lists, everything else is shared, not copied."""
    kind = type(obj)
    if kind in _LEAVES:
        return obj
    if kind is list or kind is tuple:
        return [plain(v) for v in obj]
    if kind is dict:
        return {k: plain(v) for k, v in obj.items()}
    names = _FIELD_NAMES.get(kind)
    if names is None:
        if not is_dataclass(kind):
            return obj
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(kind))
    return {name: plain(getattr(obj, name)) for name in names}


def to_json_bytes(obj: Any) -> bytes:
    return json.dumps(plain(obj), sort_keys=True, separators=(",", ":")).encode()


def _piece(raw: dict[str, Any]) -> Piece:
    return Piece(
        offsets=[int(x) for x in raw["offsets"]],
        shape=[int(x) for x in raw["shape"]],
        base=int(raw["base"]),
        strides=[int(x) for x in raw["strides"]],
    )


def _global_map(raw: dict[str, Any] | None) -> GlobalMap | None:
    if raw is None:
        return None
    return GlobalMap(
        name=str(raw["name"]),
        shape=[int(x) for x in raw["shape"]],
        placement=str(raw["placement"]),
        reduce=str(raw["reduce"]),
        pieces=[_piece(p) for p in raw["pieces"]],
    )


def entry_from_dict(raw: dict[str, Any]) -> Entry:
    return Entry(
        name=str(raw["name"]),
        dtype=str(raw["dtype"]),
        shape=[int(x) for x in raw["shape"]],
        offset=int(raw["offset"]),
        nbytes=int(raw["nbytes"]),
        global_map=_global_map(raw.get("global_map")),
    )


def _load_json(path: Path, data: bytes | None = None) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_bytes() if data is None else data)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(f"{path}: manifest is not a JSON object")
    if raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format_version {raw.get('format_version')!r}, this reader knows "
            f"{FORMAT_VERSION}"
        )
    return raw


def parse_rank_manifest(path: Path, data: bytes | None = None) -> RankManifest:
    raw = _load_json(path, data)
    try:
        df = raw["data_file"]
        return RankManifest(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            layout={str(k): int(v) for k, v in raw["layout"].items()},
            data_file=DataFileInfo(
                name=str(df["name"]),
                size_bytes=int(df["size_bytes"]),
                sha256=str(df["sha256"]),
                chunk_bytes=int(df["chunk_bytes"]),
                chunk_crc32=[int(x) for x in df["chunk_crc32"]],
            ),
            entries=[entry_from_dict(e) for e in raw["entries"]],
            created_unix_s=float(raw["created_unix_s"]),
            run_id=str(raw.get("run_id", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: malformed rank manifest ({exc!r})") from exc


def parse_manifest(path: Path) -> Manifest:
    raw = _load_json(path)
    try:
        return Manifest(
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            layout={str(k): int(v) for k, v in raw["layout"].items()},
            ranks=[
                RankRecord(
                    rank=int(r["rank"]),
                    manifest=str(r["manifest"]),
                    manifest_sha256=str(r["manifest_sha256"]),
                    data_file=str(r["data_file"]),
                    size_bytes=int(r["size_bytes"]),
                    sha256=str(r["sha256"]),
                )
                for r in raw["ranks"]
            ],
            total_bytes=int(raw["total_bytes"]),
            created_unix_s=float(raw["created_unix_s"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: malformed manifest ({exc!r})") from exc
