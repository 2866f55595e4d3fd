"""A root holding things the writer never makes: retention stays inside it, stray names are
not steps, and the loaders pass over a step that does not open for any reason.

Found by the checkpoint acceptance probe: retention unlinked another job's ``MANIFEST.json``
through a ``step-*`` symbolic link; a directory ``step-²`` made ``load()``, ``verify()`` and
the CLI crash on ``int('²')``; a hand copy named ``step-3`` made ``load()`` and
``reshard()`` give up on every checkpoint while ``verify()`` said load resumes from step 2.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointNotFoundError,
    CheckpointStore,
    load,
    reshard,
    verify,
)
from checkpoint._commit import apply_part_retention, parse_step_name, step_dirs
from checkpoint.cli import app
from checkpoint.manifest import MANIFEST_NAME, rank_data_name, rank_manifest_name, step_dir_name

runner = CliRunner()
#: ``step-000000000001`` written in Arabic-Indic digits (``str.isdigit`` takes them).
ARABIC_INDIC_ONE_CANONICAL = "step-" + "\u0660" * 11 + "\u0661"


def _model(step: int) -> torch.nn.Linear:
    torch.manual_seed(step)
    return torch.nn.Linear(4, 3)


def _save(root: Path, steps: tuple[int, ...], *, keep_last: int = 10) -> None:
    cfg = CheckpointConfig(root=root, writer="thread", include_rng=False, keep_last=keep_last)
    with Checkpointer(cfg, rank=0, world_size=1) as engine:
        for step in steps:
            engine.save({"model": _model(step)}, step)
            engine.wait()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    _save(root, (1, 2))
    return root


def _loads(root: Path) -> tuple[int, list[str]]:
    fresh = torch.nn.Linear(4, 3)
    got = load(root, {"model": fresh}, restore_rng=False)
    assert torch.equal(fresh.weight, _model(got.step).weight)
    return got.step, got.skipped


def _reshards(root: Path) -> tuple[int, list[str]]:
    fresh = torch.nn.Linear(4, 3)
    got = reshard(root, {"model": fresh})
    assert torch.equal(fresh.weight, _model(got.step).weight)
    return got.step, got.skipped


# --- retention and symbolic links -------------------------------------------------------


def test_retention_leaves_a_linked_step_and_its_target_alone(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "otherjob"
    _save(other, (1,))
    job = tmp_path / "job"
    job.mkdir()
    link = job / step_dir_name(1)
    link.symlink_to(other / step_dir_name(1), target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        _save(job, (5,), keep_last=1)
    assert (other / step_dir_name(1) / MANIFEST_NAME).is_file()
    assert verify(other, step=1) == 1
    assert link.is_symlink()  # not ours to remove either
    assert any(
        "symbolic link, not removed by retention" in r.getMessage() and str(link) in r.getMessage()
        for r in caplog.records
    )
    assert verify(job) == 5


def test_a_linked_step_takes_no_keep_last_slot(root: Path, tmp_path: Path) -> None:
    """keep_last counts checkpoints the root really holds: a link (which no reader
    follows) must not push a real one out."""
    other = tmp_path / "otherjob"
    _save(other, (4,))
    (root / step_dir_name(4)).symlink_to(other / step_dir_name(4), target_is_directory=True)
    _save(root, (5,), keep_last=2)
    assert [s for s, _ in step_dirs(root)] == [2, 4, 5]  # the two real newest: 2 and 5
    assert verify(root, step=2) == 2
    assert (other / step_dir_name(4) / MANIFEST_NAME).is_file()


def test_part_retention_does_not_delete_through_a_link(tmp_path: Path) -> None:
    """Node-local roots: a rank deletes its own files of old steps, never a link's target's."""
    other = tmp_path / "otherjob" / step_dir_name(1)
    other.mkdir(parents=True)
    theirs = [other / rank_manifest_name(0), other / rank_data_name(0), other / MANIFEST_NAME]
    for path in theirs:
        path.write_bytes(b"x")
    root = tmp_path / "local"
    root.mkdir()
    (root / step_dir_name(1)).symlink_to(other, target_is_directory=True)
    for step in (2, 3):
        (root / step_dir_name(step)).mkdir()
        (root / step_dir_name(step) / rank_manifest_name(0)).write_bytes(b"{}")
        (root / step_dir_name(step) / rank_data_name(0)).write_bytes(b"")
    assert apply_part_retention(root, 0, keep_last=1, newest=3) == [2]
    assert all(path.is_file() for path in theirs)
    assert (root / step_dir_name(1)).is_symlink()


# --- step names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-000000000002", 2),
        ("step-1000000000000", 10**12),  # past 12 digits the name just grows
        ("step-\u00b2", None),
        ("step-\u0661", None),
        (ARABIC_INDIC_ONE_CANONICAL, None),  # Arabic-Indic digits, canonical length
        ("step-3", None),
        ("step-0000000000003", None),
        ("step-", None),
        ("step-+00000000001", None),
        ("step- 00000000001", None),
        ("latest", None),
    ],
)
def test_only_the_canonical_ascii_name_is_a_step(name: str, step: int | None) -> None:
    assert parse_step_name(name) == step


@pytest.mark.parametrize("name", ["step-\u00b2", "step-\u0661", ARABIC_INDIC_ONE_CANONICAL])
def test_a_unicode_digit_step_directory_is_ignored(
    root: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    stray = root / name
    shutil.copytree(root / step_dir_name(1), stray)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert _loads(root) == (2, [])
        assert _reshards(root) == (2, [])
        assert verify(root) == 2
    assert any(
        f"{stray}: ignored, not a checkpoint step directory" in r.getMessage()
        for r in caplog.records
    )
    assert [info.step for info in CheckpointStore(root).list()] == [1, 2]
    for cmd in ("verify", "inspect"):
        out = runner.invoke(app, [cmd, str(root)])
        assert out.exit_code == 0, out.output
        assert out.exception is None
    assert runner.invoke(app, ["verify", str(root)]).stdout.startswith("ok: step 2, 1 rank(s)")


def test_a_latest_naming_a_non_canonical_step_is_ignored(root: Path) -> None:
    (root / "latest").write_text("step-2\n")
    with pytest.raises(Exception, match="bad content 'step-2'"):
        CheckpointStore(root).latest_pointer()
    assert _loads(root)[0] == 2


def test_a_non_canonical_step_directory_is_not_a_step(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand copy ``step-3`` of step 2: the store would open ``step-000000000003``, so it is
    not listed, and load, reshard and verify all resume from step 2 and agree."""
    stray = root / "step-3"
    shutil.copytree(root / step_dir_name(2), stray)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        assert _loads(root) == (2, [])
        assert _reshards(root) == (2, [])
        assert verify(root) == 2
    assert any(f"{stray}: ignored" in r.getMessage() for r in caplog.records)
    out = runner.invoke(app, ["verify", str(root)])
    assert out.exit_code == 0 and out.stdout.startswith("ok: step 2, 1 rank(s)")
    listed = runner.invoke(app, ["inspect", str(root)])
    assert listed.exit_code == 0 and "\n3 " not in listed.stdout


