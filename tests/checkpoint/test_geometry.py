"""Box arithmetic: flat ranges tile exactly, ZeRO pieces address the right elements."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.geometry import LocalBox, flat_partition_pieces, flat_to_boxes, span

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_flat_range_is_tiled_exactly_by_boxes(shape: list[int], data: st.DataObject) -> None:
    total = math.prod(shape)
    start = data.draw(st.integers(0, total - 1))
    length = data.draw(st.integers(1, total - start))
    ids = torch.arange(total).reshape(shape)
    got: list[int] = []
    boxes = flat_to_boxes(shape, start, length)
    for off, box in boxes:
        sl = tuple(slice(o, o + n) for o, n in zip(off, box, strict=True))
        got.extend(ids[sl].reshape(-1).tolist())
    assert got == list(range(start, start + length))  # in order, no gaps, no overlap
    assert len(boxes) <= 2 * len(shape) - 1


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), tp=st.integers(1, 3), data=st.data())
def test_zero_pieces_point_at_the_right_global_elements(
    rows: int, cols: int, tp: int, data: st.DataObject
) -> None:
    """A flat slice of a column shard: every piece element reads the right global value."""
    glob = torch.arange(rows * cols * tp, dtype=torch.float64).reshape(rows, cols * tp)
    r = data.draw(st.integers(0, tp - 1))
    local = glob[:, r * cols : (r + 1) * cols].contiguous()
    box = LocalBox(global_offsets=(0, r * cols), local_offsets=(0, 0), shape=(rows, cols))
    start = data.draw(st.integers(0, rows * cols - 1))
    length = data.draw(st.integers(1, rows * cols - start))
    fragment = local.reshape(-1)[start : start + length].clone()  # stored on its own
    covered = 0
    for piece in flat_partition_pieces([box], [rows, cols], start, length):
        first, end = span(piece, piece.offsets, piece.shape)
        assert first >= 0 and end <= length
        view = fragment.as_strided(piece.shape, piece.strides, piece.base)
        o = piece.offsets
        want = glob[o[0] : o[0] + piece.shape[0], o[1] : o[1] + piece.shape[1]]
        assert torch.equal(view, want)
        covered += math.prod(piece.shape)
    assert covered == length
