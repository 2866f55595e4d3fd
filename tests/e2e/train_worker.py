"""One rank of a small instrumented training job, for the detection end-to-end tests.

Real torch.distributed (gloo over loopback), real ``collectives`` instrumentation talking to
a real agent over its Unix socket. Each step does a little real work plus a fixed sleep, so
steps are periodic the way training steps are, and faults from ``TRAINGUARD_FAULTS`` act on
top. Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TRAINGUARD_JOB,
TRAINGUARD_AGENT_SOCKET, TRAINGUARD_FAULTS, TG_STEPS, TG_COMPUTE_S, TG_JITTER (each step's
sleep varies uniformly by ± this fraction, seeded per rank: ordinary noise, not a fault),
TG_PP (build a DeviceMesh of TG_PP pipeline stages x data-parallel replicas after
``instrument()``, from which the ranks' roles are derived) and TG_LAST_STAGE_EXTRA (the
last stage's ranks sleep this fraction longer, as a stage that computes the loss does).
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch
import torch.distributed as dist

import collectives


def main() -> None:
    dist.init_process_group("gloo")
    collectives.instrument()
    steps = int(os.environ.get("TG_STEPS", "100"))
    compute_s = float(os.environ.get("TG_COMPUTE_S", "0.05"))
    jitter = float(os.environ.get("TG_JITTER", "0"))
    noise = random.Random(dist.get_rank())
    pp = int(os.environ.get("TG_PP", "0"))
    if pp:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
        if mesh.get_coordinate() is not None and mesh.get_coordinate()[0] == pp - 1:
            compute_s *= 1.0 + float(os.environ.get("TG_LAST_STAGE_EXTRA", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        with collectives.step(step):
            x = torch.randn(32, 64)
            loss = model(x).pow(2).mean()
            loss.backward()
            time.sleep(compute_s * (1.0 + noise.uniform(-jitter, jitter)))
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
        if collectives.should_stop():
            break
    dist.barrier()
    collectives.uninstrument()
    dist.destroy_process_group()
    # Uninstrumented, nothing of ours runs at exit; skipping interpreter finalization avoids
    # a rare SIGABRT while gloo's threads wind down after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
