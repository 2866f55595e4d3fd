"""bench.detect's PyTorch and Flight Recorder baselines, measured on real gloo runs.

Four ranks (torch.distributed, gloo over loopback, Flight Recorder on through
``TORCH_FR_BUFFER_SIZE``) train a small data-parallel loop with nobody watching, once per
fault: a hung rank, a crashed rank, a straggler, a slow link, a NaN gradient, and a healthy
run. Each run measures what PyTorch itself does:

- ``pytorch defaults``: whether the job notices at all, and when (the first rank's
  exception, from the last step completed before the fault); it names nobody: the error is
  raised on every surviving rank. The process groups' timeout is ``timeout_s`` here (a
  10 min default would make each run last 10 min); the detection time is also given
  extrapolated to NCCL's default (600 s) and gloo's (1800 s), labelled so.
- ``flight recorder``: the same run, with each rank dumping its Flight Recorder buffer when
  the job notices, as ``TORCH_NCCL_DUMP_ON_TIMEOUT`` does on NCCL (the first rank to fail
  signals the others through the store; a hung rank's dump thread answers too). The
  culprit is what the Flight Recorder analysis (``trainguard.flight_recorder.analyze``, the
  code the controller runs on a hang's dumps) reads from the real dumps: the ranks that never
  entered the collective the others are stuck in.

False positives are counted on the healthy run and on the steps before each fault: any
exception there would be one.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from trainguard.flight_recorder import analyze

WORLD = 4
STEPS = 40
FAULT_STEP = 15
STEP_S = 0.03
NCCL_DEFAULT_TIMEOUT_S = 600.0
GLOO_DEFAULT_TIMEOUT_S = 1800.0

#: Fault per scenario (``TRAINGUARD_FAULTS``) and the ranks a correct verdict names.
SCENARIOS: list[dict[str, Any]] = [
    {"name": "healthy", "faults": [], "culprit": []},
    {"name": "hang", "faults": [{"kind": "hang", "rank": 2, "at_step": FAULT_STEP}],
     "culprit": [2]},
    {"name": "crash", "faults": [{"kind": "crash", "rank": 1, "at_step": FAULT_STEP,
                                  "exit_code": 1}], "culprit": [1]},
    {"name": "straggler", "faults": [{"kind": "delay", "rank": 3, "from_step": FAULT_STEP,
                                      "delay_s": 0.05}], "culprit": [3]},
    {"name": "slow_link", "faults": [{"kind": "slow_link", "ranks": [0, 1],
                                      "from_step": FAULT_STEP, "delay_s": 0.02}],
     "culprit": [0, 1]},
    {"name": "nan", "faults": [{"kind": "nan", "rank": 0, "at_step": FAULT_STEP,
                                "op": "all_reduce", "call": 1}], "culprit": [0]},
]  # fmt: skip


def _rank(rank: int, tmp: str, sc: dict[str, Any], timeout_s: float) -> None:
    """One rank: train, and when the job fails, note the time and dump Flight Recorder."""
    from datetime import timedelta

    os.environ.update(
        {
            "TRAINGUARD_JOB": "baseline-" + sc["name"].replace("_", "-"),
            "TRAINGUARD_AGENT_SOCKET": os.path.join(tmp, "no-agent.sock"),
            "TRAINGUARD_FAULTS": json.dumps(sc["faults"]),
            "TORCH_FR_BUFFER_SIZE": "2000",
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    import collectives
    from collectives import flight

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), WORLD)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s)
    )
    collectives.instrument()
    out = Path(tmp)
    dumped = threading.Event()

    def dump_once(why: str) -> None:
        if dumped.is_set():
            return
        dumped.set()
        data = {"noticed_unix_s": time.time(), "why": why[:300], "fr": flight.dump()}
        (out / f"dump-{rank}.json").write_text(json.dumps(data))

    def answer_dump_signal() -> None:
        # TORCH_NCCL_DUMP_ON_TIMEOUT: the first rank to time out tells the others to dump.
        while not dumped.is_set():
            if (out / "dump-signal").exists():
                dump_once("signalled")
                return
            time.sleep(0.05)

    threading.Thread(target=answer_dump_signal, daemon=True).start()
    grad = torch.ones(1024)
    try:
        for step in range(STEPS):
            with collectives.step(step):
                time.sleep(STEP_S)
                dist.all_reduce(grad)
                finite = bool(torch.isfinite(grad).all())
                if rank == 0:
                    with (out / "steps.jsonl").open("a") as f:
                        f.write(json.dumps({"step": step, "t": time.time(), "finite": finite}))
                        f.write("\n")
                grad.fill_(1.0)
        dist.barrier()
    except Exception as exc:  # the job noticing: what the baseline measures
        (out / "dump-signal").touch()
        dump_once(f"{type(exc).__name__}: {exc}")
        os._exit(1)
    collectives.uninstrument()
    dist.destroy_process_group()


def run_scenario(sc: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one scenario on ``WORLD`` real gloo ranks; what PyTorch noticed and when."""
    import multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tgbase") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, tmp, sc, timeout_s)) for r in range(WORLD)]
        for p in procs:
            p.start()
        # Generous: on a loaded 2-core machine, importing torch alone can take a minute.
        deadline = time.monotonic() + 600 + timeout_s + STEPS * STEP_S * 4
        ended = False
        # A hung rank never returns by itself: once the others have failed and every rank
        # that could dump did, it is stopped, as torchrun stops the rest of a failed group.
        while time.monotonic() < deadline:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                ended = True
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                grace = time.monotonic() + 5.0
                while time.monotonic() < grace and len(list(Path(tmp).glob("dump-*.json"))) < WORLD:
                    time.sleep(0.1)
                ended = True
                break
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if not ended:
            raise RuntimeError(f"baseline scenario {sc['name']!r} did not end in time")
        steps = [json.loads(line) for line in _lines(Path(tmp) / "steps.jsonl")]
        if not steps:
            raise RuntimeError(f"baseline scenario {sc['name']!r}: no step ran (see stderr)")
        dumps = {}
        for path in Path(tmp).glob("dump-*.json"):
            dumps[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return {"steps": steps, "dumps": dumps, "exit_codes": [p.exitcode for p in procs]}


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def judge(sc: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Both baselines' verdicts on one run."""
    steps, dumps = run["steps"], run["dumps"]
    noticed = min((d["noticed_unix_s"] for d in dumps.values() if d["why"] != "signalled"),
                  default=None)  # fmt: skip
    before = [s for s in steps if s["step"] < FAULT_STEP]
    t_fault = before[-1]["t"] if before else None
    detected = noticed is not None
    detect_s = None if not detected or t_fault is None else round(noticed - t_fault, 2)
    healthy_steps = len(before) if sc["faults"] else len(steps)
    # An error in the healthy run, or before the fault struck, would be a false alarm.
    early = noticed is not None and t_fault is not None and noticed < t_fault
    false_positive = detected and (not sc["faults"] or early)
    named: list[int] = []
    if dumps:
        found = analyze({r: d["fr"] for r, d in dumps.items()}, {"0": list(range(WORLD))})
        named = sorted({r for d in found for r in d.missing})
    return {
        "scenario": sc["name"],
        "culprit": sc["culprit"],
        "detected": detected,
        "detect_s": detect_s,
        "healthy_steps": healthy_steps,
        "false_positive": bool(false_positive),
        "ranks_dumped": sorted(dumps),
        "flight_named": named,
        "why": min(
            ((d["noticed_unix_s"], d["why"]) for d in dumps.values() if d["why"] != "signalled"),
            default=(None, None),
        )[1],
        "nonfinite_steps": sum(1 for s in steps if not s["finite"]),
    }


def measured_baselines(timeout_s: float = 5.0) -> dict[str, Any]:
    """Run every scenario once; the two baselines' figures, the shape ``bench.detect`` uses."""
    rows = [judge(sc, run_scenario(sc, timeout_s)) for sc in SCENARIOS]
    faulty = [r for r in rows if r["culprit"]]
    healthy = sum(r["healthy_steps"] for r in rows)
    fps = sum(r["false_positive"] for r in rows)
    hang = [r["detect_s"] for r in rows if r["scenario"] == "hang" and r["detect_s"] is not None]

    def figures(name: str, named_of: Any, how: str) -> dict[str, Any]:
        correct = [r for r in faulty if r["detected"] and named_of(r) == r["culprit"]]
        p50 = statistics.median(hang) if hang else None
        return {
            "name": name,
            "how": how,
            "localization_accuracy": round(len(correct) / len(faulty), 3),
            "detected": f"{sum(r['detected'] for r in faulty)}/{len(faulty)}",
            "false_positives_per_1k_steps": round(1000 * fps / max(1, healthy), 3),
            "healthy_steps": healthy,
            "hang_detect_s_p50": p50,
            "hang_detect_s_p50_at_nccl_default": None if p50 is None
            else round(p50 + NCCL_DEFAULT_TIMEOUT_S - timeout_s, 2),
            "hang_detect_s_p50_at_gloo_default": None if p50 is None
            else round(p50 + GLOO_DEFAULT_TIMEOUT_S - timeout_s, 2),
            "straggler_detect_steps_p50": None,
            "scenarios": [
                {"scenario": r["scenario"], "detected": r["detected"], "named": named_of(r),
                 "correct": r in correct, "detect_s": r["detect_s"], "why": r["why"]}
                for r in rows
            ],
        }  # fmt: skip

    base = (
        f"measured here: {WORLD} gloo ranks, one run per fault, process-group timeout "
        f"{timeout_s:.0f} s (the *_at_*_default figures are extrapolated)"
    )
    return {
        "timeout_s": timeout_s,
        "world": WORLD,
        "pytorch": figures("pytorch defaults", lambda r: [], base + "; the error names nobody"),
        "flight": figures(
            "flight recorder (dump on timeout)",
            lambda r: r["flight_named"],
            base + "; culprit from trainguard.flight_recorder.analyze on the real dumps",
        ),
        "runs": rows,
    }


if __name__ == "__main__":
    print(json.dumps(measured_baselines(), indent=1))
