"""instrument() on a torch release without the newest collectives.

The declared range is torch>=2.6; ``all_gather_single`` and ``reduce_scatter_single`` are
newer than 2.11 (the CUDA build on the GPU machines this project is checked on), and
``instrument()`` raised AttributeError there before wrapping anything: every rank of such
a job failed at start-up. Here the two ops are taken off this torch for the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import collectives

NEWER = ("all_gather_single", "reduce_scatter_single")

pytestmark = pytest.mark.usefixtures("single_rank")


def test_ops_this_torch_lacks_are_skipped_and_the_rest_wrapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in NEWER:
        for module in (c10d, dist):
            monkeypatch.delattr(module, name, raising=False)
    original = dist.all_reduce
    session = collectives.instrument("unit", agent_socket="/nonexistent/trainguard.sock")
    try:
        assert dist.all_reduce is not original
        dist.all_reduce(torch.ones(2))
        assert [r.op for r in session.recorder.history] == ["all_reduce"]
        assert not any(hasattr(module, n) for module in (c10d, dist) for n in NEWER)
    finally:
        collectives.uninstrument()
    assert dist.all_reduce is original
    assert not any(hasattr(module, n) for module in (c10d, dist) for n in NEWER)
