"""One rank of the demo job: ``python -m demojob.train`` (env contract in docs/demo-job.md).

Exit status: 0 after the last step or a controller stop (a checkpoint is durable first),
2 for a bad environment, 3 when the newest checkpoint cannot be loaded. Faults injected by
``TRAINGUARD_FAULTS`` (``collectives``) exit however the fault says.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist

import collectives
from checkpoint import CheckpointConfig, Checkpointer, CheckpointError
from demojob.config import JobConfig, JobConfigError, config_from_env
from demojob.data import local_batch
from demojob.model import build_model
from demojob.parallel import Groups, all_reduce_, make_groups
from demojob.resume import Resumed, committed_steps, load_step, sharding_spec, train_state

LR = 1e-2


def _die(code: int, message: str) -> NoReturn:
    print(f"demojob: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # no finalization: gloo threads of a half-started group can abort it


def _resume_all(cfg: JobConfig, model: torch.nn.Module, optim: Any) -> Resumed | None:
    """Resume every rank from the newest checkpoint that all of them can load.

    A checkpoint one rank cannot read (a damaged shard) is skipped by all ranks, with a
    warning, for the next older one; when none loads, every rank exits 3. ``None``: no
    checkpoint was ever committed, start fresh.
    """
    steps = committed_steps(cfg.ckpt_dir)
    error = ""
    for step in steps:
        resumed: Resumed | None = None
        try:
            resumed = load_step(cfg, model, optim, step)
        except CheckpointError as exc:
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        failed = torch.tensor([0.0 if resumed is not None else 1.0])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() == 0:
            return resumed
        if resumed is not None:
            error = f"another rank could not load step {step}"
        print(
            f"demojob: rank {cfg.rank}: skipping checkpoint step {step}: {error}",
            file=sys.stderr,
            flush=True,
        )
    if steps:
        _die(3, f"rank {cfg.rank}: cannot resume from {cfg.ckpt_dir}: {error}")
    return None


def _announce(cfg: JobConfig, resumed: Resumed | None) -> None:
    if cfg.rank != 0:
        return
    if resumed is None:
        line = f"generation {cfg.generation} started fresh at step 0 (tp={cfg.tp} dp={cfg.dp})"
    else:
        line = (
            f"generation {cfg.generation} resumed from step {resumed.step} "
            f"(tp={resumed.saved_tp} dp={resumed.saved_dp} -> tp={cfg.tp} dp={cfg.dp})"
        )
    print(f"demojob: {line}", flush=True)


def _train_step(
    cfg: JobConfig, step: int, model: torch.nn.Module, optim: Any, groups: Groups
) -> torch.Tensor:
    """Forward, backward, DP gradient average, Adam; returns this rank's loss."""
    tokens = local_batch(cfg.seed, step, cfg.global_batch, cfg.dp, cfg.dp_rank)
    loss: torch.Tensor = model(tokens)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if groups.dp is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])  # one call for all gradients
        all_reduce_(flat, groups.dp).div_(groups.dp_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def _log_line(out: TextIO | None, record: dict[str, Any]) -> None:
    if out is not None:
        out.write(json.dumps(record) + "\n")
        out.flush()


def run(cfg: JobConfig) -> int:
    dist.init_process_group("gloo")
    try:
        collectives.instrument()
    except collectives.CollectivesConfigError as exc:
        _die(2, str(exc))
    groups = make_groups(cfg.world_size, cfg.tp, cfg.rank)
    torch.manual_seed(cfg.seed)
    model = build_model(groups, cfg.tp_rank, cfg.seed)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    resumed = _resume_all(cfg, model, optim)
    _announce(cfg, resumed)
    ckpt = Checkpointer(
        CheckpointConfig(root=cfg.ckpt_dir),
        rank=cfg.rank,
        world_size=cfg.world_size,
        layout={"tp": cfg.tp, "dp": cfg.dp},
        job=os.environ["TRAINGUARD_JOB"],
        event_sink=collectives.report_checkpoint,
        sharding=sharding_spec(model, cfg),
    )
    state = train_state(model, optim)
    start = resumed.step if resumed is not None else 0
    last_saved = start
    log: TextIO | None = None
    if cfg.rank == 0 and cfg.log_path is not None:
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = cfg.log_path.open("a", encoding="utf-8")
    for step in range(start, cfg.steps):
        with collectives.step(step):
            loss = _train_step(cfg, step, model, optim, groups)
            time.sleep(cfg.step_sleep_s)
            # loss sum, stop and checkpoint requests, agreed by all ranks in one call:
            # ranks learn of a controller command at different steps
            agreed = torch.stack(
                [
                    loss,
                    torch.tensor(float(collectives.should_stop())),
                    torch.tensor(float(collectives.should_checkpoint(step))),
                ]
            )
            dist.all_reduce(agreed)
        record: dict[str, Any] = {
            "step": step,
            "loss": agreed[0].item() / cfg.world_size,
            "generation": cfg.generation,
            "world_size": cfg.world_size,
            "tp": cfg.tp,
            "dp": cfg.dp,
            "time_unix_s": time.time(),
        }
        if step == start and resumed is not None:
            record["resumed_from"] = resumed.step
        _log_line(log, record)
        done, stop, asked = step + 1, agreed[1].item() > 0, agreed[2].item() > 0
        if done != last_saved and (
            done % cfg.ckpt_every == 0 or asked or stop or done == cfg.steps
        ):
            ckpt.save(state, done)  # labelled by steps completed: resume runs step `done`
            last_saved = done
        if stop:
            break
    ckpt.close()  # durable on every rank, committed by rank 0
    if log is not None:
        log.close()
    dist.barrier()
    collectives.uninstrument()
    dist.destroy_process_group()
    return 0


def main() -> NoReturn:
    try:
        cfg = config_from_env()
    except JobConfigError as exc:
        _die(2, f"bad environment: {exc}")
    code = run(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    # Uninstrumented and closed, nothing of ours runs at exit; skipping interpreter
    # finalization avoids a rare SIGABRT while gloo's threads wind down.
    os._exit(code)


if __name__ == "__main__":
    main()
