"""Describing where each saved tensor belongs in the global state (universal checkpoints).

:class:`ShardingSpec` is the hook the engine calls for every tensor it saves (and the
resharding loader for every tensor it fills). DTensors describe themselves through their
placements; plain tensors are described by a :class:`~checkpoint.rules.RuleSpec` plus this
rank's :class:`~checkpoint.rules.ParallelLayout`, and ZeRO-1 optimizer partitions by a
:class:`ZeroPartition`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from checkpoint.errors import ShardingRuleError
from checkpoint.geometry import LocalBox, boxes_to_pieces, flat_partition_pieces
from checkpoint.manifest import GlobalMap
from checkpoint.rules import ParallelLayout, Rule, RuleSpec


def _full(shape: Sequence[int]) -> list[LocalBox]:
    zeros = tuple(0 for _ in shape)
    return [LocalBox(global_offsets=zeros, local_offsets=zeros, shape=tuple(shape))]


def rule_boxes(
    name: str, rule: Rule, layout: ParallelLayout, local_shape: Sequence[int]
) -> tuple[list[int], list[LocalBox]]:
    """Global shape and local-to-global boxes of a plain tensor under ``rule``."""
    local = list(local_shape)
    if rule.rule in ("replicate", "average"):
        return local, _full(local)
    dim = rule.dim
    if dim >= len(local):
        raise ShardingRuleError(
            f"tensor {name!r}: rule {rule.pattern!r} dim {dim} but ndim is {len(local)}"
        )
    tp, r, n = layout.tp, layout.tp_rank, local[dim]

    def box(goff: int, loff: int, rows: int) -> LocalBox:
        g = [0] * len(local)
        lo = [0] * len(local)
        shape = list(local)
        g[dim], lo[dim], shape[dim] = goff, loff, rows
        return LocalBox(global_offsets=tuple(g), local_offsets=tuple(lo), shape=tuple(shape))

    glob = list(local)
    if rule.rule == "shard":
        glob[dim] = n * tp
        return glob, [box(r * n, 0, n)]
    if rule.rule == "fused":
        if any(p % tp for p in rule.parts) or sum(rule.parts) // tp != n:
            raise ShardingRuleError(
                f"tensor {name!r}: fused parts {list(rule.parts)} do not split into "
                f"{tp} shards of {n} rows along dim {dim}"
            )
        boxes, loff, goff = [], 0, 0
        for part in rule.parts:
            boxes.append(box(goff + r * (part // tp), loff, part // tp))
            loff += part // tp
            goff += part
        glob[dim] = sum(rule.parts)
        return glob, boxes
    # vocab: padded rows beyond `size` belong to no global element
    if n * tp < rule.size:
        raise ShardingRuleError(
            f"tensor {name!r}: {tp} shards of {n} rows cannot hold vocabulary {rule.size}"
        )
    glob[dim] = rule.size
    keep = max(0, min(n, rule.size - r * n))
    return glob, [box(r * n, 0, keep)] if keep else []


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPartition:
    """ZeRO-1: optimizer state of the (TP-local) parameters, flattened in ``params`` order
    and concatenated, is split into ``dp`` equal contiguous partitions (last one shorter).

    Entries whose name starts with one of ``prefixes`` followed by a parameter name hold
    that parameter's slice of this rank's partition (1-D).
    """

    prefixes: tuple[str, ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]
    dp: int
    dp_rank: int

    @property
    def total(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)

    def owned(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (start within the parameter, length) this rank owns."""
        size = -(-self.total // self.dp)
        lo, hi = self.dp_rank * size, min((self.dp_rank + 1) * size, self.total)
        out, pos = {}, 0
        for name, shape in self.params:
            n = math.prod(shape)
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                out[name] = (a - pos, b - a)
            pos += n
        return out

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of this rank's flat partition, one per parameter it touches."""
        out, pos = {}, 0
        for name, (_, length) in self.owned().items():
            out[name] = flat[pos : pos + length]
            pos += length
        return out

    def param_of(self, entry: str) -> str | None:
        for prefix in self.prefixes:
            if entry.startswith(prefix):
                return entry[len(prefix) :]
        return None


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's package.

    Importing ``torch.distributed.tensor`` costs a rank ~0.5 s of CPU (it pulls in sympy
    through symbolic shapes), and a job without DTensors paid it on its first save. A
    DTensor cannot exist before its package is imported, so an unloaded package answers no.
    """
    package = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(package, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def dtensor_map(name: str, value: torch.Tensor) -> tuple[torch.Tensor, GlobalMap]:
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(value, DTensor)
    local = value.to_local()
    shape, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    placement, reduce = "shard", "none"
    partial = [p for p in value.placements if isinstance(p, Partial)]
    if partial:
        placement, reduce = "partial", "avg" if partial[0].reduce_op == "avg" else "sum"
    elif all(isinstance(p, Replicate) for p in value.placements):
        placement = "replicate"
    box = LocalBox(
        global_offsets=tuple(offsets), local_offsets=(0,) * len(shape), shape=tuple(shape)
    )
    return local, GlobalMap(
        name=name,
        shape=list(value.shape),
        placement=placement,
        reduce=reduce,
        pieces=boxes_to_pieces([box], list(local.shape)),
    )


def dtensor_replicas(value: torch.Tensor) -> tuple[int, ...]:
    """Global ranks holding the same local shard of DTensor ``value`` as this rank: those
    that differ from it only along mesh dimensions where it is ``Replicate``."""
    from torch.distributed.tensor import DTensor, Replicate

    assert isinstance(value, DTensor)
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return ()
    index: list[int | slice] = list(coord)
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, Replicate):
            index[dim] = slice(None)
    return tuple(sorted(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()))


def layout_rank(layout: ParallelLayout, *, dp_rank: int) -> int:
    """Global rank of ``layout`` with another data-parallel coordinate, in Megatron's
    default order (TP fastest, then DP, then PP)."""
    return layout.tp_rank + layout.tp * (dp_rank + layout.dp * layout.pp_rank)


class ShardingSpec:
    """Maps (entry name, local tensor) to its place in the global state; strict."""

    def __init__(
        self,
        rules: RuleSpec | Sequence[Mapping[str, object]] | None = None,
        *,
        layout: ParallelLayout | None = None,
        zero: ZeroPartition | None = None,
        ignore: Sequence[str] = ("__rng__/*",),
    ) -> None:
        self.rules = (
            rules if isinstance(rules, RuleSpec) or rules is None else RuleSpec.parse(list(rules))
        )
        self.layout = layout or ParallelLayout()
        self.zero = zero
        self.ignore = (
            RuleSpec.parse([{"pattern": p, "rule": "replicate"} for p in ignore])
            if ignore
            else None
        )
        self._zero_shapes = dict(zero.params) if zero else {}
        self._zero_owned = zero.owned() if zero else {}

    def replicas(self, name: str, value: torch.Tensor) -> tuple[int, ...]:
        """Global ranks that hold a byte-identical copy of this rank's ``name`` (itself
        included), so that the save writes it once (:mod:`checkpoint._dedup`); ``()`` when
        it is this rank's alone. DTensors: ranks along their ``Replicate`` mesh dims. Plain
        tensors: the data-parallel peers, except ZeRO partitions (each DP rank owns its
        own), ``average`` tensors (copies may drift) and ignored ones (RNG, per rank)."""
        if is_dtensor(value):
            return dtensor_replicas(value)
        layout = self.layout
        if layout.dp == 1 or self.rules is None:
            return ()
        if self.ignore is not None and any(r.matches(name) for r in self.ignore.rules):
            return ()
        if self.zero is not None and self.zero.param_of(name) is not None:
            return ()
        if self.rules.match(name).rule == "average":
            return ()
        return tuple(layout_rank(layout, dp_rank=d) for d in range(layout.dp))

    def __call__(self, name: str, value: torch.Tensor) -> tuple[torch.Tensor, GlobalMap | None]:
        if is_dtensor(value):
            return dtensor_map(name, value)
        if self.ignore is not None and any(r.matches(name) for r in self.ignore.rules):
            return value, None
        if self.rules is None:
            raise ShardingRuleError(f"tensor {name!r} is not a DTensor and no rules were given")
        rule = self.rules.match(name)
        reduce = "avg" if rule.rule == "average" else "none"
        placement = "replicate" if rule.rule in ("replicate", "average") else "shard"
        param = self.zero.param_of(name) if self.zero else None
        if param is not None:
            if param not in self._zero_shapes:
                raise ShardingRuleError(
                    f"tensor {name!r}: parameter {param!r} is not in the "
                    "ZeRO partition's parameter list"
                )
            local_shape = self._zero_shapes[param]
            start, length = self._zero_owned.get(param, (0, 0))
            if value.dim() != 1 or value.numel() != length:
                raise ShardingRuleError(
                    f"tensor {name!r}: expected this rank's flat slice of "
                    f"{length} elements, got shape {list(value.shape)}"
                )
            glob, boxes = rule_boxes(name, rule, self.layout, local_shape)
            pieces = flat_partition_pieces(boxes, local_shape, start, length)
            return value, GlobalMap(
                name=name, shape=glob, placement="shard", reduce=reduce, pieces=pieces
            )
        glob, boxes = rule_boxes(name, rule, self.layout, list(value.shape))
        return value, GlobalMap(
            name=name,
            shape=glob,
            placement=placement,
            reduce=reduce,
            pieces=boxes_to_pieces(boxes, list(value.shape)),
        )
