"""Process groups and the Megatron communication operators, written with plain
``torch.distributed`` calls so that ``collectives`` sees (and times) every one of them.

* ``copy_to_tp``   forward identity, backward all-reduce over TP (Megatron's *f*): in front of
  a column-parallel layer, whose input gradient is partial on each TP rank.
* ``reduce_from_tp`` forward all-reduce over TP, backward identity (Megatron's *g*): after a
  row-parallel layer, whose output is partial on each TP rank.
* ``vocab_parallel_cross_entropy``: the loss over logits split by vocabulary, without
  gathering them (max, sum of exponentials and target logit are reduced over TP).

Calls are made through the module attribute ``dist.all_reduce`` at call time, so the
instrumented function is the one that runs. A group of one rank skips the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's tensor- and data-parallel groups (``None`` when the group is just us)."""

    tp: Any
    dp: Any
    tp_size: int
    dp_size: int


def make_groups(world_size: int, tp: int, rank: int, timeout: timedelta | None = None) -> Groups:
    """Create every TP and DP group on every rank (``new_group`` is collective) and keep ours.

    TP groups are consecutive ranks ``[d*tp, (d+1)*tp)``; DP groups take one rank per TP
    group, ``{t, t+tp, t+2tp, ...}``.
    """
    dp = world_size // tp
    mine_tp: Any = None
    mine_dp: Any = None
    for d in range(dp):
        ranks = [d * tp + t for t in range(tp)]
        group = dist.new_group(ranks, timeout=timeout) if tp > 1 else None
        if rank in ranks:
            mine_tp = group
    for t in range(tp):
        ranks = [d * tp + t for d in range(dp)]
        group = dist.new_group(ranks, timeout=timeout) if dp > 1 else None
        if rank in ranks:
            mine_dp = group
    return Groups(tp=mine_tp, dp=mine_dp, tp_size=tp, dp_size=dp)


def all_reduce_(tensor: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In-place all-reduce over ``group``; nothing to do for a group of one (``None``)."""
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return x
    out: torch.Tensor = _CopyToTP.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, group)  # type: ignore[no-untyped-call]
    return out


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss ``log(sum_v exp(z_v)) - z_target`` over vocabulary-sharded logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: Any,
    ) -> torch.Tensor:
        z = logits.float()
        zmax = z.max(dim=-1).values
        all_reduce_(zmax, group, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)
        local = target - vocab_start
        inside = (local >= 0) & (local < z.shape[-1])
        local = local.clamp(0, z.shape[-1] - 1)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = z.exp()
        denom = exp.sum(dim=-1)
        stacked = torch.stack([picked, denom])  # one call for both reductions
        all_reduce_(stacked, group)
        picked, denom = stacked[0], stacked[1]
        softmax = exp / denom.unsqueeze(-1)
        ctx.save_for_backward(softmax, local, inside)
        return denom.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        onehot = torch.zeros_like(out).scatter_(-1, local.unsqueeze(-1), 1.0)
        out -= onehot * inside.unsqueeze(-1)
        return out * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any
) -> torch.Tensor:
    """Per-token cross entropy; ``logits`` hold vocabulary ids ``vocab_start + 0..n-1``."""
    out: torch.Tensor = _VocabParallelCE.apply(  # type: ignore[no-untyped-call]
        logits, target, vocab_start, group
    )
    return out
