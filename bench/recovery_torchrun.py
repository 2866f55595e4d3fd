"""bench.recovery's baseline, run for real: the demo job under torchrun, no trainguard.

The same fault schedule as trainguard's drill, on the same job (TP=2 x DP=2 on gloo, four
ranks, checkpoints every ``ckpt_every`` steps), launched by ``torchrun --max-restarts=3``
with PyTorch's defaults everywhere except one, stated in the output: the process groups'
timeout. Its default (30 min for gloo, 10 min for NCCL) would make every run last half an
hour, so the run uses ``--baseline-timeout-s`` (``TG_PG_TIMEOUT_S`` in the demo job) and the
figures are given twice: as measured with the shorter timeout, and extrapolated to the
default by adding the difference to the hang's detection time and the wall time (nothing
else in the run depends on it). Pass the default to measure it outright.

The faults, as the job itself meets them with nobody watching (``TRAINGUARD_FAULTS``):

- straggler: rank 3 (the second node's GPU that the drill throttles) sleeps
  ``straggler_delay_s`` per step from step ``W`` on, in every restart: a throttled GPU
  stays throttled, and nothing in torchrun or torch.distributed notices a slow rank;
- hang: rank 3 blocks before a collective at step ``2W + 30`` of the first launch; the
  other ranks' collectives time out after the process-group timeout, the ranks exit and
  torchrun restarts all of them from the newest checkpoint;
- xid (GPU lost): rank 0 exits 1 at step ``2W + 30 + W`` and at every step after it, in
  every launch, as a process on a lost GPU does; torchrun restarts the workers on the same
  node until ``--max-restarts`` is spent and the job fails. It stays down until a human
  acts: the wall time stops at the failure, which favours the baseline.

One torchrun runs all four ranks here (the drill's two nodes are local processes too); a
two-node torchrun restarts its whole worker group the same way.

Figures: goodput = productive step time / wall time, where productive steps are those kept
by the newest checkpoint the job can resume from (each at the healthy step time, as
trainguard's ledger counts them) and wall runs from the first step to the job's end; MTTR
per recovered fault, from the last step completed before it to the first step of the next
launch; steps lost = steps run that no checkpoint kept, then run again or never.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.cli.drill import HANG_LEAD_STEPS
from trainguard.ports import free_ports

STRAGGLER_RANK = 3
HANG_RANK = 3
XID_RANK = 0
NCCL_DEFAULT_TIMEOUT_S = 600.0
"""NCCL process groups' documented default timeout (10 min), for the extrapolation."""
#: rank 0's start line, printed by every launch of the demo job.
LAUNCHED = re.compile(r"^demojob: generation (\d+) (?:resumed from step (\d+))?")
#: Lines of torchrun's or a rank's output that mean the job noticed the hang.
NOTICED = re.compile(r"timed out|timeout|worker group failed|failed \(exitcode", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineConfig:
    warmup_steps: int
    straggler_delay_s: float
    ckpt_every: int
    step_sleep_s: float
    pg_timeout_s: float
    default_timeout_s: float
    max_restarts: int = 3
    nproc: int = 4
    tp: int = 2
    global_batch: int = 8

    @property
    def hang_step(self) -> int:
        return 2 * self.warmup_steps + HANG_LEAD_STEPS

    @property
    def xid_step(self) -> int:
        return self.hang_step + self.warmup_steps


def fault_spec(cfg: BaselineConfig) -> list[dict[str, Any]]:
    """The drill's three faults as the job meets them without trainguard (module doc)."""
    return [
        {"kind": "delay", "rank": STRAGGLER_RANK, "from_step": cfg.warmup_steps,
         "delay_s": cfg.straggler_delay_s},
        {"kind": "hang", "rank": HANG_RANK, "at_step": cfg.hang_step, "generation": 0},
        {"kind": "crash", "rank": XID_RANK, "from_step": cfg.xid_step, "exit_code": 1},
    ]  # fmt: skip


def _argv(cfg: BaselineConfig, base_port: int) -> list[str]:
    # torchrun counts restarts in TORCHELASTIC_RESTART_COUNT; the job and its fault spec
    # read TRAINGUARD_GENERATION (the hang is armed in the first launch only). Each launch
    # gets a TCPStore of its own on a fresh port: with torchrun's agent store, the
    # restarted gloo workers of torch 2.13 failed to connect ("connectFullMesh failed ...
    # Connection refused", reproduced here with a ten-line script), so no restart ever
    # trained; this is the workaround a user would apply, and it favours the baseline.
    rank_cmd = (
        'export TRAINGUARD_GENERATION="$TORCHELASTIC_RESTART_COUNT" '
        "TORCHELASTIC_USE_AGENT_STORE=False "
        f'MASTER_PORT=$(({base_port} + TORCHELASTIC_RESTART_COUNT)); exec "$0" -m demojob.train'
    )
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={cfg.nproc}", f"--max-restarts={cfg.max_restarts}",
        "--no-python", "sh", "-c", rank_cmd, sys.executable,
    ]  # fmt: skip


