"""A tiny GPT split Megatron-style over a tensor-parallel group, and the sharding rules
that tell the checkpoint where each local shard sits in the global model.

Parallel pieces: a vocabulary-parallel embedding (rows padded to a multiple of TP) whose
weight is tied to the output layer, so the logits come out split by vocabulary and the loss
is computed without gathering them; column-parallel fused QKV and MLP-up; row-parallel
attention-out and MLP-down (their bias added once, after the reduction); replicated
LayerNorms and position embedding. A fresh model is cut from one global initialization, so
it is the same model whatever the layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from demojob.config import N_HEADS
from demojob.parallel import (
    Groups,
    copy_to_tp,
    reduce_from_tp,
    vocab_parallel_cross_entropy,
)

VOCAB = 61
"""Token ids 0..60. Prime, so every TP size > 1 pads the embedding rows."""
HIDDEN = 64
LAYERS = 2
SEQ = 32
MLP = 4 * HIDDEN
_MASKED_LOGIT = -1e30  # padded vocabulary rows: exp() underflows to exactly 0


def padded_vocab(tp: int) -> int:
    return -(-VOCAB // tp) * tp


def global_rules() -> dict[str, dict[str, Any]]:
    """Parameter name (as in ``state_dict``) -> its sharding rule, minus the pattern."""
    rules: dict[str, dict[str, Any]] = {
        "embed.weight": {"rule": "vocab", "size": VOCAB},
        "pos.weight": {"rule": "replicate"},
        "lnf.weight": {"rule": "replicate"},
        "lnf.bias": {"rule": "replicate"},
    }
    for i in range(LAYERS):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            rules[p + ln + ".weight"] = {"rule": "replicate"}
            rules[p + ln + ".bias"] = {"rule": "replicate"}
        fused = {"rule": "fused", "dim": 0, "parts": [HIDDEN, HIDDEN, HIDDEN]}
        rules[p + "qkv.weight"] = fused
        rules[p + "qkv.bias"] = fused
        rules[p + "proj.weight"] = {"rule": "shard", "dim": 1}
        rules[p + "proj.bias"] = {"rule": "replicate"}
        rules[p + "up.weight"] = {"rule": "shard", "dim": 0}
        rules[p + "up.bias"] = {"rule": "shard", "dim": 0}
        rules[p + "down.weight"] = {"rule": "shard", "dim": 1}
        rules[p + "down.bias"] = {"rule": "replicate"}
    return rules


class Block(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.heads = N_HEADS // tp
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN // tp)
        self.proj = nn.Linear(HIDDEN // tp, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, MLP // tp)
        self.down = nn.Linear(MLP // tp, HIDDEN)

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        b, t, _ = x.shape
        h = copy_to_tp(self.ln1(x), group)
        q, k, v = self.qkv(h).split(self.heads * (HIDDEN // N_HEADS), dim=-1)
        shape = (b, t, self.heads, HIDDEN // N_HEADS)
        q, k, v = (y.view(shape).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, -1)
        # row-parallel: reduce the partial products, then add the (replicated) bias once
        x = x + reduce_from_tp(F.linear(a, self.proj.weight), group) + self.proj.bias
        h = copy_to_tp(self.ln2(x), group)
        m = F.linear(F.gelu(self.up(h)), self.down.weight)
        return x + reduce_from_tp(m, group) + self.down.bias


class TinyGPT(nn.Module):
    """This rank's shard of the model; ``forward`` returns the mean loss of its batch."""

    def __init__(self, groups: Groups, tp_rank: int) -> None:
        super().__init__()
        tp = groups.tp_size
        self.groups = groups
        self.rows = padded_vocab(tp) // tp
        self.vocab_start = tp_rank * self.rows
        self.embed = nn.Embedding(self.rows, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(tp) for _ in range(LAYERS))
        self.lnf = nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        group = self.groups.tp
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        local = inputs - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        emb = self.embed(local.clamp(0, self.rows - 1)) * mine.unsqueeze(-1)
        x = reduce_from_tp(emb, group) + self.pos.weight[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x, group)
        h = copy_to_tp(self.lnf(x), group)
        logits = F.linear(h, self.embed.weight)  # tied output layer, split by vocabulary
        pad = torch.arange(self.rows) + self.vocab_start >= VOCAB
        if bool(pad.any()):
            logits = logits.masked_fill(pad, _MASKED_LOGIT)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, group).mean()


def init_global(seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights, a pure function of the seed (GPT-2 style)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * LAYERS)
    for name, rule in global_rules().items():
        if name.endswith(("ln1.weight", "ln2.weight", "lnf.weight")):
            out[name] = torch.ones(HIDDEN)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(3 * HIDDEN if rule["rule"] == "fused" else _bias_len(name))
        elif name == "embed.weight":
            out[name] = torch.randn(VOCAB, HIDDEN, generator=g) * std
        elif name == "pos.weight":
            out[name] = torch.randn(SEQ, HIDDEN, generator=g) * std
        else:
            rows, cols = _weight_shape(name)
            scale = proj_std if name.endswith(("proj.weight", "down.weight")) else std
            out[name] = torch.randn(rows, cols, generator=g) * scale
    return out


def _bias_len(name: str) -> int:
    return MLP if name.endswith("up.bias") else HIDDEN


def _weight_shape(name: str) -> tuple[int, int]:
    if name.endswith("qkv.weight"):
        return 3 * HIDDEN, HIDDEN
    if name.endswith("proj.weight"):
        return HIDDEN, HIDDEN
    if name.endswith("up.weight"):
        return MLP, HIDDEN
    return HIDDEN, MLP  # down.weight


def shard_of(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's piece of global tensor ``name`` (plain slicing, as the rules say)."""
    rule = global_rules()[name]
    kind = rule["rule"]
    if kind == "replicate":
        return full.clone()
    if kind == "vocab":
        padded = torch.zeros(padded_vocab(tp), *full.shape[1:])
        padded[: full.shape[0]] = full
        return padded.chunk(tp)[tp_rank].clone()
    if kind == "fused":
        return torch.cat([part.chunk(tp)[tp_rank] for part in full.chunk(3)]).clone()
    return full.chunk(tp, dim=rule["dim"])[tp_rank].clone()


def build_model(groups: Groups, tp_rank: int, seed: int) -> TinyGPT:
    """A fresh model: the global initialization, cut into this rank's shards."""
    model = TinyGPT(groups, tp_rank)
    full = init_global(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_of(name, full[name], groups.tp_size, tp_rank))
    return model
