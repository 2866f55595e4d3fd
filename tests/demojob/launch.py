"""Launch the demo job the way the local-process actuator does: one ``python -m
demojob.train`` per rank, a torchrun-like environment, a free port per launch, no agent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def job_env(rank: int, world: int, port: int, tmp: Path, **tg: str | int | float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TG_", "TRAINGUARD_"))}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        TRAINGUARD_JOB="demo",
        # no agent listens here: collectives logs one line and training goes on
        TRAINGUARD_AGENT_SOCKET=str(tmp / "no-agent.sock"),
        TG_STEP_SLEEP_S="0",
    )
    env.update({k: str(v) for k, v in tg.items()})
    return env


@dataclass
class Run:
    codes: list[int]
    stdout: list[str]
    stderr: list[str]
    log: list[dict[str, Any]]

    def explain(self) -> str:
        return "\n".join(
            f"--- rank {r} exited {c}:\n{self.stdout[r][-2000:]}\n{self.stderr[r][-3000:]}"
            for r, c in enumerate(self.codes)
        )


def launch(
    world: int, tmp: Path, *, log: Path, timeout_s: float = 120, **tg: str | int | float
) -> Run:
    """Run every rank to completion; ``tg`` holds TG_*/TRAINGUARD_* overrides."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "demojob.train"],
            env=job_env(rank, world, port, tmp, TG_LOG=str(log), **tg),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout_s))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = log.read_text().splitlines() if log.exists() else []
    return Run(
        codes=[p.returncode for p in procs],
        stdout=[o for o, _ in outs],
        stderr=[e for _, e in outs],
        log=[json.loads(line) for line in lines],
    )
