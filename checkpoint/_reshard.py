"""Loading a universal checkpoint into any layout, reading only the bytes each rank needs.

For every box of every tensor the loading rank holds, the loader finds the saved fragments
that intersect it, reads the smallest byte span of each fragment that contains the
intersection (rounded out to whole 4 MiB CRC chunks so every byte read is verified), and
copies it into place with strided views. Replicated copies are read once; partial and
averaged tensors are summed over all copies (and divided, for ``avg``).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint._load import dtype_of
from checkpoint._snapshot import ShardingHook
from checkpoint._store import CheckpointReader, CheckpointStore, open_candidate
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointLayoutError,
    CheckpointNotFoundError,
)
from checkpoint.geometry import intersect, row_major_strides, span
from checkpoint.manifest import Entry, GlobalMap, Piece

log = logging.getLogger(__name__)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two replicas hold the same bytes. Replicas are copies, so this is the test;
    value equality (``torch.equal``) calls a copy holding NaN different from itself, and a
    diverged run's replicated tensor would then not convert."""
    return a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


@dataclass(frozen=True, slots=True)
class Fragment:
    rank: int
    entry: Entry
    global_map: GlobalMap


class FragmentIndex:
    """Every saved fragment of a checkpoint, grouped by global tensor name."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.by_name: dict[str, list[Fragment]] = defaultdict(list)
        for rank in range(reader.manifest.world_size):
            for entry in reader.entries(rank):
                # A replica written once lives in its holder's file under the same map.
                if entry.global_map is not None and entry.stored_by is None:
                    frag = Fragment(rank, entry, entry.global_map)
                    found = self.by_name[entry.global_map.name]
                    if found:
                        self._check_same(found[0], frag)
                    found.append(frag)
        self.bytes_read = 0

    def _check_same(self, first: Fragment, frag: Fragment) -> None:
        """Fragments of one global tensor must agree on what that tensor is: the reader
        takes its shape, placement and reduction from the first and converts every
        fragment's bytes to the first one's dtype, so a rank manifest that disagrees
        would be read quietly as the other ranks describe it."""
        a, b = first.global_map, frag.global_map
        for field_, want, got in (
            ("global_map.shape", a.shape, b.shape),
            ("global_map.placement", a.placement, b.placement),
            ("global_map.reduce", a.reduce, b.reduce),
            ("dtype", first.entry.dtype, frag.entry.dtype),
        ):
            if got != want:
                path = self.reader.path / self.reader.manifest.ranks[frag.rank].manifest
                raise CheckpointCorruptError(
                    f"{path}: entry {frag.entry.name!r} field {field_}: {got!r:.80}, but rank "
                    f"{first.rank}'s fragment of global tensor {b.name!r} says {want!r:.80}"
                )

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def global_map(self, name: str) -> GlobalMap:
        return self.fragments(name)[0].global_map

    def fragments(self, name: str) -> list[Fragment]:
        found = self.by_name.get(name)
        if not found:
            raise CheckpointLayoutError(f"tensor {name!r}: not in checkpoint {self.reader.path}")
        return found

    def _read_box(
        self, frag: Fragment, piece: Piece, off: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        dtype = dtype_of(frag.entry.dtype, str(self.reader.path))
        size = torch.empty((), dtype=dtype).element_size()
        first, end = span(piece, off, shape)
        data = self.reader.read(
            frag.rank, frag.entry.offset + first * size, (end - first) * size, what=frag.entry.name
        )
        self.bytes_read += len(data)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        return flat.as_strided(shape, piece.strides, 0)

    def fill(
        self,
        name: str,
        target: torch.Tensor,
        target_map: GlobalMap,
        *,
        check_replicas: bool = False,
    ) -> None:
        """Write the saved values of global tensor ``name`` into ``target``'s boxes."""
        frags = self.fragments(name)
        saved = frags[0].global_map
        if list(saved.shape) != list(target_map.shape):
            raise CheckpointLayoutError(
                f"tensor {name!r}: global shape {saved.shape} in {self.reader.path}, "
                f"target expects {target_map.shape}"
            )
        if not target.is_contiguous():
            raise CheckpointLayoutError(f"tensor {name!r}: target must be contiguous")
        flat_t = target.view(-1)
        if sum(math.prod(p.shape) for p in target_map.pieces) < target.numel():
            target.zero_()  # padding (e.g. vocabulary rows past the real size) reads as zero
        reduce = saved.reduce
        for tp in target_map.pieces:
            t_off, t_shape = tuple(tp.offsets), tuple(tp.shape)
            done = torch.zeros(t_shape, dtype=torch.int32)
            whole = flat_t.as_strided(t_shape, tp.strides, tp.base)
            # The mean of integer or bool copies (an `average` glob that catches a
            # `num_batches_tracked`) is taken in float64 and rounded back: divided in place,
            # torch refuses to cast the float quotient into the integer tensor.
            exact = whole.is_floating_point() or whole.is_complex()
            acc = whole if reduce != "avg" or exact else torch.zeros(t_shape, dtype=torch.float64)
            if reduce != "none":
                acc.zero_()
            for frag in frags:
                for sp in frag.global_map.pieces:
                    hit = intersect(t_off, t_shape, sp.offsets, sp.shape)
                    if hit is None:
                        continue
                    off, shape = hit
                    rel = tuple(
                        slice(o - t, o - t + n) for o, t, n in zip(off, t_off, shape, strict=True)
                    )
                    seen = done[rel]
                    if reduce == "none" and not check_replicas and bool(seen.all()):
                        continue  # a replica of something already loaded
                    src = self._read_box(frag, sp, off, shape)
                    dst = (acc if reduce != "none" else whole)[rel]
                    if reduce != "none":
                        dst.add_(src.to(dst.dtype))
                    else:
                        mask = seen > 0
                        if (
                            check_replicas
                            and bool(mask.any())
                            and not _same_bytes(dst[mask], src.to(dst.dtype)[mask])
                        ):
                            raise CheckpointLayoutError(
                                f"tensor {name!r}: replicated copies differ (rank "
                                f"{frag.rank}, {frag.entry.name})"
                            )
                        dst.copy_(src)
                    seen += 1
            if not bool((done > 0).all()):
                raise CheckpointLayoutError(
                    f"tensor {name!r}: part of box offsets={list(t_off)} shape={list(t_shape)} "
                    f"is in no saved fragment of {self.reader.path}"
                )
            if reduce == "avg":
                acc.div_(done.to(acc.dtype))
                if acc is not whole:
                    whole.copy_(acc.round())  # to nearest, ties to even (bool: a majority)


