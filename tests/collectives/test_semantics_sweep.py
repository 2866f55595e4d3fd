"""Transparency sweep: an instrumented job sees exactly plain torch.distributed's semantics.

One real 2-rank gloo job (``semantics_worker.py``) runs every case twice in the same
processes, plain and then under ``collectives.instrument()``, and reduces each run to a
fingerprint: return values (``None`` vs a ``Work``; ``isinstance(w, dist.Work)``), what an
async handle's ``wait()``, ``is_completed()``, ``is_success()`` and ``get_future()`` give,
tensors written in place, tensor lists, exceptions (type and message) and warnings, and
whether a tensor outlives the job's references. The tests below compare the two runs case by
case, and check what only the instrumented side has: every patched function restored by
``uninstrument()``, nothing left in flight, and a dead peer failing rank 0's next collective
with the same error type with and without the wrapper.

Cases: all_reduce (sync, positional ``(t, MAX, None, True)``, keyword async, the future
before any wait and chained, ``group=None`` vs WORLD, dtypes, sparse COO, empty),
broadcast (``src``, ``group_src``, async), all_gather (list, into_tensor, async),
reduce_scatter(_tensor), all_to_all_single with uneven splits, all_to_all, reduce / gather /
scatter, the object collectives, send / recv / isend / irecv (tags, any source,
``group_src``), batch_isend_irecv, barrier (async, timeout) and monitored_barrier,
new_subgroups / DeviceMesh / new_group groups, a group the rank is not in, bad arguments,
the job's own exceptions, a group timeout, functional collectives, DDP (its C++ reducer and
the standard comm hook) and FSDP2 with ``unshard(async_op=True)``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.collectives.conftest import launch_ranks
from tests.zygote import Zygote

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("semantics_worker.py")
WORLD = 2


@pytest.fixture(scope="module")
def sweep(torch_zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("semantics")
    sock_dir = Path(tempfile.mkdtemp(prefix="tgs", dir="/tmp"))
    try:
        ranks = launch_ranks(
            torch_zygote,
            "sweep",
            WORLD,
            out,
            socket_path=str(sock_dir / "absent.sock"),
            worker=WORKER,
        )
        return ranks.results(180)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _case(results: list[dict[str, Any]], name: str) -> list[tuple[Any, Any]]:
    return [(res["plain"][name], res["instr"][name]) for res in results]


def _same(results: list[dict[str, Any]], name: str) -> None:
    for rank, (plain, instr) in enumerate(_case(results, name)):
        assert "case_raised" not in json.dumps(plain["value"]), (rank, plain)
        assert instr["value"] == plain["value"], f"rank {rank}, case {name}"
        assert instr["warnings"] == plain["warnings"], f"rank {rank}, case {name}"
        assert plain["records"] == 0


@pytest.mark.parametrize(
    "name",
    [
        "all_reduce_sync",
        "all_reduce_group_none_vs_world",
        "all_reduce_dtypes",
        "all_reduce_empty",
        "broadcast_group_src",
        "reduce_scatter_list",
        "all_to_all_list",
        "object_collectives",
        "subgroups",
        "functional",
        "ddp",
    ],
)
def test_synchronous_calls_return_and_write_what_torch_does(
    sweep: list[dict[str, Any]], name: str
) -> None:
    _same(sweep, name)
    if name not in ("ddp",):  # DDP's own reducer calls the process group from C++
        assert all(res["instr"][name]["records"] > 0 for res in sweep), name


@pytest.mark.parametrize(
    "name",
    [
        "all_reduce_positional",
        "all_reduce_async_kw",
        "all_reduce_future_first",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single_uneven",
        "reduce_gather_scatter",
        "p2p",
        "batch_isend_irecv",
        "barrier",
    ],
)
def test_async_handles_are_works_that_wait_complete_and_give_torchs_future(
    sweep: list[dict[str, Any]], name: str
) -> None:
    """Among others: ``isinstance(handle, dist.Work)`` holds as in plain torch (it was a
    plain proxy, so torch code testing for a Work took the async call for a sync one)."""
    _same(sweep, name)
    assert all(res["instr"][name]["records"] > 0 for res in sweep), name


def test_uneven_all_to_all_single_moves_the_right_slices(sweep: list[dict[str, Any]]) -> None:
    value = sweep[0]["instr"]["all_to_all_single_uneven"]["value"]
    # rank 0 sends [10] to itself and [20, 21, 22] ... see the worker's splits
    assert value["out"]["tensor"] == [10.0, 20.0, 21.0, 22.0]
    value1 = sweep[1]["instr"]["all_to_all_single_uneven"]["value"]
    assert value1["out"]["tensor"] == [11.0, 12.0, 23.0]


def test_sparse_all_reduce_works_as_in_torch(sweep: list[dict[str, Any]]) -> None:
    """gloo all-reduces sparse COO tensors; the wrapper read ``nbytes``, which sparse
    tensors do not have, and raised RuntimeError into the job."""
    _same(sweep, "all_reduce_sparse")
    value = sweep[0]["instr"]["all_reduce_sparse"]["value"]
    assert value["t"]["tensor"] == [1.0, 2.0, 2.0, 2.0] and value["big"] == 600.0
    assert [res["instr"]["all_reduce_sparse"]["records"] for res in sweep] == [2, 2]  # seen


def test_a_group_this_rank_is_not_in_is_torchs_no_op(sweep: list[dict[str, Any]]) -> None:
    _same(sweep, "not_a_member")
    outsider = sweep[1]["instr"]["not_a_member"]
    assert outsider["records"] == 0
    assert outsider["value"][:5] == [None] * 5
    assert any("does not belong to the given group" in w for w in outsider["warnings"])


def test_errors_torch_raises_keep_their_type_and_message(sweep: list[dict[str, Any]]) -> None:
    """A group that is no group made the wrapper raise KeyError before torch's ValueError; a
    peer that is no rank, ValueError before torch's TypeError."""
    _same(sweep, "bad_arguments")
    raised = [e.get("raised") for e in sweep[0]["instr"]["bad_arguments"]["value"]]
    assert raised[:3] == ["ValueError", "ValueError", "TypeError"], raised
    assert None not in raised


