"""The job's settings, read from the environment a launcher (torchrun, our actuators) sets.

Everything is checked before ``init_process_group`` so a bad value costs one line on
stderr and exit status 2, not a rank waiting forever for peers that already died.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Attention heads of the model; the tensor-parallel size must divide it.
N_HEADS = 4


class JobConfigError(ValueError):
    """A missing or malformed setting; the message names it and says what was expected."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    rank: int
    world_size: int
    local_rank: int
    generation: int
    """Restart count from TRAINGUARD_GENERATION (0 on the first launch); only logged."""
    resume_step: int | None
    """TRAINGUARD_RESUME_STEP: resume from the newest committed checkpoint at or before this
    step (the controller's rollback point); ``None`` (unset or empty): the newest one."""
    tp: int
    """Tensor-parallel size; DP = world_size / tp."""
    steps: int
    """Total steps of the run; the job exits 0 after step ``steps - 1``."""
    ckpt_dir: Path
    ckpt_every: int
    """Steps between periodic checkpoints: a checkpoint after every ``ckpt_every`` steps."""
    ckpt_skip_busy: bool = False
    """TG_CKPT_SKIP_BUSY=1: a periodic checkpoint that comes due while any rank's previous
    one is still being written is skipped by every rank, so training never waits on
    storage. Off by default: the demo's tests and the controller's rollback expect a
    checkpoint at every ``ckpt_every`` steps, which then may cost a wait on a slow disk."""
    global_batch: int
    """Sequences per step over the whole job; fixed across restarts so the curve continues."""
    step_sleep_s: float
    """Seconds slept inside each step, so steps are periodic like real ones."""
    log_path: Path | None
    seed: int
    pg_timeout_s: float | None = None
    """TG_PG_TIMEOUT_S: the process groups' timeout (world and every subgroup). Unset:
    torch's default (30 min for gloo). Set short by ``bench.recovery``'s torchrun baseline,
    whose hang is noticed only when this timeout fires."""
    ckpt_keep: int = 3
    """TG_CKPT_KEEP: committed checkpoints retention keeps (``CheckpointConfig.keep_last``).
    A rollback can only go back to one of them: the NaN end-to-end test keeps all of its
    checkpoints, so its rollback target outlasts any detection delay on a loaded machine."""

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        """TP varies fastest over global ranks (Megatron's order): ranks 0..tp-1 form a group."""
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp


def _int(env: Mapping[str, str], name: str, default: int | None, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise JobConfigError(f"{name} is not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise JobConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise JobConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _optional_int(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    """An integer setting whose absence means something; empty counts as absent, because a
    Kubernetes downward-API mapping of a missing annotation gives an empty string."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return _int(env, name, None, minimum=minimum)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise JobConfigError(f"{name}={raw!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise JobConfigError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


def _pg_timeout(env: Mapping[str, str]) -> float | None:
    if not env.get("TG_PG_TIMEOUT_S"):
        return None
    value = _float(env, "TG_PG_TIMEOUT_S", 0.0)
    if value <= 0:
        raise JobConfigError(f"TG_PG_TIMEOUT_S must be > 0 seconds, got {value}")
    return value


def config_from_env(env: Mapping[str, str] | None = None) -> JobConfig:
    """Parse and cross-check the settings; :class:`JobConfigError` names the first bad one."""
    env = os.environ if env is None else env
    for name in ("MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_JOB"):
        if not env.get(name):
            raise JobConfigError(f"{name} is not set")
    world = _int(env, "WORLD_SIZE", None, minimum=1)
    rank = _int(env, "RANK", None, minimum=0)
    if rank >= world:
        raise JobConfigError(f"RANK {rank} is outside WORLD_SIZE {world}")
    tp = _int(env, "TG_TP", None, minimum=1)
    if world % tp:
        raise JobConfigError(f"TG_TP={tp} does not divide WORLD_SIZE={world}")
    if N_HEADS % tp:
        raise JobConfigError(f"TG_TP={tp} must divide the model's {N_HEADS} attention heads")
    batch = _int(env, "TG_GLOBAL_BATCH", 8, minimum=1)
    if batch % (world // tp):
        raise JobConfigError(
            f"TG_GLOBAL_BATCH={batch} is not divisible by the data-parallel size {world // tp}"
        )
    ckpt_dir = env.get("TG_CKPT_DIR", "")
    if not ckpt_dir:
        raise JobConfigError("TG_CKPT_DIR is not set (the checkpoint root all ranks share)")
    log_path = env.get("TG_LOG", "")
    return JobConfig(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", rank, minimum=0),
        generation=_int(env, "TRAINGUARD_GENERATION", 0, minimum=0),
        resume_step=_optional_int(env, "TRAINGUARD_RESUME_STEP", minimum=0),
        tp=tp,
        steps=_int(env, "TG_STEPS", None, minimum=1),
        ckpt_dir=Path(ckpt_dir),
        ckpt_every=_int(env, "TG_CKPT_EVERY", 5, minimum=1),
        ckpt_skip_busy=bool(_int(env, "TG_CKPT_SKIP_BUSY", 0, minimum=0)),
        global_batch=batch,
        step_sleep_s=_float(env, "TG_STEP_SLEEP_S", 0.1),
        log_path=Path(log_path) if log_path else None,
        seed=_int(env, "TG_SEED", 0, minimum=0),
        pg_timeout_s=_pg_timeout(env),
        ckpt_keep=_int(env, "TG_CKPT_KEEP", 3, minimum=1),
    )
