"""One rank of a multi-process test job (launched by conftest.launch_ranks).

Usage: ``python rank_worker.py <scenario> <out_dir>``; writes ``rank<N>.json`` with what the
rank observed. Real torch.distributed (gloo on loopback, file store), real instrumentation.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import collectives

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def init() -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=RANK, world_size=WORLD
    )


def history() -> list[dict[str, Any]]:
    session = collectives.current()
    assert session is not None
    return [
        {
            "op": r.op,
            "group": r.group,
            "seq": r.seq,
            "size_bytes": r.size_bytes,
            "dtype": r.dtype,
            "enter_s": r.enter_s,
            "exit_s": r.exit_s,
            "async_op": r.async_op,
            "step": r.step,
            "ok": r.ok,
        }
        for r in session.recorder.history
    ]


def wait_connected(timeout_s: float = 15.0) -> None:
    session = collectives.current()
    assert session is not None
    deadline = time.monotonic() + timeout_s
    while not session.client.connected and time.monotonic() < deadline:
        time.sleep(0.02)


def scenario_ops(out: Path) -> dict[str, Any]:
    """Every wrapped op once, async handles, a sub-group, p2p, then uninstrument."""
    original = dist.all_reduce
    sub = dist.new_group([0, 2])
    session = collectives.instrument()
    wrapped = dist.all_reduce is not original
    probe_group = session.probe_group
    probe_group_info = {
        "ranks": dist.get_process_group_ranks(probe_group),
        "own": probe_group is not dist.group.WORLD,
        "device": str(session.probe_device),
    }
    f = lambda n: torch.full((n,), float(RANK + 1))  # noqa: E731
    with collectives.step(0):
        dist.all_reduce(f(4))
        dist.all_gather([f(4) for _ in range(WORLD)], f(4))
        dist.all_gather_into_tensor(f(4 * WORLD), f(4))
        dist.reduce_scatter(f(4), [f(4) for _ in range(WORLD)])
        dist.reduce_scatter_tensor(f(4), f(4 * WORLD))
        dist.broadcast(f(4), src=0)
        dist.barrier()
        dist.all_to_all([f(4) for _ in range(WORLD)], [f(4) for _ in range(WORLD)])
        dist.all_to_all_single(f(4 * WORLD), f(4 * WORLD))
        dist.reduce(f(4), dst=0)
        dist.gather(f(4), [f(4) for _ in range(WORLD)] if RANK == 0 else None, dst=0)
        dist.scatter(f(4), [f(4) for _ in range(WORLD)] if RANK == 0 else None, src=0)
        t = f(4)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        async_sum = t.tolist()
        if RANK in (0, 2):
            dist.all_reduce(f(2), group=sub)
            w = dist.broadcast(f(2), src=0, group=sub, async_op=True)
            while not w.is_completed():
                time.sleep(0.001)
        if RANK == 0:
            dist.send(f(3), dst=1)
            dist.recv(f(3), src=1)
        elif RANK == 1:
            dist.recv(f(3), src=0)
            dist.send(f(3), dst=0)
        if RANK == 1:
            dist.isend(f(5), dst=2).wait()
        elif RANK == 2:
            dist.irecv(f(5), src=1).wait()
        if RANK in (0, 2):  # P2POp built from the wrapped functions, as a pipeline would
            peer = 2 - RANK
            p2p = [dist.P2POp(dist.isend, f(6), peer), dist.P2POp(dist.irecv, f(6), peer)]
            for w in dist.batch_isend_irecv(p2p):
                w.wait()
    summaries = [s.model_dump() for s in session.outbox.steps.items]
    # a few plain training steps with a tiny model, then give the client time to retry
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(RANK))
    losses = []
    for i in range(1, 6):
        with collectives.step(i):
            loss = (model(data) ** 2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():  # plain SGD (torch.optim's import alone costs seconds here)
                for p in model.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p -= 0.1 * p.grad / WORLD
            losses.append(loss.item())
        time.sleep(0.1)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    hist = history()
    failures = session.client.connect_failures
    collectives.uninstrument()
    restored = dist.all_reduce is original
    dist.all_reduce(f(1))  # must not be recorded anywhere
    return {
        "wrapped": wrapped,
        "restored": restored,
        "history": hist,
        "history_after": len(session.recorder.history),
        "summaries": summaries,
        "async_sum": async_sum,
        "losses": losses,
        "weights": weights,
        "connect_failures": failures,
        "sub_group_ranks": [0, 2],
        "probe_group": probe_group_info,
    }


def scenario_signatures(out: Path) -> dict[str, Any]:
    """Faults from TRAINGUARD_FAULTS plus controller commands, over ~30 steps."""
    collectives.instrument()
    wait_connected()
    dist.barrier()
    grad = torch.ones(256)
    nan_steps, ckpt_steps, stopped_at = [], [], None
    for i in range(80):
        with collectives.step(i):
            time.sleep(0.03)
            g = grad.clone()
            dist.all_reduce(g)
            if math.isnan(g[0].item()):
                nan_steps.append(i)
            # ranks learn of a stop at different moments: agree on it (MAX of the flags)
            stop = torch.tensor([float(collectives.should_stop())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if collectives.should_checkpoint(i):
            ckpt_steps.append(i)
        if stop.item() > 0:
            stopped_at = i
            break
    session = collectives.current()
    assert session is not None
    session.client.flush(2.0)
    return {"nan_steps": nan_steps, "ckpt_steps": ckpt_steps, "stopped_at": stopped_at}


def scenario_loop(out: Path) -> dict[str, Any]:
    """Plain steps of one all_reduce each; faults (hang, crash) come from the env."""
    collectives.instrument()
    wait_connected()
    dist.barrier()
    for i in range(int(os.environ.get("TG_STEPS", "40"))):
        with collectives.step(i):
            time.sleep(0.02)
            dist.all_reduce(torch.ones(8))
    return {}


def scenario_train(out: Path) -> dict[str, Any]:
    """A small MLP with data-parallel SGD (one all_reduce per parameter); faults from the env.

    Its two 16x16 weights (1 KiB each) are the gradients the NaN check looks at; the biases
    are below its size floor."""
    collectives.instrument()
    wait_connected()
    dist.barrier()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    data = torch.randn(32, 16, generator=torch.Generator().manual_seed(RANK))
    nan_losses = []
    for i in range(int(os.environ.get("TG_STEPS", "12"))):
        with collectives.step(i):
            loss = (model(data) ** 2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p -= 0.1 * p.grad / WORLD
        if not math.isfinite(loss.item()):
            nan_losses.append(i)
    session = collectives.current()
    assert session is not None
    session.client.flush(2.0)
    return {"nan_losses": nan_losses}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    init()
    result = {
        "ops": scenario_ops,
        "signatures": scenario_signatures,
        "loop": scenario_loop,
        "train": scenario_train,
    }[scenario](out)
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    if scenario == "ops":
        # Nothing of ours is left to run at exit (the scenario uninstrumented itself), and
        # interpreter finalization while gloo's threads wind down has, rarely, aborted a
        # rank (SIGABRT) after its work was done and written: leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
