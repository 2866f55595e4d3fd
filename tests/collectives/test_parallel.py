"""Collectives that torch's parallelism APIs issue are all seen, with their process group.

Real FSDP2 (``fully_shard``), DTensor (redistribute, a partial sum, a direct functional
all_reduce) and pipelining (``ScheduleGPipe``: pipeline P2P through ``batch_isend_irecv``)
runs on gloo, 2 ranks, 2 steps each. For each step, what the wrapper recorded is compared
with what torch itself recorded for the same step: Flight Recorder's entries (group,
sequence number, op) for collectives, the profiler's ``c10d::`` operators for point-to-point
(gloo's Flight Recorder does not record P2P). Nothing here lists the expected calls.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench.collectives_parallel import only, seen
from collectives import flight
from tests.zygote import Zygote

from .conftest import launch_ranks

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, torch_zygote: Zygote) -> list[dict[str, Any]]:
    """One 2-rank job running the three scenarios (see parallel_worker.py)."""
    out = tmp_path_factory.mktemp("parallel")
    short = Path(tempfile.mkdtemp(prefix="tgp", dir="/tmp"))
    ranks = launch_ranks(
        torch_zygote,
        "all",
        2,
        out,
        socket_path=str(short / "absent.sock"),
        env={"TORCH_FR_BUFFER_SIZE": "2000"},
        worker=WORKER,
    )
    try:
        codes = ranks.wait(150)
        assert codes == [0, 0], "\n".join(ranks.stderr(r)[-3000:] for r in range(2))
    finally:
        ranks.kill()
        shutil.rmtree(short, ignore_errors=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("scenario", ["fsdp2", "dtensor", "compiled"])
def test_every_collective_flight_recorder_lists_is_seen(
    scenario: str, runs: list[dict[str, Any]]
) -> None:
    for res in runs:
        assert res["inflight"] == 0  # every call seen also completed
        cmp = seen(res, scenario)
        assert cmp.listed >= 4, "Flight Recorder recorded too little to compare"
        assert cmp.missing == [] and cmp.ratio == 1.0
        roles = only(res, scenario)["roles"]
        if scenario == "fsdp2":  # the FSDP mesh's dp dim gives the data-parallel rank
            assert roles[0]["group_ranks"] == [0, 1]
            assert roles[0]["dp_rank"] in (0, 1)


def test_pipeline_p2p_is_seen_and_stages_are_roles(runs: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(runs):
        cmp = seen(res, "pipeline")
        assert cmp.listed >= 4 and cmp.missing == [] and cmp.ratio == 1.0
        roles = only(res, "pipeline")["roles"]
        assert {(r["role"], r["pp_stage"]) for r in roles} == {(f"pp_stage={rank}", rank)}


def test_compare_flags_a_collective_the_wrapper_did_not_see() -> None:
    entries = [
        {
            "process_group": ["0", "default_pg"],
            "collective_seq_id": s,
            "profiling_name": n,
            "time_created_ns": 10 + s,
        }
        for s, n in ((1, "gloo:all_reduce"), (2, "gloo:all_gather"), (3, "gloo:all_reduce"))
    ]
    seen = [flight.Call(0, "0", 1, "all_reduce"), flight.Call(0, "0", 3, "all_reduce")]
    cmp = flight.compare(seen, entries, {0: (0, 100)})
    assert (cmp.listed, cmp.seen) == (3, 2)
    assert cmp.missing == [{"step": 0, "group": "0", "seq": 2, "op": "gloo:all_gather"}]
    wrong_op = [
        flight.Call(0, "0", 1, "broadcast"),
        *seen[1:],
        flight.Call(0, "0", 2, "all_gather_single"),
    ]
    assert flight.compare(wrong_op, entries, {0: (0, 100)}).seen == 2
