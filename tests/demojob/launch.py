"""Launch the demo job the way the local-process actuator does: one ``python -m
demojob.train`` per rank, a torchrun-like environment, a free port per launch, no agent.

Each rank is forked from the session's torch zygote (tests/torch_zygote.py) rather than a
fresh interpreter: the same program, without ~3 s of CPU importing torch per rank."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.torch_zygote import TorchZygote, ZygoteProcess

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


class Rank:
    """One ``python -m demojob.train`` from the zygote, its stdout and stderr in files."""

    def __init__(self, zygote: TorchZygote, env: Mapping[str, str], out_dir: Path) -> None:
        self.out, self.err = out_dir / "stdout", out_dir / "stderr"
        self.proc: ZygoteProcess = zygote.spawn(
            ["-m", "demojob.train"], env=env, stdout=self.out, stderr=self.err, cwd=ROOT
        )

    def communicate(self, timeout: float) -> tuple[str, str]:
        """As ``Popen.communicate``: wait for the end, then (stdout, stderr)."""
        self.proc.wait(timeout=timeout)
        return self.out.read_text(), self.err.read_text()


def start_rank(zygote: TorchZygote, env: Mapping[str, str], tmp: Path) -> Rank:
    return Rank(zygote, env, Path(tempfile.mkdtemp(prefix="rank-", dir=tmp)))


def launch(
    zygote: TorchZygote,
    world: int,
    tmp: Path,
    *,
    log: Path,
    timeout_s: float = 120,
    **tg: str | int | float,
) -> Run:
    """Run every rank to completion; ``tg`` holds TG_*/TRAINGUARD_* overrides."""
    port = free_port()
    ranks = [
        start_rank(zygote, job_env(rank, world, port, tmp, TG_LOG=str(log), **tg), tmp)
        for rank in range(world)
    ]
    outs: list[tuple[str, str]] = []
    try:
        for rank in ranks:
            outs.append(rank.communicate(timeout=timeout_s))
    finally:
        for rank in ranks:
            if rank.proc.poll() is None:
                rank.proc.kill()
                rank.proc.wait()
    lines = log.read_text().splitlines() if log.exists() else []
    codes = [rank.proc.wait() for rank in ranks]
    return Run(
        codes=codes,
        stdout=[o for o, _ in outs],
        stderr=[e for _, e in outs],
        log=[json.loads(line) for line in lines],
    )
