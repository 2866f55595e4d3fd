"""Reading manifests from disk: every field of every manifest is checked before use.

A manifest is data from a file that a crash, a bad disk, a careless script or an older
writer may have damaged, so nothing in it is trusted: every field must be present, of its
JSON type (an integer is not a bool or a float), in range (no negative offset, no size past
the data file, no 2**70-element shape, no NaN time), and consistent with its neighbours
(``nbytes`` = elements x dtype size, one CRC per chunk, file names that are the names this
format gives, ``ranks[i].rank == i``, entries of one data file in order, aligned and not
overlapping: :func:`_check_layout`). A failure is a :class:`CheckpointCorruptError` naming
the file and the field (``.../MANIFEST.json: field ranks[1].size_bytes: ...``), which the
loaders treat like any damaged checkpoint: skipped in favour of the previous complete one.
No torch here (``inspect`` uses it).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, NoReturn

from checkpoint.errors import CheckpointCorruptError
from checkpoint.geometry import row_major_strides, unravel
from checkpoint.manifest import (
    ENTRY_ALIGN_BYTES,
    READABLE_VERSIONS,
    SKELETON_ENTRY,
    DataFileInfo,
    Entry,
    GlobalMap,
    Manifest,
    Piece,
    RankManifest,
    RankRecord,
    rank_data_name,
    rank_manifest_name,
)

#: Bytes per element of every dtype a checkpoint may hold (``torch.<name>``).
DTYPE_BYTES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
#: Upper bounds that no real checkpoint reaches and that keep arithmetic on them cheap.
MAX_BYTES = 1 << 50  # 1 PiB per file
MAX_DIM = 1 << 48
MAX_NDIM = 32
MAX_WORLD = 1 << 20
MAX_STEP = 10**12 - 1  # step directories have 12 digits
MAX_ITEMS = 10_000_000
_HEX64 = re.compile(r"[0-9a-f]{64}")
PLACEMENTS = ("shard", "replicate", "partial")
REDUCES = ("none", "sum", "avg")


class _Fields:
    """Typed access to one JSON object; errors name ``file: field path``."""

    def __init__(self, path: Path, raw: Any, where: str = "") -> None:
        self.path = path
        self.where = where
        if not isinstance(raw, dict):
            self.fail("", f"expected an object, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw

    def name(self, key: str) -> str:
        if not key:
            return self.where or "(top level)"
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> NoReturn:
        raise CheckpointCorruptError(f"{self.path}: field {self.name(key)}: {message}")

    def get(self, key: str) -> Any:
        if key not in self.raw:
            self.fail(key, "missing")
        return self.raw[key]

    def integer(self, key: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
        return _int(self, key, self.get(key), lo, hi)

    def string(self, key: str, max_len: int = 4096) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {type(value).__name__}")
        if len(value) > max_len:
            self.fail(key, f"longer than {max_len} characters")
        return value

    def time(self, key: str) -> float:
        value = self.get(key)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            self.fail(key, f"expected a finite non-negative number, got {value!r:.40}")
        return float(value)

    def items(self, key: str, max_len: int = MAX_ITEMS) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list):
            self.fail(key, f"expected a list, got {type(value).__name__}")
        if len(value) > max_len:
            self.fail(key, f"more than {max_len} items")
        return value

    def integers(self, key: str, lo: int, hi: int, max_len: int = MAX_NDIM) -> list[int]:
        return [
            _int(self, f"{key}[{i}]", v, lo, hi) for i, v in enumerate(self.items(key, max_len))
        ]

    def sub(self, key: str, raw: Any) -> _Fields:
        return _Fields(self.path, raw, self.name(key))

    def layout(self, key: str) -> dict[str, int]:
        value = self.get(key)
        if not isinstance(value, dict) or len(value) > 64:
            self.fail(key, "expected an object of at most 64 integers")
        return {k: _int(self, f"{key}.{k}", v, 0, MAX_WORLD) for k, v in value.items()}


def _int(fields: _Fields, key: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int:  # bool is an int subclass; 1.0 is not an integer here
        fields.fail(key, f"expected an integer, got {type(value).__name__} {value!r:.40}")
    if not lo <= value <= hi:
        fields.fail(key, f"{value} outside [{lo}, {hi}]")
    return value


def _load_json(path: Path, data: bytes | None = None) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_bytes() if data is None else data)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{path}: unreadable manifest ({exc})") from exc
    fields = _Fields(path, raw)
    version = fields.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        fields.fail(
            "format_version",
            f"{version!r:.40}; this reader knows {', '.join(map(str, READABLE_VERSIONS))}",
        )
    return fields.raw


def _piece(f: _Fields, gshape: list[int], local_numel: int) -> Piece:
    ndim = len(gshape)
    offsets = f.integers("offsets", 0, MAX_DIM)
    shape = f.integers("shape", 0, MAX_DIM)
    strides = f.integers("strides", 0, MAX_DIM)
    base = f.integer("base", 0, MAX_DIM)
    if not len(offsets) == len(shape) == len(strides) == ndim:
        f.fail("shape", f"offsets/shape/strides must each have {ndim} dimensions")
    for d in range(ndim):
        if offsets[d] + shape[d] > gshape[d]:
            f.fail("offsets", f"box {offsets}+{shape} outside the global shape {gshape}")
    if all(n > 0 for n in shape):
        last = base + sum(s * (n - 1) for s, n in zip(strides, shape, strict=True))
        if last >= local_numel:
            f.fail("strides", f"reaches element {last} of a local tensor of {local_numel}")
    return Piece(offsets=offsets, shape=shape, base=base, strides=strides)


def _shape(f: _Fields, key: str) -> list[int]:
    """A tensor shape. Its non-zero dimensions must multiply to at most ``MAX_BYTES``
    (what a tensor's element count already is when it has none): a zero makes the element
    count, so ``nbytes``, 0 whatever the others are, but torch still computes strides from
    them, and ``[0, 2**48, 2**48, 2**48]`` raised torch's ``RuntimeError`` ("Stride
    calculation overflowed") out of ``load()`` instead of a ``CheckpointCorruptError`` it
    falls back past (found by ``tests/checkpoint/test_damage_sweep.py``)."""
    shape = f.integers(key, 0, MAX_DIM)
    if math.prod(n or 1 for n in shape) > MAX_BYTES:
        f.fail(key, f"{shape}: its dimensions multiply past {MAX_BYTES}")
    return shape


def _global_map(f: _Fields, local_numel: int) -> GlobalMap:
    shape = _shape(f, "shape")
    placement, reduce = f.string("placement"), f.string("reduce")
    if placement not in PLACEMENTS:
        f.fail("placement", f"{placement!r:.40} is not one of {', '.join(PLACEMENTS)}")
    if reduce not in REDUCES:
        f.fail("reduce", f"{reduce!r:.40} is not one of {', '.join(REDUCES)}")
    pieces = [
        _piece(f.sub(f"pieces[{i}]", p), shape, local_numel)
        for i, p in enumerate(f.items("pieces", 1 << 16))
    ]
    return GlobalMap(
        name=f.string("name"), shape=shape, placement=placement, reduce=reduce, pieces=pieces
    )


def _entry(f: _Fields, *, rank: int, world_size: int, file_size: int) -> Entry:
    name, dtype = f.string("name"), f.string("dtype")
    if not name:
        f.fail("name", "empty")
    if dtype not in DTYPE_BYTES:
        f.fail("dtype", f"unknown dtype {dtype!r:.40}")
    shape = _shape(f, "shape")
    numel = math.prod(shape)
    nbytes = f.integer("nbytes")
    if nbytes != numel * DTYPE_BYTES[dtype]:
        f.fail(
            "nbytes", f"{nbytes}, but shape {shape} of {dtype} needs {numel * DTYPE_BYTES[dtype]}"
        )
    offset = f.integer("offset")
    stored_by = f.raw.get("stored_by")
    if stored_by is not None:
        stored_by = _int(f, "stored_by", stored_by, 0, world_size - 1)
        if stored_by == rank or offset != 0:
            f.fail("stored_by", f"rank {stored_by} (offset {offset}) cannot hold a replica here")
    elif offset + nbytes > file_size:
        f.fail("offset", f"bytes {offset}..{offset + nbytes} past the data file's {file_size}")
    raw_map = f.raw.get("global_map")
    gmap = None if raw_map is None else _global_map(f.sub("global_map", raw_map), numel)
    if gmap is not None:
        _check_map(f, shape, gmap)
    return Entry(
        name=name,
        dtype=dtype,
        shape=shape,
        offset=offset,
        nbytes=nbytes,
        stored_by=stored_by,
        global_map=gmap,
    )


def _check_map(f: _Fields, shape: list[int], gmap: GlobalMap) -> None:
    """The entry's own (local) shape must be the tensor its global map's pieces address.

    A same-layout load uses the entry's shape and a resharding one the map, so a mismatch
    (``shape`` [8, 4] with pieces laid out row-major over [4, 8]: same bytes, another
    tensor) would load differently depending on the reader. Every writer of this format
    lays pieces out row-major over the entry's shape, and a replicated copy is the whole
    global tensor (a partial one may also be sharded along another mesh dimension). The
    one exception is a ZeRO flat partition: a 1-D entry whose pieces are row-major over
    the (TP-local) parameter shape it was cut from, for which the byte-range checks in
    :func:`_piece` are all that can be said here.
    """
    if gmap.placement == "replicate" and shape != gmap.shape:
        f.fail("shape", f"{shape}, but its global_map (replicate) has shape {gmap.shape}")
    if len(shape) != len(gmap.shape):
        if len(shape) != 1:  # only a flat (1-D) partition may differ in rank
            f.fail(
                "shape",
                f"{shape} has {len(shape)} dimensions, its global_map shape {gmap.shape} "
                f"{len(gmap.shape)}",
            )
        return
    strides = row_major_strides(shape)
    for i, piece in enumerate(gmap.pieces):
        if not all(piece.shape):
            continue  # an empty box addresses nothing
        where = f"global_map.pieces[{i}]"
        if piece.strides != strides:
            f.fail(
                "shape",
                f"{shape} (row-major strides {strides}), but its {where} has strides "
                f"{piece.strides}",
            )
        start = unravel(piece.base, shape)
        if any(s + n > d for s, n, d in zip(start, piece.shape, shape, strict=True)):
            f.fail(
                f"{where}.shape",
                f"box {piece.shape} at local {start} outside the entry's shape {shape}",
            )


def _check_layout(f: _Fields, entries: list[Entry]) -> None:
    """The entries of one data file must tile it as the writers lay it out.

    Every entry is consistent on its own (:func:`_entry`), yet an edited manifest whose
    digest was re-pinned can still point a tensor at another tensor's bytes, or a few bytes
    into its own padding, and would load as wrong numbers. The writers (the engine,
    ``convert``, :func:`checkpoint._persist.persist_part`) lay entries out in list order,
    each at a multiple of :data:`ENTRY_ALIGN_BYTES` or right where the previous one ends,
    with no two sharing a byte; anything else is refused, naming both tensors. The
    skeleton is exempt from the order only: a writer puts it first or last.
    """
    spans = sorted(
        (e.offset, e.offset + e.nbytes, i)
        for i, e in enumerate(entries)
        if e.stored_by is None and e.nbytes
    )
    end, last = 0, -1
    for start, stop, i in spans:
        e = entries[i]
        if start < end:
            f.fail(
                f"entries[{i}].offset",
                f"tensor {e.name!r} bytes {start}..{stop} overlap tensor "
                f"{entries[last].name!r} bytes {entries[last].offset}..{end}",
            )
        if start % ENTRY_ALIGN_BYTES and start != end:
            f.fail(
                f"entries[{i}].offset",
                f"tensor {e.name!r} at byte {start}: neither {ENTRY_ALIGN_BYTES}-byte aligned "
                f"nor right after the previous tensor (which ends at {end})",
            )
        end, last = stop, i
    prev = -1
    for i, e in enumerate(entries):
        if e.stored_by is not None or not e.nbytes or e.name == SKELETON_ENTRY:
            continue
        if prev >= 0 and e.offset < entries[prev].offset:
            f.fail(
                f"entries[{i}].offset",
                f"tensor {e.name!r} at byte {e.offset} is listed after tensor "
                f"{entries[prev].name!r} at byte {entries[prev].offset}; the writers lay "
                "tensors out in list order",
            )
        prev = i


def _data_file(f: _Fields, rank: int) -> DataFileInfo:
    name = f.string("name")
    if name != rank_data_name(rank):
        f.fail("name", f"{name!r:.60}, expected {rank_data_name(rank)!r}")
    size = f.integer("size_bytes")
    sha = f.string("sha256")
    if sha and not _HEX64.fullmatch(sha):
        f.fail("sha256", "not a hex SHA-256")
    chunk = f.integer("chunk_bytes", 4096, 1 << 31)
    crcs = f.integers("chunk_crc32", 0, 0xFFFFFFFF, max_len=MAX_ITEMS)
    if len(crcs) != -(-size // chunk):
        f.fail("chunk_crc32", f"{len(crcs)} CRCs for {size} bytes in chunks of {chunk}")
    return DataFileInfo(name=name, size_bytes=size, sha256=sha, chunk_bytes=chunk, chunk_crc32=crcs)


def parse_rank_manifest(path: Path, data: bytes | None = None) -> RankManifest:
    """A ``rank-NNNNN.json``, every field validated (module docstring)."""
    f = _Fields(path, _load_json(path, data))
    world_size = f.integer("world_size", 1, MAX_WORLD)
    rank = f.integer("rank", 0, world_size - 1)
    info = _data_file(f.sub("data_file", f.get("data_file")), rank)
    entries = [
        _entry(
            f.sub(f"entries[{i}]", e), rank=rank, world_size=world_size, file_size=info.size_bytes
        )
        for i, e in enumerate(f.items("entries"))
    ]
    names = {e.name for e in entries}
    if len(names) != len(entries):
        f.fail("entries", "two entries share a name")
    _check_layout(f, entries)
    run_id = f.raw.get("run_id", "")
    if not isinstance(run_id, str) or len(run_id) > 256:
        f.fail("run_id", "expected a string of at most 256 characters")
    return RankManifest(
        step=f.integer("step", 0, MAX_STEP),
        rank=rank,
        world_size=world_size,
        layout=f.layout("layout"),
        data_file=info,
        entries=entries,
        created_unix_s=f.time("created_unix_s"),
        run_id=run_id,
        format_version=f.raw["format_version"],
    )


def parse_manifest(path: Path, data: bytes | None = None) -> Manifest:
    """A ``MANIFEST.json`` (``data``, or read from ``path``), every field validated
    (module docstring)."""
    f = _Fields(path, _load_json(path, data))
    world_size = f.integer("world_size", 1, MAX_WORLD)
    raw_ranks = f.items("ranks", MAX_WORLD)
    if len(raw_ranks) != world_size:
        f.fail("ranks", f"{len(raw_ranks)} ranks listed for world size {world_size}")
    ranks = []
    for i, raw in enumerate(raw_ranks):
        r = f.sub(f"ranks[{i}]", raw)
        if r.integer("rank", 0, MAX_WORLD) != i:
            r.fail("rank", f"expected {i}")
        manifest, data_file = r.string("manifest"), r.string("data_file")
        if manifest != rank_manifest_name(i):
            r.fail("manifest", f"{manifest!r:.60}, expected {rank_manifest_name(i)!r}")
        if data_file != rank_data_name(i):
            r.fail("data_file", f"{data_file!r:.60}, expected {rank_data_name(i)!r}")
        manifest_sha = r.string("manifest_sha256")
        if not _HEX64.fullmatch(manifest_sha):
            r.fail("manifest_sha256", "not a hex SHA-256")
        sha = r.string("sha256")
        if sha and not _HEX64.fullmatch(sha):
            r.fail("sha256", "not a hex SHA-256")
        ranks.append(
            RankRecord(
                rank=i,
                manifest=manifest,
                manifest_sha256=manifest_sha,
                data_file=data_file,
                size_bytes=r.integer("size_bytes"),
                sha256=sha,
            )
        )
    total = f.integer("total_bytes", 0, MAX_BYTES * MAX_WORLD)
    if total != sum(r.size_bytes for r in ranks):
        f.fail(
            "total_bytes",
            f"{total}, but the ranks' sizes add up to {sum(r.size_bytes for r in ranks)}",
        )
    return Manifest(
        step=f.integer("step", 0, MAX_STEP),
        world_size=world_size,
        layout=f.layout("layout"),
        ranks=ranks,
        total_bytes=total,
        created_unix_s=f.time("created_unix_s"),
        format_version=f.raw["format_version"],
    )
