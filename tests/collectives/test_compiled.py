"""Functional collectives in a ``torch.compile``'d graph, on a one-rank gloo group.

The kernels sit in the dispatcher (``BackendSelect``), so a compiled graph's collectives are
recorded like eager ones, and dynamo's guards on ``torch.ops._c10d_functional`` hold (the
earlier stand-in objects made every such compiled call fail its guards). The 2-rank proof
against Flight Recorder is ``test_parallel.py``'s ``compiled`` scenario.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import collectives

pytestmark = pytest.mark.usefixtures("single_rank")


def _kernel_registered() -> bool:
    dump = torch._C._dispatch_dump("_c10d_functional::all_reduce")
    return "BackendSelect" in dump


def test_compiled_graph_collectives_are_recorded_and_kernels_removed() -> None:
    session = collectives.instrument("unit", agent_socket="/nonexistent/trainguard.sock")
    assert _kernel_registered()
    group = dist.group.WORLD

    def body(x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x, "sum", group)
        return funcol.all_gather_tensor(y + 1, 0, group) * 2

    fn = torch.compile(body, backend="aot_eager", fullgraph=True)
    x = torch.ones(4)
    fn(x)  # compiles; the trace's fake calls are not recorded, the run's are
    before = len(session.recorder.history)
    with collectives.step(0):
        out = fn(x)
    assert torch.equal(out, torch.full((4,), 4.0))
    deadline = time.monotonic() + 5
    while session.recorder._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    ops = [(r.op, r.step) for r in list(session.recorder.history)[before:]]
    assert ops == [("all_reduce", 0), ("all_gather_into_tensor", 0)]
    collectives.uninstrument()
    assert not _kernel_registered()
    assert torch.equal(fn(x), torch.full((4,), 4.0))  # torch's own kernels serve it again
