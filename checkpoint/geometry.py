"""Box arithmetic that maps stored fragments onto global tensors (no torch).

A fragment is described by :class:`checkpoint.manifest.Piece` boxes. Sharded layouts give
one box per fragment; a fused parameter gives one per fused part; a ZeRO flat partition
gives up to ``2*ndim - 1`` boxes per parameter it touches, because a contiguous range of a
row-major tensor is a ragged first row, a block of whole rows and a ragged last row (applied
recursively per dimension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from checkpoint.manifest import Piece

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    return sum(c * s for c, s in zip(coord, row_major_strides(shape), strict=True))


def unravel(index: int, shape: Sequence[int]) -> list[int]:
    """The row-major coordinate of element ``index`` of ``shape`` (inverse of :func:`ravel`)."""
    coord = [0] * len(shape)
    for d in range(len(shape) - 1, -1, -1):
        if shape[d]:
            index, coord[d] = divmod(index, shape[d])
    return coord


def intersect(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> Box | None:
    off, shape = [], []
    for ao, al, bo, bl in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def flat_to_boxes(shape: Sequence[int], start: int, length: int) -> list[Box]:
    """Boxes that exactly tile elements ``[start, start+length)`` of a row-major tensor."""
    if length <= 0:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out: list[Box] = []
    end = start + length
    row, col = divmod(start, inner)
    if col:  # ragged head inside row `row`
        take = min(end, (row + 1) * inner) - start
        for off, sub in flat_to_boxes(shape[1:], col, take):
            out.append(((row, *off), (1, *sub)))
        start += take
        row += 1
    full = (end - start) // inner
    if full > 0:
        out.append(((row, *([0] * (len(shape) - 1))), (full, *shape[1:])))
        start += full * inner
        row += full
    if start < end:  # ragged tail at the start of row `row`
        for off, sub in flat_to_boxes(shape[1:], 0, end - start):
            out.append(((row, *off), (1, *sub)))
    return out


@dataclass(frozen=True, slots=True)
class LocalBox:
    """A box of the global tensor held at ``local_offsets`` of a local (TP) shard."""

    global_offsets: tuple[int, ...]
    local_offsets: tuple[int, ...]
    shape: tuple[int, ...]


def boxes_to_pieces(boxes: Sequence[LocalBox], local_shape: Sequence[int]) -> list[Piece]:
    strides = row_major_strides(local_shape)
    return [
        Piece(
            offsets=list(b.global_offsets),
            shape=list(b.shape),
            base=ravel(b.local_offsets, local_shape),
            strides=list(strides),
        )
        for b in boxes
        if all(n > 0 for n in b.shape)
    ]


def flat_partition_pieces(
    boxes: Sequence[LocalBox], local_shape: Sequence[int], start: int, length: int
) -> list[Piece]:
    """Pieces of a 1-D fragment holding elements ``[start, start+length)`` of a local shard
    whose boxes (local to global) are ``boxes`` (ZeRO partition of a TP shard)."""
    strides = row_major_strides(local_shape)
    pieces = []
    for off, shape in flat_to_boxes(local_shape, start, length):
        for box in boxes:
            hit = intersect(off, shape, box.local_offsets, box.shape)
            if hit is None:
                continue
            lo, sub = hit
            goff = [
                g + (x - b)
                for g, x, b in zip(box.global_offsets, lo, box.local_offsets, strict=True)
            ]
            pieces.append(
                Piece(
                    offsets=goff,
                    shape=list(sub),
                    base=ravel(lo, local_shape) - start,
                    strides=list(strides),
                )
            )
    return pieces


def span(piece: Piece, off: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """First and one-past-last local element address of sub-box ``off/shape`` of ``piece``."""
    first = piece.base + sum(
        s * (o - p) for s, o, p in zip(piece.strides, off, piece.offsets, strict=True)
    )
    last = first + sum(s * (n - 1) for s, n in zip(piece.strides, shape, strict=True))
    return first, last + 1