def run_baseline(cfg: BaselineConfig, workdir: Path, say: Any = None) -> dict[str, Any]:
    """Run the schedule under real torchrun; returns :func:`analyse`'s figures."""
    log = workdir / "loss.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TG_"))}
    env |= {
        "TRAINGUARD_JOB": "baseline",
        "TRAINGUARD_AGENT_SOCKET": str(workdir / "no-agent.sock"),
        "TRAINGUARD_FAULTS": json.dumps(fault_spec(cfg)),
        "TG_TP": str(cfg.tp),
        "TG_STEPS": "1000000",
        "TG_CKPT_DIR": str(workdir / "checkpoints"),
        "TG_CKPT_EVERY": str(cfg.ckpt_every),
        "TG_GLOBAL_BATCH": str(cfg.global_batch),
        "TG_STEP_SLEEP_S": str(cfg.step_sleep_s),
        "TG_LOG": str(log),
        "TG_PG_TIMEOUT_S": str(cfg.pg_timeout_s),
        "OMP_NUM_THREADS": "1",
    }
    # The run's own bound: every phase at the slowed pace, the hang's timeout, and the
    # restarts, with a wide margin; past it the run is a failure of the bench, not a figure.
    limit_s = 600.0 + cfg.pg_timeout_s + 4 * cfg.xid_step * (cfg.step_sleep_s + 1.0)
    argv = _argv(cfg, free_ports(cfg.max_restarts + 1))
    if say:
        say(f"torchrun baseline: {shlex.join(argv[:8])} ... (limit {limit_s:.0f} s)")
    lines: list[tuple[float, str]] = []
    started = time.time()
    proc = subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert proc.stdout is not None
    out = proc.stdout
    reader = threading.Thread(
        target=lambda: lines.extend((time.time(), line) for line in out), daemon=True
    )
    reader.start()
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"torchrun baseline did not end within {limit_s:.0f} s; last output:\n"
            + "".join(line for _, line in lines[-20:])
        ) from None
    ended = time.time()
    reader.join(timeout=5)
    (workdir / "torchrun.log").write_text("".join(line for _, line in lines))
    rows = _rows(log)
    if rc == 0 or not rows:
        raise RuntimeError(
            f"torchrun baseline ended with status {rc} after {len(rows)} steps, not the "
            "failure the schedule leads to; see " + str(workdir / "torchrun.log")
        )
    result = analyse(cfg, rows, lines, started_unix_s=started, ended_unix_s=ended)
    result["exit_status"] = rc
    return result


def _rows(log: Path) -> list[dict[str, Any]]:
    rows = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return rows


