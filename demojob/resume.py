"""Checkpoint glue: what the job saves, how it describes its shards, and how it resumes.

The saved state is ``{"model": module, "optim": Adam}``, so the engine copies parameters
and moments lazily behind the next forward/backward. Every tensor carries a global map from
a :class:`checkpoint.ShardingSpec` built from :func:`demojob.model.global_rules`, the same
rule for a parameter and for its Adam moments (``optim/state/<i>/exp_avg*``, ``i`` being
the parameter's index, which is the same in every layout). That makes each checkpoint
universal: a job with another TP or DP size fills its own shards from it.

Resume tries the committed checkpoints newest first, none past TRAINGUARD_RESUME_STEP (the
caller makes the ranks agree on one that every rank could load, then sets aside the step
directories newer than it). Saved by the same layout: every rank reads
back its own part (``checkpoint.load``: bit-exact, RNG included). Another layout:
``checkpoint.reshard`` fills this rank's parameters and moments from the saved fragments; the
Adam step count is the checkpoint step (one optimizer step per training step).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint import (
    CheckpointLayoutError,
    CheckpointStore,
    ParallelLayout,
    ShardingSpec,
    load,
    reshard,
)
from demojob.config import JobConfig
from demojob.model import global_rules


def sharding_spec(model: torch.nn.Module, cfg: JobConfig) -> ShardingSpec:
    rules: list[dict[str, Any]] = []
    by_name = global_rules()
    for index, (name, _) in enumerate(model.named_parameters()):
        rule = by_name[name]
        rules.append({"pattern": f"model/{name}", **rule})
        rules.append({"pattern": f"optim/state/{index}/exp_avg*", **rule})
    rules.append({"pattern": "optim/state/*/step", "rule": "replicate"})
    layout = ParallelLayout(tp=cfg.tp, tp_rank=cfg.tp_rank, dp=cfg.dp, dp_rank=cfg.dp_rank)
    return ShardingSpec(rules, layout=layout)


def train_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optim": optim}


@dataclass(frozen=True, kw_only=True, slots=True)
class Resumed:
    step: int
    """The first step to run (= steps completed when the checkpoint was taken)."""
    saved_tp: int
    saved_dp: int
    resharded: bool


def committed_steps(root: Path, *, at_most: int | None = None) -> list[int]:
    """Committed checkpoint steps to try, newest first (``latest`` pointer first), only those
    ``<= at_most`` when given (TRAINGUARD_RESUME_STEP: steps after it are what a rollback
    leaves behind, so neither the pointer nor a fallback may go past it).

    Every rank computes the same list: the directory is shared and nothing writes to it
    before the job has resumed.
    """
    if not root.is_dir():
        return []
    steps = CheckpointStore(root).candidates()
    return [s for s in steps if at_most is None or s <= at_most]


def _empty_adam_state(optim: torch.optim.Optimizer, step: int) -> dict[str, torch.Tensor]:
    """Give every parameter Adam state to fill; return it keyed by saved entry name."""
    targets: dict[str, torch.Tensor] = {}
    index = 0
    for group in optim.param_groups:
        for param in group["params"]:
            state = {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.zeros_like(param, memory_format=torch.contiguous_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.contiguous_format),
            }
            optim.state[param] = state
            targets[f"optim/state/{index}/exp_avg"] = state["exp_avg"]
            targets[f"optim/state/{index}/exp_avg_sq"] = state["exp_avg_sq"]
            index += 1
    return targets


def load_step(
    cfg: JobConfig, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int
) -> Resumed:
    """Load checkpoint ``step`` into ``model``/``optim``, resharding if its layout differs.

    Raises :class:`CheckpointError` (one line, naming the file or tensor) if it cannot.
    """
    with CheckpointStore(cfg.ckpt_dir).open(step) as reader:
        layout = dict(reader.manifest.layout)
    saved_tp, saved_dp = int(layout.get("tp", 0)), int(layout.get("dp", 0))
    if saved_tp < 1 or saved_dp < 1:
        raise CheckpointLayoutError(
            f"{cfg.ckpt_dir}: checkpoint step {step} has layout {layout}, not a demojob "
            "checkpoint (expected tp and dp)"
        )
    if (saved_tp, saved_dp) == (cfg.tp, cfg.dp):
        load(cfg.ckpt_dir, train_state(model, optim), rank=cfg.rank, step=step)
        return Resumed(step=step, saved_tp=saved_tp, saved_dp=saved_dp, resharded=False)
    targets: dict[str, torch.Tensor] = {
        f"model/{name}": tensor for name, tensor in model.state_dict().items()
    }
    targets.update(_empty_adam_state(optim, step))
    reshard(cfg.ckpt_dir, targets, sharding=sharding_spec(model, cfg), step=step)
    return Resumed(step=step, saved_tp=saved_tp, saved_dp=saved_dp, resharded=True)
