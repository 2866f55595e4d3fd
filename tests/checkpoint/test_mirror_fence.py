"""The ``mirror_root`` tier honours the fence: a zombie writer of the previous start that
copies a step to the mirror after the new start took over stops, instead of replacing the
new start's mirrored files, committing its own (abandoned) step there as the newest, or
deleting the new start's mirrored steps by its retention. The new start's own ranks are
never fenced out of the mirror. Pure storage logic: no torch, no subprocess."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from checkpoint import CheckpointStore, verify
from checkpoint._commit import read_fence, write_fence
from checkpoint._persist import PersistJob, PersistResult, persist_part
from checkpoint.errors import CheckpointSupersededError
from checkpoint.manifest import Entry, rank_data_name, rank_manifest_name, step_dir_name

OLD, NEW = "trainguard-gen3", "trainguard-gen4"
SIZE = 8192
Hook = Callable[[PersistResult], None]


def _blob(value: int) -> bytes:
    return bytes([value]) * SIZE


def _job(
    root: Path, mirror: Path, step: int, run_id: str, *, rank: int = 0, world: int = 1, first: bool
) -> PersistJob:
    root.mkdir(exist_ok=True)  # as the Checkpointer makes its root; the mirror is left to it
    entries = [Entry(name="w", dtype="uint8", shape=[SIZE], offset=0, nbytes=SIZE)]
    return PersistJob(
        job_id=step, root=str(root), step=step, rank=rank, world_size=world,
        layout={"world": world}, entries=entries, keep_last=2, commit_timeout_s=10.0,
        chunk_bytes=4096, mirror_root=str(mirror), run_id=run_id, first=first,
    )  # fmt: skip


def _save(job: PersistJob, value: int, on_committed: Hook | None = None) -> PersistResult:
    return persist_part(job, memoryview(_blob(value)), lambda i: True, on_committed=on_committed)


def _stopped(job: PersistJob, on_committed: Hook | None = None) -> str:
    """Run the zombie's save; the message it was fenced out with ("" if it was not). The
    caller checks the mirror first, so that on failure it shows what the zombie did."""
    try:
        _save(job, 66, on_committed)
    except CheckpointSupersededError as exc:
        return str(exc)
    return ""


def _mirrored_by_new_run(mirror: Path) -> None:
    """The mirror holds the new start's steps 3 and 4, whole, and nothing of the zombie's."""
    store = CheckpointStore(mirror)
    assert [i.step for i in store.list() if i.complete] == [3, 4]
    assert store.latest_pointer() == 4
    assert verify(mirror, step=4) == 4
    step4 = mirror / step_dir_name(4)
    assert (step4 / rank_data_name(0)).read_bytes() == _blob(40)
    assert f'"run_id":"{NEW}"' in (step4 / rank_manifest_name(0)).read_text()
    assert not (mirror / step_dir_name(6)).exists()


@pytest.mark.parametrize("zombie_step", [4, 6], ids=["same-step", "newer-step"])
def test_a_zombie_on_the_old_nodes_disk_cannot_take_over_the_mirror(
    tmp_path: Path, zombie_step: int
) -> None:
    """Generation 3 ran on node A (its local root on A's disk) and mirrored step 2. The job
    restarts on node B as generation 4: it rolls back to step 2 and saves (and mirrors)
    steps 3 and 4. Node A was partitioned, not dead: its writer then finishes step 4 (or
    its NaN step 6) and copies it to the shared mirror. Nothing of the new start is on A's
    disk to fence it there, so only the mirror can: before, the zombie's copy replaced
    generation 4's step 4 in the mirror (same step), or committed its step 6 as the
    mirror's newest and its retention (keep_last=2) deleted generation 4's step 3."""
    node_a, node_b, mirror = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "mirror"
    _save(_job(node_a, mirror, 2, OLD, first=True), 20)
    _save(_job(node_b, mirror, 3, NEW, first=True), 30)
    _save(_job(node_b, mirror, 4, NEW, first=False), 40)
    stopped = _stopped(_job(node_a, mirror, zombie_step, OLD, first=False))
    _mirrored_by_new_run(mirror)
    assert f"committed locally, not copied to {mirror}" in stopped
    assert not list((mirror / step_dir_name(4)).glob(".*tmp*"))  # its temp copy removed


def test_a_zombie_on_the_shared_root_stops_between_its_local_commit_and_its_mirror_copy(
    tmp_path: Path,
) -> None:
    """One shared root: generation 3's writer commits step 6 locally, then (while its
    trainer is gone and before its mirror copy) generation 4 claims the root, restores
    step 2 by number and saves steps 3 and 4. The zombie's late mirror copy of step 6 must
    not become the mirror's newest step nor delete step 3 there by retention."""
    root, mirror = tmp_path / "root", tmp_path / "mirror"
    _save(_job(root, mirror, 2, OLD, first=True), 20)

    def takeover(result: PersistResult) -> None:
        _save(_job(root, mirror, 3, NEW, first=True), 30)
        _save(_job(root, mirror, 4, NEW, first=False), 40)

    stopped = _stopped(_job(root, mirror, 6, OLD, first=False), on_committed=takeover)
    _mirrored_by_new_run(mirror)
    assert "committed locally" in stopped


def test_the_new_runs_ranks_are_not_fenced_out_of_the_mirror(tmp_path: Path) -> None:
    """Control: the mirror's fence still names the previous start when rank 1 of the new
    one reaches its first mirror copy; it waits for rank 0's claim, and both tiers commit.
    A writer that names no run is not fenced at all, as before."""
    root, mirror = tmp_path / "root", tmp_path / "mirror"
    for path in (root, mirror):
        path.mkdir()
        write_fence(path, OLD)
    errors: list[BaseException] = []

    def rank1() -> None:
        try:
            _save(_job(root, mirror, 5, NEW, rank=1, world=2, first=True), 51)
        except BaseException as exc:
            errors.append(exc)

    peer = threading.Thread(target=rank1)
    peer.start()
    _save(_job(root, mirror, 5, NEW, rank=0, world=2, first=True), 50)
    peer.join(30)
    assert not peer.is_alive() and errors == []
    assert verify(root, step=5) == verify(mirror, step=5) == 5
    assert read_fence(mirror) == NEW
    _save(_job(root, mirror, 7, "", first=True), 70)
    assert verify(mirror, step=7) == 7 and read_fence(mirror) == NEW


def test_a_restore_claims_the_mirror_with_the_root(tmp_path: Path) -> None:
    """Rank 0's restore (``Checkpointer.load``) claims both tiers (best effort, as for the
    root), so a zombie's mirror copy stops from then on, not only from the new start's
    first save."""
    import torch

    from checkpoint import CheckpointConfig, Checkpointer

    root, mirror = tmp_path / "root", tmp_path / "mirror"
    cfg = CheckpointConfig(root=root, mirror_root=mirror, writer="thread")
    with Checkpointer(cfg, run_id=OLD) as old:
        old.save({"w": torch.ones(4)}, 2)
    assert read_fence(mirror) == OLD
    with Checkpointer(cfg, run_id=NEW) as rank0:
        assert rank0.load({"w": None}).step == 2
    assert read_fence(root) == read_fence(mirror) == NEW
    with pytest.raises(CheckpointSupersededError):
        _save(_job(tmp_path / "node-a", mirror, 4, OLD, first=False), 66)
    assert [i.step for i in CheckpointStore(mirror).list()] == [2]