def identity_map(name: str, tensor: torch.Tensor) -> GlobalMap:
    shape = list(tensor.shape)
    return GlobalMap(
        name=name,
        shape=shape,
        placement="shard",
        pieces=[
            Piece(offsets=[0] * len(shape), shape=shape, base=0, strides=row_major_strides(shape))
        ],
    )


@dataclass(kw_only=True, slots=True)
class ReshardResult:
    step: int
    path: Path
    bytes_read: int
    tensors: int
    skipped: list[str] = field(default_factory=list)
    """Why newer checkpoints were passed over (CRC mismatch, missing shard), newest first."""
    latest_note: str = ""
    """Why ``latest`` was not followed ("" when it named the newest committed step)."""


def expand_targets(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Entry name -> tensor to fill in place, for a state given as to ``Checkpointer.save``:
    a module's ``state_dict`` tensors (``<key>/<param>``; FSDP2/TP DTensor parameters are
    filled through their local shards), an optimizer's state tensors
    (``<key>/state/<index>/<name>``; the optimizer must have its state already, e.g. after
    one step), tensors as they are. Other values (schedulers, plain data) are skipped:
    they are per rank and not resharded."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, torch.nn.Module):
            for name, tensor in value.state_dict().items():
                out[f"{key}/{name}"] = tensor
        elif isinstance(value, torch.optim.Optimizer):
            for index, per_param in value.state_dict()["state"].items():
                for name, tensor in per_param.items():
                    if isinstance(tensor, torch.Tensor):
                        out[f"{key}/state/{index}/{name}"] = tensor
    return out


def load_resharded(
    root: str | Path,
    targets: Mapping[str, Any],
    *,
    sharding: ShardingHook | None = None,
    step: int | None = None,
) -> ReshardResult:
    """Fill ``targets`` (entry name -> this rank's tensor or DTensor) from any layout.

    ``sharding`` describes the *target* layout (the same hook used when saving); without
    one every target is the whole global tensor. With ``step=None`` a newest checkpoint whose
    bytes fail their CRC or whose shard is missing is skipped with a warning and the previous
    complete one is loaded, as :func:`checkpoint.load` does: every target is
    filled whole from the checkpoint that loads, so a half-filled attempt leaves no trace. A
    layout error (a tensor the checkpoint lacks, a shape that differs) is the caller's
    mistake, not damage, and is raised at once.
    """
    targets = expand_targets(targets)
    store = CheckpointStore(root)
    steps, note = ([step], "") if step is not None else store.resolve()
    skipped: list[str] = []
    for candidate in steps:
        opened = open_candidate(store, candidate, explicit=step is not None, skipped=skipped)
        if opened is None:
            continue
        try:
            with opened as reader:
                index = FragmentIndex(reader)
                for name, tensor in targets.items():
                    local, tmap = (
                        sharding(name, tensor)
                        if sharding is not None
                        else (tensor, identity_map(name, tensor))
                    )
                    if tmap is None:
                        raise CheckpointLayoutError(
                            f"tensor {name!r}: target layout gives no mapping"
                        )
                    with torch.no_grad():
                        index.fill(name, local, tmap)
                return ReshardResult(
                    step=reader.step,
                    path=reader.path,
                    bytes_read=index.bytes_read,
                    tensors=len(targets),
                    skipped=skipped,
                    latest_note=note,
                )
        except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
            if step is not None:
                raise
            log.warning("skipping checkpoint step %d: %s", candidate, exc)
            skipped.append(str(exc))
    detail = "; ".join(skipped) if skipped else "none found"
    raise CheckpointNotFoundError(f"{root}: no complete checkpoint ({detail})")


def consolidate(
    reader: CheckpointReader, *, check_replicas: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each global tensor, whole, one at a time (the universal per-parameter form)."""
    index = FragmentIndex(reader)
    for name in index.names():
        frag = index.fragments(name)[0]
        gmap = frag.global_map
        full = torch.empty(gmap.shape, dtype=dtype_of(frag.entry.dtype, str(reader.path)))
        index.fill(name, full, identity_map(name, full), check_replicas=check_replicas)
        yield name, full