def test_the_jobs_own_exceptions_pass_unchanged(sweep: list[dict[str, Any]]) -> None:
    _same(sweep, "user_exception")
    assert sweep[0]["instr"]["user_exception"]["value"][0] == ["Mine", "in a step"]


def test_a_group_timeout_fails_the_wait_alike(sweep: list[dict[str, Any]]) -> None:
    _same(sweep, "timeout")
    value = sweep[0]["instr"]["timeout"]["value"]
    assert value[0] == {"is_work": True} and "raised" in value[1], value


def test_no_tensor_outlives_the_jobs_references_longer_than_in_torch(
    sweep: list[dict[str, Any]],
) -> None:
    _same(sweep, "memory")
    assert not any(sweep[0]["instr"]["memory"]["value"].values())


def test_fsdp2_async_unshard_waits_its_all_gather(sweep: list[dict[str, Any]]) -> None:
    """FSDP2 waits an async all-gather only if ``isinstance(work, Work)``: with the proxy it
    never waited (it read the gathered parameters without waiting)."""
    for plain, instr in _case(sweep, "fsdp2_async_unshard"):
        assert plain["value"]["values"] == instr["value"]["values"]
        assert plain["warnings"] == instr["warnings"]
        assert instr["value"]["timed_waits"] >= 2  # one per unshard(async_op=True)


def test_uninstrument_restores_everything_it_patched(sweep: list[dict[str, Any]]) -> None:
    for res in sweep:
        assert res["not_restored"] == []
        patched = set(res["patched"])
        assert "torch.distributed.distributed_c10d.all_reduce" in patched
        assert "kernel:all_reduce" in patched
        assert res["inflight_after"] == []


def test_a_dead_peer_fails_the_next_collective_alike(sweep: list[dict[str, Any]]) -> None:
    death = sweep[0]["death"]
    assert death["plain_sync"] == death["instr_sync"] and "raised" in death["plain_sync"]
    assert death["plain_async"] == death["instr_async"] and "raised" in death["plain_async"]
    assert [ok for _op, ok in sweep[0]["death_records_failed"]] == [False, False]