# --- a step that does not open --------------------------------------------------------------


def _vanishing(monkeypatch: pytest.MonkeyPatch, root: Path, step: int) -> None:
    """``step`` is listed, then removed before it is opened (another process's retention)."""
    real_open = CheckpointStore.open

    def open_after_removal(self: CheckpointStore, candidate: int) -> object:
        if candidate == step:
            shutil.rmtree(root / step_dir_name(step))
        return real_open(self, candidate)

    monkeypatch.setattr(CheckpointStore, "open", open_after_removal)


@pytest.mark.parametrize("loader", [_loads, _reshards])
def test_a_step_removed_between_listing_and_opening_is_passed_over(
    root: Path, monkeypatch: pytest.MonkeyPatch, loader: object
) -> None:
    _vanishing(monkeypatch, root, 2)
    step, skipped = loader(root)  # type: ignore[operator]
    assert step == 1
    assert len(skipped) == 1 and f"{step_dir_name(2)}: no such checkpoint" in skipped[0]


@pytest.mark.parametrize("loader", [_loads, _reshards])
def test_a_step_not_found_is_listed_like_a_corrupt_one(
    root: Path, monkeypatch: pytest.MonkeyPatch, loader: object
) -> None:
    """Whatever the reason a listed step does not open, the loader falls back and says so."""
    listed = CheckpointStore.resolve

    def with_a_ghost(self: CheckpointStore) -> tuple[list[int], str]:
        steps, note = listed(self)
        return [7, *steps], note

    monkeypatch.setattr(CheckpointStore, "resolve", with_a_ghost)
    step, skipped = loader(root)  # type: ignore[operator]
    assert step == 2 and len(skipped) == 1 and "no such checkpoint" in skipped[0]


def test_an_explicit_step_that_does_not_open_still_raises(root: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        load(root, {"model": torch.nn.Linear(4, 3)}, step=7)
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        reshard(root, {"model": torch.nn.Linear(4, 3)}, step=7)


def test_nothing_opens_names_every_step(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _vanishing(monkeypatch, root, 2)
    (root / step_dir_name(1) / rank_manifest_name(0)).unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"no complete checkpoint \(.*step-0+2"):
        load(root, {"model": torch.nn.Linear(4, 3)}, restore_rng=False)


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_a_root_that_is_a_file_or_missing_is_named_as_such(tmp_path: Path, command: str) -> None:
    a_file = tmp_path / "model.pt"
    a_file.write_bytes(b"not a checkpoint directory")
    extra = [str(tmp_path / "out")] if command == "convert" else []
    for root, said in ((a_file, "not a directory"), (tmp_path / "gone", "no such directory")):
        result = runner.invoke(app, [command, str(root), *extra])
        assert result.exit_code == 2, result.output
        assert result.output.strip().endswith(f"{root}: {said}"), result.output
