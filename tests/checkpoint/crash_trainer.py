"""A trainer run in a child process by test_crash.py so that it can be killed with SIGKILL.

Its one parameter equals the number of optimizer steps taken, so any checkpoint whose
payload is not uniformly equal to its step number is torn.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from checkpoint import CheckpointConfig, Checkpointer


def run(root: str, writer: str, mode: str, numel: int, conn: Connection) -> None:
    payload = torch.nn.Parameter(torch.zeros(numel))
    model = torch.nn.ParameterDict({"payload": payload})
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = CheckpointConfig(root=root, writer=writer, keep_last=2, when_busy="wait")  # type: ignore[arg-type]
    ckpt = Checkpointer(cfg)
    writer_pid = ckpt._writer._proc.pid if writer == "process" else 0  # type: ignore[union-attr]
    conn.send(f"writer {writer_pid}")
    step = 0
    while True:
        payload.grad = torch.full_like(payload, -1.0)
        opt.step()
        step += 1
        ckpt.save({"model": model, "optim": opt, "step": step}, step=step)
        if mode == "breakpoint":
            ckpt.wait_for_copies()  # the snapshot is whole in host memory now
            conn.send(f"snapshot {step}")
            time.sleep(3600)
        conn.send(f"saved {step}")
