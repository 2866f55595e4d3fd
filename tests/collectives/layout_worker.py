"""One rank of a job-layout sweep (launched by test_layout_sweep.py through conftest.launch_ranks).

Usage: ``python layout_worker.py <scenario> <out_dir>``; writes ``rank<N>.json`` with the
rank's call history, its groups and its step summaries. Real torch.distributed (gloo on
loopback, file store), real instrumentation; every process group is created *after*
``instrument()``, as a job that builds its meshes once the wrapper is on would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

import collectives

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])


def f(n: int) -> torch.Tensor:
    return torch.full((n,), float(RANK + 1))


def _session() -> Any:
    session = collectives.current()
    assert session is not None
    return session


def history() -> list[dict[str, Any]]:
    return [
        {
            "op": r.op,
            "group": r.group,
            "seq": r.seq,
            "size_bytes": r.size_bytes,
            "step": r.step,
            "ok": r.ok,
            "async_op": r.async_op,
            "done": r.exit_s is not None,
        }
        for r in _session().recorder.history
    ]


def gid(group: Any) -> str:
    """The id the wrapper gives ``group`` (what its records carry)."""
    return str(_session().instrumenter.groups.resolve(group).id)


def scenario_sweep(out: Path) -> dict[str, Any]:
    """Groups of every shape, created after instrument(), called through every API."""
    session = collectives.instrument()
    groups: dict[str, dict[str, Any]] = {}

    def note(label: str, group: Any) -> None:
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return
        groups[label] = {"id": gid(group), "ranks": dist.get_process_group_ranks(group)}

    # non-contiguous pairs, created by every rank in the same order
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
    pair = g02 if RANK % 2 == 0 else g13
    note("pair", pair)
    # dist.new_subgroups: [0, 1] and [2, 3]
    sub, _ = dist.new_subgroups(group_size=2)
    note("sub", sub)
    # a 2-D mesh, dp x tp: tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    note("tp", tp)
    note("dp", dp)
    # nested groups, and one group rank 0 is not in
    g012, g123 = dist.new_group([0, 1, 2]), dist.new_group([1, 2, 3])
    note("g012", g012)
    note("g123", g123)
    note("world", dist.group.WORLD)

    with collectives.step(0):  # non-contiguous pair groups, then the world
        dist.all_reduce(f(2), group=pair)
        dist.all_reduce(f(4))
    with collectives.step(1):  # new_subgroups
        dist.all_reduce(f(2), group=sub)
        dist.all_gather_into_tensor(f(4), f(2), group=sub)
        dist.reduce_scatter_tensor(f(2), f(4), group=sub)
    results: dict[str, Any] = {}
    with collectives.step(2):  # the mesh's groups through eager and functional APIs
        dist.all_reduce(f(2), group=tp)
        r1 = funcol.all_reduce(f(2), "sum", dp)  # the ProcessGroup itself
        r2 = funcol.all_reduce(f(2), "sum", (mesh, 1))  # (mesh, dim): the tp group
        r3 = funcol.all_gather_tensor(f(2), 0, tp.group_name)  # the group's name
        r4 = funcol.reduce_scatter_tensor(f(4), "sum", 0, (mesh, 0))  # dp
        results["funcol"] = [r.tolist() for r in (r1, r2, r3, r4)]
        dist.all_reduce(f(2), group=tp)
    with collectives.step(3):  # async calls on several groups, waited out of order later
        t_world, t_pair = f(3), f(3)
        w_world = dist.all_reduce(t_world, async_op=True)
        w_pair = dist.all_reduce(t_pair, group=pair, async_op=True)
        gathered = torch.empty(4)
        w_tp = dist.all_gather_into_tensor(gathered, f(2), group=tp, async_op=True)
        dist.all_reduce(f(1), group=dp)
        w_tp.wait()
        w_pair.wait()
        w_world.wait()
        results["async"] = [t_world.tolist(), t_pair.tolist(), gathered.tolist()]
    with collectives.step(4):  # pipeline-style P2P: a ring on the world, a pair on tp
        nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        got = torch.empty(2)
        ops = [dist.P2POp(dist.isend, f(2), nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        peer_local = 1 - dist.get_rank(tp)  # the other tp rank, named by its rank in tp
        got_tp = torch.empty(3)
        ops = [
            dist.P2POp(dist.isend, f(3), group=tp, group_peer=peer_local),
            dist.P2POp(dist.irecv, got_tp, group=tp, group_peer=peer_local),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        results["p2p"] = [got.tolist(), got_tp.tolist()]
    with collectives.step(5):  # nested groups; a group this rank is not in is a no-op
        if RANK in (0, 1, 2):
            dist.all_reduce(f(2), group=g012)
        if RANK in (0, 1):
            dist.all_reduce(f(2), group=sub)
        dist.all_reduce(f(2), group=g123)  # rank 0: torch warns and does nothing
    # a subgroup destroyed, then one over the same ranks made again: the world goes on
    if RANK in (0, 1, 2):
        dist.destroy_process_group(g012)
    g012b = dist.new_group([0, 1, 2])
    note("g012b", g012b)
    with collectives.step(6):
        if RANK in (0, 1, 2):
            dist.all_reduce(f(2), group=g012b)
        dist.all_reduce(f(4))
    # the step hook twice per iteration: the same number twice, then nested blocks
    with collectives.step(7):
        dist.all_reduce(f(4))
    with collectives.step(7):
        dist.all_reduce(f(4))
    with collectives.step(9), collectives.step(10):
        dist.all_reduce(f(4))
        dist.all_reduce(f(4))
    dist.all_reduce(f(4))  # outside any step: recorded, in no summary
    # two optimizers, both hooked (a dense and a sparse one): the second's steps are
    # refused as nested, the first's mark the steps; its first call's grads precede any step
    model = torch.nn.Linear(2, 1)
    opt_w = torch.optim.SGD([model.weight], lr=0.1)
    opt_b = torch.optim.SGD([model.bias], lr=0.1)
    unhook = [collectives.hook_optimizer(opt_w, 20), collectives.hook_optimizer(opt_b, 20)]
    for _ in range(3):
        model.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        opt_w.step()
        opt_b.step()
    for remove in unhook:
        remove()
    del mesh
    session.client.flush(2.0)
    summaries = [s.model_dump() for s in session.outbox.steps.items]
    return {
        "groups": groups,
        "group_ranks": dict(session.recorder.group_ranks),
        "history": history(),
        "summaries": summaries,
        "results": results,
        "inflight": len(session.recorder._inflight),
    }


def scenario_absent(out: Path) -> dict[str, Any]:
    """Rank 0 enters an all_reduce on the non-contiguous group [0, 2] that rank 2 enters
    only after ~2.5 s: rank 0 must report it in flight, naming the group's ranks."""
    session = collectives.instrument()
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
    pair = g02 if RANK % 2 == 0 else g13
    deadline = time.monotonic() + 15
    while not session.client.connected and time.monotonic() < deadline:
        time.sleep(0.02)
    dist.barrier()
    with collectives.step(0):
        dist.all_reduce(f(2), group=pair)
    with collectives.step(1):
        if RANK == 2:
            time.sleep(2.5)
        dist.all_reduce(f(2), group=pair)
    dist.barrier()
    session.client.flush(2.0)
    return {"pair": gid(pair), "history": history()}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=RANK, world_size=WORLD
    )
    result = {"sweep": scenario_sweep, "absent": scenario_absent}[scenario](out)
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    dist.barrier()
    collectives.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
