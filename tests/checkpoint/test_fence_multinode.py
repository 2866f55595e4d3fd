"""Fencing by default on a multi-node torchrun: each node's agent keeps its own
``TORCHELASTIC_RESTART_COUNT``, so no rank's count names the start. Rank 0 names it and one
broadcast hands it to every rank (``checkpoint._runid``). Real gloo ranks, one per simulated
node (``LOCAL_WORLD_SIZE=1``, ``WORLD_SIZE=2``), with per-node restart counts that disagree,
as torchrun sets them; run as a script, this module is one such rank."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpoint._commit import default_run_id, join_fence, write_fence

REPO = Path(__file__).resolve().parents[2]


def _node_env(rank: int, restarts: int, init: str) -> dict[str, str]:
    """What torchrun sets on a rank of a 2-node job, one rank per node (no generation)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TG_"))}
    env.update(
        PYTHONPATH=str(REPO), TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT=str(restarts),
        RANK=str(rank), LOCAL_RANK="0", GROUP_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
        GROUP_WORLD_SIZE="2", ROLE_WORLD_SIZE="2", TG_TEST_INIT=init,
    )  # fmt: skip
    return env


def _start(zygote: Any, tmp: Path, name: str, counts: tuple[int, int], phase: str) -> list[Any]:
    """One start of the job: both ranks, each with its node's restart count; their reports."""
    procs = []
    for r, restarts in enumerate(counts):
        out = tmp / f"{name}-rank{r}.out"
        env = _node_env(r, restarts, f"file://{tmp / (name + '-rendezvous')}")
        argv = ["-m", "tests.checkpoint.test_fence_multinode", phase, str(tmp / "root")]
        procs.append((zygote.spawn(argv, env=env, stdout=out, cwd=REPO), out))
    reports = []
    for proc, out in procs:
        assert proc.wait(timeout=120) == 0, out.read_text()[-3000:]
        reports.append(json.loads(out.read_text().strip().splitlines()[-1]))
    return reports


@pytest.mark.slow
def test_both_nodes_agree_on_one_run_id_and_a_zombie_of_the_previous_start_stops(
    tmp_path: Path, torch_zygote: Any
) -> None:
    """Start 1 (node restart counts 0 and 1) saves step 2. Its rank 1's writer survives,
    mid-way through step 4. Start 2 (counts 0 and 2: node 0's agent restarted for node 1's
    failure and did not count it, so rank 0's count repeats) restores step 2, saves and
    commits step 4; the zombie then finishes and must stop rather than rename its files over
    start 2's. Before, the default id was "" on a multi-node torchrun: no fence, and the
    zombie broke step 4's checksums."""
    import torch

    from checkpoint import load, verify
    from checkpoint._persist import PersistJob, persist_part
    from checkpoint.errors import CheckpointSupersededError
    from checkpoint.manifest import Entry

    old = _start(torch_zygote, tmp_path, "start1", (0, 1), "old")
    assert old[0]["run_id"] == old[1]["run_id"] != ""
    assert old[0]["again"] and old[1]["again"]  # a second Checkpointer: same id, no collective

    blob = bytes(range(256)) * 40
    entries = [Entry(name="w", dtype="uint8", shape=[len(blob)], offset=0, nbytes=len(blob))]
    zombie_job = PersistJob(
        job_id=9, root=str(tmp_path / "root"), step=4, rank=1, world_size=2,
        layout={"world": 2}, entries=entries, keep_last=5, commit_timeout_s=10.0,
        chunk_bytes=4096, run_id=old[1]["run_id"],
    )  # fmt: skip
    paused, go, outcome = threading.Event(), threading.Event(), []

    def ready(index: int) -> bool:
        paused.set()
        return go.wait(60)

    def zombie() -> None:
        try:
            persist_part(zombie_job, memoryview(blob), ready)
            outcome.append("wrote")
        except CheckpointSupersededError as exc:
            outcome.append(f"superseded: {exc}")

    thread = threading.Thread(target=zombie)
    thread.start()
    try:
        assert paused.wait(60)
        new = _start(torch_zygote, tmp_path, "start2", (0, 2), "new")
    finally:
        go.set()
        thread.join(60)
    assert new[0]["run_id"] == new[1]["run_id"] != ""
    assert new[0]["run_id"] != old[0]["run_id"]
    assert new[0]["restored"] == new[1]["restored"] == 2
    assert outcome and outcome[0].startswith("superseded"), outcome
    assert verify(tmp_path / "root", step=4) == 4
    restored = load(tmp_path / "root", {"w": None}, rank=1, step=4)
    assert torch.equal(restored.values["w"], torch.full((64,), 41.0))


