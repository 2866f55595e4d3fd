"""Launch the demo job the way the local-process actuator does: one ``python -m
demojob.train`` per rank, a torchrun-like environment, a free port per launch, no agent.

Each rank is forked from the session's torch zygote (tests/zygote.py) rather than a
fresh interpreter: the same program, without ~3 s of CPU importing torch per rank.

A launch returns once its ranks *and the checkpoint writer processes they started* have
exited. The writer (``checkpoint._writer_process``, the default ``writer="process"``)
outlives a rank that crashes, on purpose: it still persists and commits the snapshot that
was whole in shared memory (persist-at-breakpoint). Until it is done the checkpoint root is
not what the crash leaves: a test that copied it at once could miss the newest checkpoint
(on a loaded machine the commit of step 8 came after the crash at step 10; the relaunch
resumed from step 4)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.zygote import Zygote, ZygoteProcess
from trainguard.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Names one launch in the environment of its ranks and of the processes they start.
LAUNCH_VAR = "TG_TEST_LAUNCH"
WRITER_MODULE = b"checkpoint._writer_process"
#: How long a launch waits for its writers after its ranks (a few MB each to persist).
WRITERS_TIMEOUT_S = 60.0


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

    def __init__(self, zygote: Zygote, env: Mapping[str, str], out_dir: Path) -> None:
        self.out, self.err = out_dir / "stdout", out_dir / "stderr"
        self.proc: ZygoteProcess = zygote.spawn(
            ["-m", "demojob.train"], env=env, stdout=self.out, stderr=self.err, cwd=ROOT
        )

    def communicate(self, timeout: float) -> tuple[str, str]:
        """As ``Popen.communicate``: wait for the end, then (stdout, stderr)."""
        self.proc.wait(timeout=timeout)
        return self.out.read_text(), self.err.read_text()


def writers_of(launch_id: str) -> list[int]:
    """Live checkpoint writer processes of a launch (they inherit their rank's environment;
    a zombie has no command line and does not count)."""
    marker = f"{LAUNCH_VAR}={launch_id}".encode()
    pids: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if WRITER_MODULE not in (proc / "cmdline").read_bytes().split(b"\0"):
                continue
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def wait_for_writers(launch_id: str, timeout_s: float = WRITERS_TIMEOUT_S) -> list[int]:
    """Wait until the writer processes of a launch have exited (see the module docstring):
    a crashed rank's writer is still persisting and committing its last snapshot. Those
    still running after ``timeout_s`` are killed and returned."""
    deadline = time.monotonic() + timeout_s
    while pids := writers_of(launch_id):
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return pids
        time.sleep(0.05)
    return []


def start_rank(zygote: Zygote, env: Mapping[str, str], tmp: Path) -> Rank:
    return Rank(zygote, env, Path(tempfile.mkdtemp(prefix="rank-", dir=tmp)))


def launch(
    zygote: Zygote,
    world: int,
    tmp: Path,
    *,
    log: Path,
    timeout_s: float = 120,
    **tg: str | int | float,
) -> Run:
    """Run every rank to completion; ``tg`` holds TG_*/TRAINGUARD_* overrides."""
    port = free_port()
    launch_id = secrets.token_hex(8)
    envs = [job_env(rank, world, port, tmp, TG_LOG=str(log), **tg) for rank in range(world)]
    for env in envs:
        env[LAUNCH_VAR] = launch_id
    ranks = [start_rank(zygote, env, tmp) for env in envs]
    stray: list[int] = []
    outs: list[tuple[str, str]] = []
    try:
        for rank in ranks:
            outs.append(rank.communicate(timeout=timeout_s))
    finally:
        for rank in ranks:
            if rank.proc.poll() is None:
                rank.proc.kill()
                rank.proc.wait()
        stray = wait_for_writers(launch_id)
    assert not stray, f"checkpoint writers {stray} still ran {WRITERS_TIMEOUT_S} s after the ranks"
    lines = log.read_text().splitlines() if log.exists() else []
    codes = [rank.proc.wait() for rank in ranks]
    return Run(
        codes=codes,
        stdout=[o for o, _ in outs],
        stderr=[e for _, e in outs],
        log=[json.loads(line) for line in lines],
    )
