"""One rank of the demo job: ``python -m demojob.train`` (env contract in docs/demo-job.md).

Exit status: 0 after the last step or a controller stop (a checkpoint is durable first),
2 for a bad environment, 3 when no checkpoint can be loaded (a damaged one on every
candidate, none at or before TRAINGUARD_RESUME_STEP) or the newer step directories cannot be
set aside. Faults injected by
``TRAINGUARD_FAULTS`` (``collectives``) exit however the fault says.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn, TextIO

import torch
import torch.distributed as dist

import collectives
from checkpoint import CheckpointConfig, Checkpointer, CheckpointError, CheckpointStore
from demojob.config import JobConfig, JobConfigError, config_from_env
from demojob.data import local_batch
from demojob.model import build_model
from demojob.optim import Adam
from demojob.parallel import Groups, all_reduce_, make_groups
from demojob.resume import Resumed, committed_steps, load_step, sharding_spec, train_state

LR = 1e-2


def _die(code: int, message: str) -> NoReturn:
    print(f"demojob: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # no finalization: gloo threads of a half-started group can abort it


def _check_same_bound(cfg: JobConfig) -> None:
    """Exit 2 unless every rank got the same TRAINGUARD_RESUME_STEP.

    Ranks with different bounds would walk different candidate lists in step with each
    other's all-reduces and could resume from different checkpoints without noticing.
    """
    bound = -1 if cfg.resume_step is None else cfg.resume_step
    seen = torch.tensor([bound, -bound], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # [max, -min]
    if int(seen[0]) != bound or int(seen[1]) != -bound:
        lo, hi = -int(seen[1]), int(seen[0])
        _die(2, f"bad environment: TRAINGUARD_RESUME_STEP differs between ranks ({lo}..{hi})")


def _resume_all(cfg: JobConfig, model: torch.nn.Module, optim: Any) -> Resumed | None:
    """Resume every rank from the newest checkpoint that all of them can load, none past
    TRAINGUARD_RESUME_STEP when it is set.

    A checkpoint one rank cannot read (a damaged shard) is skipped by all ranks, with a
    warning, for the next older one; when none loads, every rank exits 3. ``None``: no
    checkpoint was ever committed, start fresh. A bound with no committed checkpoint at or
    before it also exits 3: the controller asked for that rollback point (the steps after
    it may hold NaNs), and starting over instead would throw away the run it meant to keep.
    """
    _check_same_bound(cfg)
    steps = committed_steps(cfg.ckpt_dir, at_most=cfg.resume_step)
    if not steps and cfg.resume_step is not None:
        committed = sorted(set(committed_steps(cfg.ckpt_dir)))
        _die(
            3,
            f"rank {cfg.rank}: cannot resume from {cfg.ckpt_dir}: no committed checkpoint at "
            f"or before TRAINGUARD_RESUME_STEP={cfg.resume_step} "
            f"(committed: {', '.join(map(str, committed)) or 'none'})",
        )
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


def _run_id(cfg: JobConfig) -> str:
    """One id for this start of the job, the same on every rank (rank 0 draws it).

    Stamped into every rank's checkpoint parts and written to the checkpoint root's fence
    (``checkpoint._commit``): rank 0 commits only this run's parts, and a writer process of
    an earlier run that is still persisting stops instead of committing behind our back.
    """
    box = [f"gen{cfg.generation}-{secrets.token_hex(6)}" if cfg.rank == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _set_aside_newer(cfg: JobConfig, resumed: Resumed | None, run_id: str) -> None:
    """Rank 0 moves the step directories newer than the resume point into ``abandoned/``;
    then every rank waits for it.

    This run saves those step numbers again: a rank manifest left there by the abandoned
    timeline could be committed as a peer's part of the new checkpoint, and ``latest``
    could offer the abandoned state on the next restart. Every rank has finished reading
    checkpoints by now (the resume agreement is a collective), and the barrier keeps any
    rank from saving before the move. On a fresh start only partial directories can be
    there (a committed one would have been resumed from, or exited 3): they go too.
    """
    if cfg.rank == 0:
        after = resumed.step if resumed is not None else -1
        store = CheckpointStore(cfg.ckpt_dir)
        try:
            moved = store.set_aside_after(after, run_id=run_id)
        except OSError as exc:
            _die(3, f"rank 0: cannot set aside checkpoints newer than step {after}: {exc}")
        if moved:
            why = (
                "before a fresh start" if resumed is None else f"newer than the resume step {after}"
            )
            print(
                f"demojob: rank 0: set aside checkpoint steps {', '.join(map(str, moved))} "
                f"({why}) in {store.abandoned_root}",
                file=sys.stderr,
                flush=True,
            )
    dist.barrier()


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
    if cfg.resume_step is not None:
        line += f", TRAINGUARD_RESUME_STEP={cfg.resume_step}"
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
    timeout = None if cfg.pg_timeout_s is None else timedelta(seconds=cfg.pg_timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    try:
        collectives.instrument()
    except collectives.CollectivesConfigError as exc:
        _die(2, str(exc))
    groups = make_groups(cfg.world_size, cfg.tp, cfg.rank, timeout)
    torch.manual_seed(cfg.seed)
    model = build_model(groups, cfg.tp_rank, cfg.seed)
    optim = Adam(model.parameters(), lr=LR)
    resumed = _resume_all(cfg, model, optim)
    run_id = _run_id(cfg)
    _set_aside_newer(cfg, resumed, run_id)
    _announce(cfg, resumed)
    ckpt = Checkpointer(
        CheckpointConfig(root=cfg.ckpt_dir, keep_last=cfg.ckpt_keep),
        rank=cfg.rank,
        world_size=cfg.world_size,
        layout={"tp": cfg.tp, "dp": cfg.dp},
        job=os.environ["TRAINGUARD_JOB"],
        event_sink=collectives.report_checkpoint,
        sharding=sharding_spec(model, cfg),
        run_id=run_id,
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
            vote = collectives.checkpoint_vote(step)
            agreed = torch.stack(
                [
                    loss,
                    torch.tensor(float(collectives.should_stop())),
                    torch.tensor(float(vote > 0)),
                    torch.tensor(float(ckpt.busy())),
                ]
            )
            dist.all_reduce(agreed)
            if agreed[2].item() > 0:
                # Which request: its copies reach the nodes steps apart, and each copy
                # answered on its own would be another full checkpoint (every rank
                # takes this branch, so the extra call is collective too).
                newest = torch.tensor([float(vote)], dtype=torch.float64)
                dist.all_reduce(newest, op=dist.ReduceOp.MAX)
                collectives.checkpoint_agreed(int(newest.item()))
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
        required = asked or stop or done == cfg.steps  # never skipped: waits for a buffer
        if done != last_saved and (done % cfg.ckpt_every == 0 or required):
            # With TG_CKPT_SKIP_BUSY, a periodic save while any rank's previous one is still
            # being written is skipped by every rank (agreed above), never by some: a step
            # only some ranks saved could not commit; rank 0 would wait for missing parts.
            if required or not cfg.ckpt_skip_busy or agreed[3].item() == 0:
                ckpt.save(state, done, required=True)  # labelled by steps completed
                last_saved = done
            else:
                ckpt.skip(done)
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
