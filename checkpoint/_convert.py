"""Offline conversions: consolidated (universal) form, safetensors, and PyTorch DCP.

The consolidated form is an ordinary checkpoint of this package saved by one rank, with one
whole tensor per global name and identity maps, so the same resharding loader reads it into
any layout, and ``inspect``/``verify`` work on it unchanged.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint._commit import apply_retention, commit, new_rank_manifest, write_rank_manifest
from checkpoint._load import dtype_of
from checkpoint._reshard import FragmentIndex, consolidate, identity_map
from checkpoint._snapshot import TensorRef
from checkpoint._store import CheckpointReader, CheckpointStore, PassedOver
from checkpoint._validate import DTYPE_BYTES
from checkpoint._write import DataFileWriter, fsync_dir, tmp_name
from checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
)
from checkpoint.manifest import (
    DEFAULT_CHUNK_BYTES,
    ENTRY_ALIGN_BYTES,
    SKELETON_ENTRY,
    Entry,
    rank_data_name,
    step_dir_name,
)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy().data)


def _refuse_overwrite(root: Path, step: int) -> None:
    """An output root may be new or hold only older steps: writing step ``step`` must not
    replace a checkpoint there, nor move ``latest`` back behind a newer one."""
    if root.exists() and not root.is_dir():
        raise CheckpointConfigError(f"{root}: exists and is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    if (root / step_dir_name(step)).exists():
        raise CheckpointConfigError(
            f"{root}: already holds step {step}; write to a new directory or another --step"
        )
    newer = [i.step for i in CheckpointStore(root).list() if i.complete and i.step >= step]
    if newer:
        raise CheckpointConfigError(
            f"{root}: already holds step {max(newer)}, not older than {step}; write to a new "
            "directory or a --step above it"
        )


def write_consolidated(
    root: Path,
    step: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    layout: Mapping[str, int] | None = None,
) -> int:
    """Write ``tensors`` as a complete one-rank checkpoint, streaming one tensor at a time.

    The skeleton is written last in the file (its size is known only at the end), which
    readers do not mind: entries carry their own offsets. Returns bytes written.
    """
    _refuse_overwrite(root, step)
    step_dir = root / step_dir_name(step)
    try:
        step_dir.mkdir()  # never into an existing step: a committed one would be replaced
    except FileExistsError:
        raise CheckpointConfigError(f"{step_dir}: already exists; choose another output") from None
    fsync_dir(root)
    writer = DataFileWriter(
        step_dir / rank_data_name(0), chunk_bytes=DEFAULT_CHUNK_BYTES, sha256=True
    )
    entries: list[Entry] = []
    tree: dict[str, Any] = {}
    try:
        for name, tensor in tensors:
            writer.pad_to(-(-writer.size_bytes // ENTRY_ALIGN_BYTES) * ENTRY_ALIGN_BYTES)
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(
                Entry(
                    name=name,
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    shape=list(tensor.shape),
                    offset=writer.size_bytes,
                    nbytes=nbytes,
                    global_map=identity_map(name, tensor),
                )
            )
            if nbytes:
                writer.write(_bytes_of(tensor))
            tree[name] = TensorRef(name, entries[-1].dtype, tuple(entries[-1].shape))
        buf = io.BytesIO()
        pickle.dump(tree, buf, protocol=pickle.HIGHEST_PROTOCOL)
        skeleton = buf.getvalue()
        entries.append(
            Entry(
                name=SKELETON_ENTRY,
                dtype="uint8",
                shape=[len(skeleton)],
                offset=writer.size_bytes,
                nbytes=len(skeleton),
            )
        )
        writer.write(skeleton)
        info = writer.finish()
    except BaseException:
        writer.abort()
        raise
    world_layout = dict(layout or {"world": 1})
    write_rank_manifest(
        step_dir,
        new_rank_manifest(
            step=step, rank=0, world_size=1, layout=world_layout, data_file=info, entries=entries
        ),
    )
    commit(root, step, world_size=1, layout=world_layout, timeout_s=1.0)
    apply_retention(root, keep_last=1_000_000, newest_committed=step)
    return info.size_bytes


@dataclass(kw_only=True, slots=True)
class Converted:
    """What a conversion wrote, and from which checkpoint."""

    step: int
    size_bytes: int
    #: Newer committed checkpoints passed over because they did not open, newest first
    #: (``step N: reason``); empty when ``step`` was given.
    skipped: list[str] = field(default_factory=list)
    #: Why ``latest`` was not followed ("" when it named the newest committed step).
    latest_note: str = ""


def _open(src: Path, step: int | None, out: Path) -> tuple[CheckpointReader, Converted]:
    """The checkpoint to convert (``step``, or the one ``load()`` resumes from: the newest
    committed one whose bytes verify, as ``checkpoint verify`` finds it, which reads the
    data once more) and a :class:`Converted` to fill in."""
    if out.resolve() == src.resolve():
        raise CheckpointConfigError(f"{out}: is the source; write to a new path")
    store = CheckpointStore(src)
    if step is not None:
        reader = store.open(step)
        return reader, Converted(step=reader.step, size_bytes=0)
    passed = PassedOver()
    try:  # verified as load() finds it: a damaged newer step is passed over and named
        reader = store.open_latest(deep=True, passed=passed)
    except CheckpointNotFoundError:
        if not passed.steps:
            raise
        problems = "; ".join(passed.lines())
        raise CheckpointCorruptError(f"{src}: no checkpoint verifies ({problems})") from None
    return reader, Converted(
        step=reader.step, size_bytes=0, skipped=passed.lines(), latest_note=passed.latest_note
    )


def to_universal(src: Path, out: Path, *, step: int | None = None, check: bool = True) -> Converted:
    reader, done = _open(src, step, out)
    with reader:
        done.size_bytes = write_consolidated(
            out, reader.step, consolidate(reader, check_replicas=check)
        )
    return done


#: safetensors' dtype names.
_SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def to_safetensors(
    src: Path, out: Path, *, step: int | None = None, check: bool = True
) -> Converted:
    """Write a safetensors file one global tensor at a time: the header (names, dtypes,
    shapes, offsets) is known from the manifests before any tensor is assembled, so peak
    memory is about one tensor, and a checkpoint larger than RAM converts."""
    reader, done = _open(src, step, out)
    with reader:
        index = FragmentIndex(reader)
        header: dict[str, Any] = {}
        pos = 0
        for name in index.names():
            frag = index.fragments(name)[0]
            dtype = _SAFETENSORS_DTYPES.get(frag.entry.dtype)
            if dtype is None:
                raise CheckpointConfigError(
                    f"tensor {name!r}: safetensors has no {frag.entry.dtype}"
                )
            nbytes = math.prod(frag.global_map.shape) * DTYPE_BYTES[frag.entry.dtype]
            header[name] = {
                "dtype": dtype,
                "shape": frag.global_map.shape,
                "data_offsets": [pos, pos + nbytes],
            }
            pos += nbytes
        header["__metadata__"] = {"step": str(reader.step)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = tmp_name(out)
        try:
            with open(tmp, "wb") as fh:
                fh.write(struct.pack("<Q", len(raw)))
                fh.write(raw)
                for _, tensor in consolidate(reader, check_replicas=check):
                    fh.write(_bytes_of(tensor))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    done.size_bytes = out.stat().st_size
    return done


def to_dcp(src: Path, out: Path, *, step: int | None = None, check: bool = True) -> Converted:
    """Write a PyTorch DCP checkpoint (one rank, one global tensor per name) by DCP's own
    ``save`` and ``FileSystemWriter``, streaming: the state handed to DCP holds only
    ``meta`` tensors (shape and dtype, no storage), and the planner assembles each global
    tensor from the fragments when DCP's writer asks for it (``resolve_data``, one item at a
    time), so peak memory is about one tensor and a checkpoint larger than RAM converts."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem
    from torch.distributed.checkpoint.state_dict_saver import save

    reader, done = _open(src, step, out)
    with reader:
        index = FragmentIndex(reader)

        def assemble(name: str) -> torch.Tensor:
            frag = index.fragments(name)[0]
            full = torch.empty(
                frag.global_map.shape, dtype=dtype_of(frag.entry.dtype, str(reader.path))
            )
            index.fill(name, full, identity_map(name, full), check_replicas=check)
            return full

        class StreamingPlanner(DefaultSavePlanner):
            def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
                return assemble(write_item.index.fqn)

        placeholders = {}
        for name in index.names():
            frag = index.fragments(name)[0]
            dtype = dtype_of(frag.entry.dtype, str(reader.path))
            placeholders[name] = torch.empty(frag.global_map.shape, dtype=dtype, device="meta")
        with warnings.catch_warnings():  # "assuming ... a single process": exactly the intent
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            save(
                placeholders,
                checkpoint_id=str(out),
                planner=StreamingPlanner(flatten_state_dict=False),
                no_dist=True,
            )
    done.size_bytes = sum(p.stat().st_size for p in out.iterdir())
    return done


def _flatten(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}/{key}" if prefix else str(key))


def from_safetensors(src: Path, out: Path, *, step: int = 0) -> int:
    from safetensors.torch import load_file

    tensors = load_file(str(src))
    return write_consolidated(out, step, sorted(tensors.items()))


def from_dcp(src: Path, out: Path, *, step: int = 0) -> int:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (src / ".metadata").is_file():
        raise CheckpointConfigError(f"{src}: not a DCP checkpoint (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"
        try:
            dcp_to_torch_save(str(src), str(path))
        except CheckpointException as exc:  # a BaseException in torch: keep it contained
            raise CheckpointConfigError(f"{src}: DCP load failed ({exc!s:.200})") from None
        state = torch.load(path, weights_only=True)
    tensors = sorted(_flatten(state, ""))
    if not tensors:
        raise CheckpointConfigError(f"{src}: the DCP checkpoint holds no tensors")
    return write_consolidated(out, step, tensors)
