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
from typing import Any

#: Written by this version. 2 added ``Entry.stored_by`` (a replica written once, by the
#: rank named there); version 1 manifests (no such entries) are still read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: Granularity of the per-chunk CRCs: a resharding reader reads whole chunks, so smaller
#: chunks read less surplus; larger ones keep the rank manifest short (4 GiB -> 1,024 CRCs).
DEFAULT_CHUNK_BYTES = 4 << 20
#: Tensors start at a multiple of this in a data file (or right after the previous entry:
#: :func:`checkpoint._validate._check_layout`); every dtype's size divides it.
ENTRY_ALIGN_BYTES = 64
MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
#: Folder under the root that step directories of an abandoned timeline are moved into; not
#: ``step-*``, so loading, listing and retention never see what is in it.
ABANDONED_NAME = "abandoned"
#: File naming the run that owns the root (see :func:`checkpoint._commit.check_fence`).
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
    #: ``None``: the bytes are in this rank's data file at ``offset``. Otherwise the rank
    #: whose data file holds this tensor under the same name (data-parallel replicas are
    #: written once, :mod:`checkpoint._dedup`); ``offset`` is then 0.
    stored_by: int | None = None


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


def entry_from_dict(raw: dict[str, Any]) -> Entry:
    """An entry from the engine's own job message (trusted: the writer process reads what
    its trainer wrote); manifests on disk go through :func:`parse_rank_manifest`."""
    gmap = raw.get("global_map")
    return Entry(
        name=raw["name"],
        dtype=raw["dtype"],
        shape=list(raw["shape"]),
        offset=raw["offset"],
        nbytes=raw["nbytes"],
        stored_by=raw.get("stored_by"),
        global_map=None
        if gmap is None
        else GlobalMap(
            name=gmap["name"],
            shape=list(gmap["shape"]),
            placement=gmap["placement"],
            reduce=gmap["reduce"],
            pieces=[Piece(**p) for p in gmap["pieces"]],
        ),
    )