def analyse(
    cfg: BaselineConfig,
    rows: list[dict[str, Any]],
    output: Iterable[tuple[float, str]],
    *,
    started_unix_s: float,
    ended_unix_s: float,
) -> dict[str, Any]:
    """Figures of one baseline run from rank 0's step log and the timestamped output."""
    output = list(output)
    gen0 = [r for r in rows if r["generation"] == 0]
    healthy = [r for r in gen0 if r["step"] < cfg.warmup_steps]
    step_s = statistics.median(
        b["time_unix_s"] - a["time_unix_s"] for a, b in itertools.pairwise(healthy)
    )
    first_of: dict[int, dict[str, Any]] = {}
    for r in rows:
        first_of.setdefault(int(r["generation"]), r)
    generations = sorted(first_of)

    def last_before(gen: int, step: int) -> dict[str, Any] | None:
        done = [r for r in rows if r["generation"] == gen and r["step"] == step - 1]
        return done[-1] if done else None

    faults: list[dict[str, Any]] = []
    slowed = [r for r in rows if r["step"] >= cfg.warmup_steps]
    faults.append(
        {"fault": "straggler", "detect_s": None, "recover_s": None, "steps_lost": 0,
         "lost_s": round(len(slowed) * cfg.straggler_delay_s, 2),
         "note": "never noticed: the job ran at the slow rank's pace to its end"}
    )  # fmt: skip
    hang_from = last_before(0, cfg.hang_step)
    # The first launch after the hang that trained (a launch can fail before its first step).
    nxt = first_of[generations[1]] if len(generations) > 1 else None
    if hang_from is None or nxt is None:
        raise RuntimeError("the baseline run never reached its hang, or never restarted after it")
    t_hang = float(hang_from["time_unix_s"])
    noticed = next((t for t, line in output if t > t_hang and NOTICED.search(line)), None)
    hang_lost = max(0, cfg.hang_step - int(nxt.get("resumed_from", 0)))
    faults.append(
        {"fault": "hang", "detect_s": None if noticed is None else round(noticed - t_hang, 2),
         "recover_s": round(float(nxt["time_unix_s"]) - t_hang, 2), "steps_lost": hang_lost,
         "note": f"noticed at the process-group timeout ({cfg.pg_timeout_s:.0f} s here)"}
    )  # fmt: skip
    assert nxt is not None
    xid_from = last_before(int(nxt["generation"]), cfg.xid_step)
    # Launches that died before their first step log none: count them from the start line
    # rank 0 prints in every launch.
    started = [int(m.group(1)) for _, line in output if (m := LAUNCHED.search(line))]
    later = [g for g in sorted(set(started) | set(generations)) if g > int(nxt["generation"])]
    # The newest checkpoint any launch resumed from: what the failed job still holds.
    resumed = [int(r["resumed_from"]) for r in rows if r.get("resumed_from") is not None]
    resumed += [
        int(m.group(2)) for _, line in output if (m := LAUNCHED.search(line)) and m.group(2)
    ]
    kept = max(resumed, default=0)
    ran_after = [r for r in rows if r["generation"] >= int(nxt["generation"]) and r["step"] >= kept]
    faults.append(
        {"fault": "xid",
         "detect_s": None, "recover_s": None, "steps_lost": len(ran_after),
         "restarts_on_lost_gpu": len(later),
         "down_after_s": None if xid_from is None
         else round(ended_unix_s - float(xid_from["time_unix_s"]), 2),
         "note": f"{len(later)} restarts on the lost GPU failed; the job failed "
                 f"(torchrun exit status) and stays down until someone acts"}
    )  # fmt: skip
    start = float(rows[0]["time_unix_s"]) - step_s
    wall = ended_unix_s - start
    productive = kept * step_s
    recovered = [f["recover_s"] for f in faults if f["recover_s"] is not None]

    def at_timeout(timeout_s: float) -> dict[str, Any]:
        extra = max(0.0, timeout_s - cfg.pg_timeout_s)
        return {
            "goodput": round(productive / (wall + extra), 4),
            "mttr_s": None if not recovered else round(statistics.median(recovered) + extra, 2),
            "timeout_s": timeout_s,
            "how": "extrapolated: the measured run with its hang noticed "
            f"{extra:.0f} s later (a {timeout_s:.0f} s timeout, not {cfg.pg_timeout_s:.0f} s)",
        }

    return {
        "goodput": round(productive / wall, 4),
        "mttr_s": statistics.median(recovered) if recovered else None,
        "steps_lost": hang_lost + len(ran_after),
        "faults": faults,
        "unrecovered": [f["fault"] for f in faults if f["recover_s"] is None],
        "at_default_timeout": at_timeout(cfg.default_timeout_s),
        "at_nccl_default_timeout": at_timeout(NCCL_DEFAULT_TIMEOUT_S),
        "inputs": {
            "step_s": round(step_s, 4),
            "wall_s": round(wall, 2),
            "productive_s": round(productive, 2),
            "steps_kept": kept,
            "launches": len(generations),
            "startup_s": round(float(rows[0]["time_unix_s"]) - started_unix_s, 2),
            "pg_timeout_s": cfg.pg_timeout_s,
            "max_restarts": cfg.max_restarts,
            "ckpt_every": cfg.ckpt_every,
            "faults": fault_spec(cfg),
        },
        "how": "measured here: torchrun --max-restarts=3 running the demo job's 4 gloo ranks, "
        f"process-group timeout {cfg.pg_timeout_s:.0f} s (default {cfg.default_timeout_s:.0f} s)",
    }
