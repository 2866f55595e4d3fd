"""Fencing by default: with no ``run_id`` given, the launcher's environment names the run
(``TRAINGUARD_GENERATION``, single-agent torchrun's restart count), rank 0 claims the root at
its restore or first save, and a zombie rank of the previous start cannot replace parts of
the new start's checkpoint; the new start's own ranks are never fenced out."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from checkpoint import CheckpointConfig, verify
from checkpoint._commit import join_fence, read_fence, write_fence
from checkpoint._persist import PersistJob, persist_part
from checkpoint.errors import CheckpointSupersededError
from checkpoint.manifest import Entry, rank_manifest_name, step_dir_name
from tests.waiting import wait_for

_ENV = ("TRAINGUARD_GENERATION", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
SUPERSEDED, WROTE = 7, 8


def _generation(monkeypatch: pytest.MonkeyPatch, generation: int | None) -> None:
    for name in (*_ENV, "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if generation is not None:
        monkeypatch.setenv("TRAINGUARD_GENERATION", str(generation))


def _pair(root: Path) -> list[Any]:
    """Ranks 0 and 1 of one start, as a training script makes them: no ``run_id``."""
    from checkpoint import Checkpointer

    cfg = CheckpointConfig(root=root, writer="thread", keep_last=5, commit_timeout_s=20.0)
    return [Checkpointer(cfg, rank=r, world_size=2) for r in (0, 1)]


def _save(ranks: list[Any], step: int, value: float, order: tuple[int, ...] = (0, 1)) -> None:
    import torch

    for r in order:
        ranks[r].save({"w": torch.full((64,), value + r)}, step)
    for ck in ranks:
        ck.wait()


def _zombie(root: str, run_id: str, paused: Any, go: Any) -> None:
    """Rank 1 of the previous start, still writing its (slow) part of step 4: it pauses at
    its last tensor while the new start takes over, then tries to finish."""
    blob = bytes(range(256)) * 40
    entries = [Entry(name="w", dtype="uint8", shape=[len(blob)], offset=0, nbytes=len(blob))]
    job = PersistJob(
        job_id=9, root=root, step=4, rank=1, world_size=2, layout={"world": 2},
        entries=entries, keep_last=5, commit_timeout_s=10.0, chunk_bytes=4096, run_id=run_id,
    )  # fmt: skip

    def ready(index: int) -> bool:
        paused.set()
        return bool(go.wait(60))

    try:
        persist_part(job, memoryview(blob), ready)
    except CheckpointSupersededError:
        raise SystemExit(SUPERSEDED) from None
    raise SystemExit(WROTE)


def test_a_zombie_of_the_previous_generation_cannot_replace_the_new_ones_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 3 saved step 2; its rank 1 survives the restart mid-way through step 4.
    Generation 4 (only ``TRAINGUARD_GENERATION`` differs) restores step 2, saves step 4 and
    commits it; the zombie then finishes and must stop instead of renaming its files over
    generation 4's (which would break step 4's checksums)."""
    import torch

    from checkpoint import load

    _generation(monkeypatch, 3)
    old = _pair(tmp_path)
    _save(old, 2, 1.0)
    zombie_id = old[1].run_id
    for ck in old:
        ck.close()
    ctx = multiprocessing.get_context("spawn")
    paused, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_zombie, args=(str(tmp_path), zombie_id, paused, go))
    proc.start()
    try:
        assert paused.wait(60)
        _generation(monkeypatch, 4)
        new = _pair(tmp_path)
        restored = new[0].load({"w": None})  # the previous start's checkpoint restores
        assert restored.step == 2
        assert torch.equal(restored.values["w"], torch.full((64,), 1.0))
        _save(new, 4, 5.0, order=(1, 0))
        for ck in new:
            ck.close()
    finally:
        go.set()
        proc.join(60)
    assert proc.exitcode == SUPERSEDED
    assert verify(tmp_path, step=4) == 4
    part = (tmp_path / step_dir_name(4) / rank_manifest_name(1)).read_text()
    assert f'"run_id":"{new[1].run_id}"' in part and new[1].run_id != zombie_id
    restored = load(tmp_path, {"w": None}, rank=1, step=4)
    assert torch.equal(restored.values["w"], torch.full((64,), 6.0))


def test_a_rank_that_saves_before_rank_0_claims_waits_instead_of_being_fenced_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence still names generation 4 when generation 5's rank 1 saves first (no
    restore, no collective): its writer waits for rank 0's claim, and the step commits."""
    import checkpoint._commit as commit_mod

    _generation(monkeypatch, 5)
    write_fence(tmp_path, "trainguard-gen4")
    seen: list[str] = []
    real = commit_mod.read_fence

    def recording(root: Path) -> str:
        seen.append(real(root))
        return seen[-1]

    monkeypatch.setattr(commit_mod, "read_fence", recording)
    ranks = _pair(tmp_path)
    import torch

    ranks[1].save({"w": torch.ones(64)}, 6)
    wait_for(lambda: "trainguard-gen4" in seen)  # rank 1's writer found the old fence
    ranks[0].save({"w": torch.ones(64)}, 6)
    for ck in ranks:
        ck.wait()  # raises if either rank was fenced out
        ck.close()
    assert verify(tmp_path, step=6) == 6
    assert read_fence(tmp_path) == ranks[1].run_id == "trainguard-gen5"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ""),
        ({"TRAINGUARD_GENERATION": "2"}, "trainguard-gen2"),
        (
            {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"},
            "torchelastic-restart1-job7",
        ),
        (  # multi-node torchrun: the agents' restart counts may disagree, so not used
            {
                "TORCHELASTIC_RUN_ID": "j",
                "TORCHELASTIC_RESTART_COUNT": "1",
                "GROUP_WORLD_SIZE": "4",
            },
            "",
        ),
        (
            {
                "TRAINGUARD_GENERATION": "3",
                "TORCHELASTIC_RUN_ID": "r",
                "TORCHELASTIC_RESTART_COUNT": "0",
            },
            "trainguard-gen3/torchelastic-restart0-r",
        ),
    ],
    ids=["none", "trainguard", "torchrun-one-agent", "torchrun-multi-node", "both"],
)
def test_the_default_run_id_comes_from_the_launcher_and_none_means_no_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    """Every rank of a start computes the same id from its environment; with none of the
    launchers' variables there is no id, no ``FENCE`` is written and a foreign fence stops
    nothing (the behaviour before defaults)."""
    _generation(monkeypatch, None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if not expected:
        write_fence(tmp_path, "someone-else")
    ranks = _pair(tmp_path)
    assert [ck.run_id for ck in ranks] == [expected, expected]
    _save(ranks, 1, 0.0, order=(1, 0))
    for ck in ranks:
        ck.close()
    assert verify(tmp_path, step=1) == 1
    assert read_fence(tmp_path) == (expected or "someone-else")


def test_a_zombie_rank_0_saving_for_the_first_time_does_not_take_the_root_back(
    tmp_path: Path,
) -> None:
    """Generation 6's rank 0 reaches its first save only after generation 7 claimed the
    root: it must not claim it back (it would fence out the live generation); it stops."""
    write_fence(tmp_path, "trainguard-gen7")
    with pytest.raises(CheckpointSupersededError, match="trainguard-gen7"):
        join_fence(tmp_path, "trainguard-gen6", claim=True, timeout_s=5.0, what="step 9")
    assert read_fence(tmp_path) == "trainguard-gen7"
    join_fence(tmp_path, "trainguard-gen8", claim=True, timeout_s=5.0, what="step 9")
    assert read_fence(tmp_path) == "trainguard-gen8"