@pytest.mark.parametrize(
    ("env", "multi"),
    [
        ({"TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "2"}, True),
        ({"TORCHELASTIC_RESTART_COUNT": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}, True),
        (
            {"TORCHELASTIC_RESTART_COUNT": "0", "LOCAL_WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "8"},
            True,
        ),
        ({"TORCHELASTIC_RESTART_COUNT": "3", "LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "8"}, False),
        ({"TORCHELASTIC_RESTART_COUNT": "1", "GROUP_WORLD_SIZE": "1"}, False),
        ({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}, False),  # not torchrun
    ],
    ids=["group", "local-vs-world", "local-vs-role", "one-node", "one-agent", "no-torchrun"],
)
def test_a_multi_node_torchrun_is_told_by_any_of_its_variables(
    env: dict[str, str], multi: bool
) -> None:
    """Without ``GROUP_WORLD_SIZE``, fewer local ranks than ranks still means several nodes:
    before, such a rank used its own node's restart count and ranks could fence each other."""
    from checkpoint._commit import multinode_torchrun

    assert multinode_torchrun(env) is multi
    assert ("torchelastic-restart" in default_run_id(env)) is (
        not multi and "TORCHELASTIC_RESTART_COUNT" in env
    )


def test_without_a_process_group_a_multi_node_run_is_unfenced_as_before_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No collective is possible (no process group): never a hang, the environment's id
    (the generation here), one warning."""
    from checkpoint._runid import launcher_run_id

    env = {"TORCHELASTIC_RESTART_COUNT": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    with caplog.at_level(logging.WARNING, logger="checkpoint._runid"):
        assert launcher_run_id(tmp_path, env) == ""
        assert launcher_run_id(tmp_path, {**env, "TRAINGUARD_GENERATION": "4"}) == (
            "trainguard-gen4"
        )
    assert len(caplog.records) == 2 and "no process group" in caplog.records[0].getMessage()


def test_start_stamps_are_ordered_so_a_zombie_rank_0_never_takes_the_root_back(
    tmp_path: Path,
) -> None:
    from checkpoint.errors import CheckpointSupersededError

    write_fence(tmp_path, "torchelastic-start200-job7")
    with pytest.raises(CheckpointSupersededError):
        join_fence(tmp_path, "torchelastic-start100-job7", claim=True, timeout_s=1.0, what="s")
    join_fence(tmp_path, "torchelastic-start300-job7", claim=True, timeout_s=1.0, what="s")
    join_fence(tmp_path, "torchelastic-restart0-job7", claim=True, timeout_s=1.0, what="s")


# --------------------------------------------------------------------------- one rank


def _rank(phase: str, root: str) -> None:
    import torch
    import torch.distributed as dist

    from checkpoint import CheckpointConfig, Checkpointer

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=os.environ["TG_TEST_INIT"], rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    cfg = CheckpointConfig(root=Path(root), writer="thread", keep_last=5, commit_timeout_s=20.0)
    engine = Checkpointer(cfg, rank=rank, world_size=2)
    again = Checkpointer(cfg, rank=rank, world_size=2)
    same = again.run_id == engine.run_id
    again.close()
    restored = None
    if phase == "old":
        engine.save({"w": torch.full((64,), 10.0 + rank)}, 2)
    else:
        restored = engine.load({"w": None}).step
        engine.save({"w": torch.full((64,), 40.0 + rank)}, 4)
    engine.wait()
    dist.barrier()
    engine.close()
    print(json.dumps({"rank": rank, "run_id": engine.run_id, "again": same, "restored": restored}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(*sys.argv[1:3])
