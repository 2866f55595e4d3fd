"""Synthetic step summaries of a synchronous job for the C4D detector tests: one record per
rank per step, every rank waiting for the slowest, ranks placed ``per_node`` to a node."""

from __future__ import annotations

import random

from trainguard.wire import StepSummary

JOB = "llm-7b"


def node_of(rank: int, per_node: int = 4) -> str:
    return f"node-{rank // per_node}"


def step_records(
    step: int,
    world: int,
    *,
    compute: dict[int, float] | None = None,
    base_compute: float = 1.0,
    comm_s: float = 0.1,
    jitter: float = 0.0,
    rng: random.Random | None = None,
) -> list[StepSummary]:
    """Per-rank summaries of one synchronous step: everyone waits for the slowest."""
    rng = rng or random.Random(step)
    times = {
        r: (compute or {}).get(r, base_compute) * (1 + rng.uniform(-jitter, jitter))
        for r in range(world)
    }
    slowest = max(times.values())
    comm_s *= 1 + rng.uniform(-jitter, jitter)  # the transfer itself is noisy too
    return [
        StepSummary(
            job=JOB,
            rank=r,
            world_size=world,
            step=step,
            compute_time_s=c,
            collective_wait_s=(slowest - c) + comm_s,
            step_time_s=slowest + comm_s,
            gpu_index=r % 4,
        )
        for r, c in times.items()
    ]
