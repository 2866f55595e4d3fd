"""A re-checksummed, edited manifest is refused, never loaded as wrong numbers; and a save
whose ``latest`` could not be moved is committed, not failed.

Checksums cover bytes, not their meaning: a buggy tool (or a person) that edits a rank
manifest entry's ``dtype``, ``shape``, ``offset`` or ``nbytes`` and then records the edited
manifest's SHA-256 in ``MANIFEST.json`` (as the writer computes it) passes every checksum.
Each test saves two real checkpoints with the real engine, edits step 2 that way, and
expects ``load()`` to pass over step 2 to step 1 with a one-line reason naming the file and
the tensor (step 1's values bit for bit), as it does for any damage. Deep ``verify`` (the
API and ``trainguard checkpoint verify``) must give the same answer: step 2 damaged, step 1
what a restart resumes from; including the edits only the skeleton's copy of each
tensor's dtype and shape reveals, which it reads without torch.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointStore,
    _snapshot,
    load,
    verify,
)
from checkpoint.cli import app
from checkpoint.manifest import MANIFEST_NAME, step_dir_name

STEPS = (1, 2)


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {
        "model": torch.nn.Linear(6, 3),  # weight 72 bytes, bias 12 (52 bytes of padding)
        "a": torch.randn(4, 4) + 10 * step,  # a and b: same dtype and size
        "b": torch.randn(4, 4) - 10 * step,
        "v": torch.arange(5, dtype=torch.float64) * step,
    }


def _config(root: Path) -> CheckpointConfig:
    return CheckpointConfig(root=root, writer="thread", include_rng=False, keep_last=5)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("meaning") / "ckpt"
    with Checkpointer(_config(root), rank=0, world_size=1) as ckpt:
        for step in STEPS:
            ckpt.save(_state(step), step)
            ckpt.wait()
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(template, dest)
    return dest


def _edit(root: Path, change: Callable[[dict[str, Any]], None], step: int = 2) -> None:
    """Edit step ``step``'s rank manifest with ``change(entries by name)``, then re-pin its
    SHA-256 in ``MANIFEST.json`` exactly as the writer computes it (sorted, compact JSON;
    SHA-256 of those bytes): every checksum agrees with the edited manifest."""
    step_dir = root / step_dir_name(step)
    part_path = step_dir / "rank-00000.json"
    doc = json.loads(part_path.read_bytes())
    change({e["name"]: e for e in doc["entries"]})
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    part_path.write_bytes(raw)
    manifest_path = step_dir / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_bytes())
    manifest["ranks"][0]["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    manifest_path.write_bytes(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _fresh() -> dict[str, Any]:
    return {"model": torch.nn.Linear(6, 3), "a": None, "b": None, "v": None}


def _loads_step_1(root: Path, *why: str) -> None:
    """``load()`` passes over step 2, saying why in one line, and restores step 1 exactly."""
    state = _fresh()
    got = load(root, state, restore_rng=False)
    assert got.step == 1, f"loaded the edited step 2: {got.values}"
    assert len(got.skipped) == 1 and "\n" not in got.skipped[0]
    for word in why:
        assert word in got.skipped[0], got.skipped[0]
    want = _state(1)
    assert torch.equal(state["model"].weight, want["model"].weight)
    assert torch.equal(state["model"].bias, want["model"].bias)
    for key in ("a", "b", "v"):
        value = got.values[key]
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
    with pytest.raises(CheckpointCorruptError):
        load(root, _fresh(), step=2, restore_rng=False)


def test_dtype_of_the_same_size_is_refused(root: Path) -> None:
    """float32 -> int32: ``nbytes`` still equals elements x 4; only the skeleton, inside
    the CRC-checked data file, still says what the writer stored."""
    _edit(root, lambda e: e["a"].update(dtype="int32"))
    _loads_step_1(root, "rank-00000.bin", "'a'", "int32", "float32")


def test_dtype_and_nbytes_shrunk_together_are_refused(root: Path) -> None:
    """float32 -> float16 with ``nbytes`` halved to match: consistent, inside the file,
    overlapping nothing; it would read the first half of ``a``'s bytes as halves."""
    _edit(root, lambda e: e["a"].update(dtype="float16", nbytes=32))
    _loads_step_1(root, "'a'", "float16")


def test_dtype_and_nbytes_grown_into_the_next_tensor_are_refused(root: Path) -> None:
    _edit(root, lambda e: e["a"].update(dtype="float64", nbytes=128))
    _loads_step_1(root, "rank-00000.json", "overlap", "'a'", "'b'")


def test_shape_with_the_same_byte_count_is_refused(root: Path) -> None:
    """[4, 4] -> [16]: same bytes, a 1-D view its global map allows (a flat partition)."""
    _edit(root, lambda e: e["a"].update(shape=[16]))
    _loads_step_1(root, "'a'", "[16]", "[4, 4]")


def test_offset_onto_another_tensor_is_refused(root: Path) -> None:
    def change(e: dict[str, Any]) -> None:
        e["a"]["offset"] = e["b"]["offset"]

    _edit(root, change)
    _loads_step_1(root, "rank-00000.json", "overlap", "'a'", "'b'")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: .*overlap"):
        verify(root, step=2)
    assert verify(root) == 1  # what load() resumes from, as checkpoint verify says


def test_offset_shifted_inside_the_padding_is_refused(root: Path) -> None:
    """The bias (12 bytes) is followed by 52 bytes of padding: moved 8 bytes on, it still
    overlaps nothing and stays inside the file, but reads the wrong bytes."""
    _edit(root, lambda e: e["model/bias"].update(offset=e["model/bias"]["offset"] + 8))
    _loads_step_1(root, "rank-00000.json", "'model/bias'", "aligned")


def test_offsets_of_two_equal_tensors_swapped_are_refused(root: Path) -> None:
    def change(e: dict[str, Any]) -> None:
        e["a"]["offset"], e["b"]["offset"] = e["b"]["offset"], e["a"]["offset"]

    _edit(root, change)
    _loads_step_1(root, "rank-00000.json", "'a'", "'b'", "order")
    with pytest.raises(CheckpointCorruptError, match=r"rank-00000\.json: .*order"):
        verify(root, step=2, deep=False)


def test_layout_checks_run_when_any_reader_opens_the_step(root: Path) -> None:
    """The layout checks live in the rank manifest parser, which opening a step runs:
    ``reshard``, ``convert``, ``inspect`` and the object-store tier see them too."""
    _edit(root, lambda e: None)  # re-pinned but unchanged: loads
    got = load(root, _fresh(), restore_rng=False)
    assert got.step == 2 and not got.skipped and torch.equal(got.values["a"], _state(2)["a"])
    _edit(root, lambda e: e["b"].update(offset=e["a"]["offset"]))
    with pytest.raises(CheckpointCorruptError, match=r"entries\[\d+\]\.offset: .*overlap"):
        CheckpointStore(root).open(2).close()


def test_a_latest_that_cannot_be_moved_leaves_the_save_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``MANIFEST.json`` is the commit point: a ``latest`` rename that fails afterwards (here
    ``latest`` is a directory, so the rename is refused) must not report the save failed.
    The save is committed, a one-line warning says ``latest`` was not moved, ``load()``
    finds the step by scanning, and the next save moves ``latest`` again."""
    root = tmp_path / "ckpt"
    events: list[tuple[str, int]] = []
    sink = lambda ev: events.append((ev.kind, ev.step))  # noqa: E731
    with Checkpointer(_config(root), rank=0, world_size=1, event_sink=sink) as ckpt:
        ckpt.save(_state(1), 1)
        ckpt.wait()
        (root / "latest").unlink()
        (root / "latest").mkdir()
        (root / "latest" / "keep").write_text("a rename cannot replace a non-empty directory")
        with caplog.at_level(logging.WARNING, logger="checkpoint"):
            ckpt.save(_state(2), 2)
            ckpt.wait()  # raised CheckpointWriteError: the save was reported failed
        assert ("committed", 2) in events and ("failed", 2) not in events
        notes = [r.getMessage() for r in caplog.records if "latest not moved" in r.getMessage()]
        assert len(notes) == 1 and "\n" not in notes[0] and step_dir_name(2) in notes[0]
        assert (root / step_dir_name(2) / MANIFEST_NAME).is_file()
        state = _fresh()
        got = load(root, state, restore_rng=False)
        assert got.step == 2 and "latest" in got.latest_note
        assert torch.equal(got.values["a"], _state(2)["a"])
        shutil.rmtree(root / "latest")
        ckpt.save(_state(3), 3)
        ckpt.wait()
    assert (root / "latest").read_text() == step_dir_name(3) + "\n"
    assert load(root, _fresh(), restore_rng=False).latest_note == ""


#: Edits only the skeleton's copy of a tensor (its name, dtype and shape, in the CRC-covered
#: data file) reveals: each entry stays consistent with itself and with the file's layout.
SKELETON_EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "dtype of the same size": (lambda e: e["a"].update(dtype="int32"), ("int32", "float32")),
    "dtype and nbytes shrunk": (
        lambda e: e["a"].update(dtype="float16", nbytes=32),
        ("float16", "float32"),
    ),
    "shape of the same count": (lambda e: e["a"].update(shape=[16]), ("[16]", "[4, 4]")),
    "entry renamed": (lambda e: e["a"].update(name="a.renamed"), ("does not list",)),
}


@pytest.mark.parametrize("edit", SKELETON_EDITS)
def test_verify_refuses_what_load_refuses_by_the_skeleton(root: Path, edit: str) -> None:
    """``verify(step=2)`` raises, naming the step, the rank file and the tensor on one line;
    ``verify()`` answers step 1 with step 2 in ``skipped``, as ``load()`` resumes from step 1
    (without this, verify said step 2 was good and a restart went back to step 1)."""
    change, words = SKELETON_EDITS[edit]
    _edit(root, change)
    _loads_step_1(root, *words)
    with pytest.raises(CheckpointCorruptError) as info:
        verify(root, step=2)
    message = str(info.value)
    assert "\n" not in message
    for word in (f"{step_dir_name(2)}/rank-00000.bin: ", "'a'", *words):
        assert word in message, message
    skipped: list[str] = []
    assert verify(root, skipped=skipped) == 1
    assert skipped == [f"step 2: {message}"]
    assert verify(root, step=2, deep=False) == 2  # --quick reads no data, the skeleton neither


@pytest.mark.parametrize("edit", ["dtype of the same size", "entry renamed"])
def test_cli_verify_reports_a_skeleton_mismatch_on_one_line(root: Path, edit: str) -> None:
    """Exit 1 (damage found), one ``error:`` line naming the tensor; without ``--step`` the
    ``ok:`` line names step 1, the step a restart resumes from."""
    _edit(root, SKELETON_EDITS[edit][0])
    runner = CliRunner()
    one = runner.invoke(app, ["verify", str(root), "--step", "2"])
    assert one.exit_code == 1, one.output
    assert one.stdout == "" and one.stderr.count("\n") == 1
    assert one.stderr.startswith(f"error: {root / step_dir_name(2) / 'rank-00000.bin'}: ")
    assert "'a'" in one.stderr
    resume = runner.invoke(app, ["verify", str(root)])
    assert resume.exit_code == 1, resume.output
    assert resume.stderr.startswith("error: step 2: ") and resume.stderr.count("\n") == 1
    assert resume.stdout.startswith("ok: step 1, 1 rank(s), ")
    assert resume.stdout.endswith("; load() resumes from it, skipping damaged step(s) 2\n")


def test_an_untouched_checkpoint_verifies_with_its_skeleton(root: Path) -> None:
    _edit(root, lambda e: None)  # re-pinned but unchanged
    skipped: list[str] = []
    assert verify(root, skipped=skipped) == 2 and not skipped
    assert verify(root, step=1) == 1
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 0 and result.stdout.startswith("ok: step 2, 1 rank(s)")


def test_a_skeleton_without_dtype_and_shape_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skeletons written before TensorRef carried dtype and shape pickle its name alone;
    they verify and load, and a same-size dtype edit goes unseen by both alike (nothing
    records the dtype), while a renamed entry is still refused by both."""
    root = tmp_path / "ckpt"
    with monkeypatch.context() as patch:  # the old pickled state: [name]
        patch.setattr(_snapshot.TensorRef, "__getstate__", lambda self: [self.name])
        with Checkpointer(_config(root), rank=0, world_size=1) as ckpt:
            for step in STEPS:
                ckpt.save(_state(step), step)
                ckpt.wait()
    assert verify(root) == 2 and verify(root, step=1) == 1
    got = load(root, _fresh(), restore_rng=False)
    assert got.step == 2 and torch.equal(got.values["a"], _state(2)["a"])
    _edit(root, lambda e: e["a"].update(dtype="int32"))
    assert verify(root, step=2) == 2
    assert load(root, _fresh(), restore_rng=False).step == 2
    _edit(root, lambda e: e["a"].update(name="a.renamed"))
    with pytest.raises(CheckpointCorruptError, match="'a', which the manifest does not list"):
        verify(root, step=2)
    _loads_step_1(root, "'a'", "does not list")


def test_verify_checks_the_skeleton_without_torch(root: Path) -> None:
    """``checkpoint.verify`` and ``trainguard checkpoint verify`` import no torch (it is an
    optional extra): the skeleton is read by a torch-free unpickler."""
    _edit(root, SKELETON_EDITS["dtype of the same size"][0])
    code = (
        "import sys, checkpoint\n"
        "from checkpoint.cli import main\n"
        f"root = {str(root)!r}\n"
        "try:\n"
        "    checkpoint.verify(root, step=2)\n"
        "except checkpoint.CheckpointCorruptError as exc:\n"
        "    print('refused', 'int32' in str(exc))\n"
        "print('resumes from', checkpoint.verify(root))\n"
        "print('exit', main(['verify', root, '--step', '2']))\n"
        "print('torch', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["refused True", "resumes from 1", "exit 1", "torch False"]


@pytest.mark.parametrize(("field", "value"), [("shape", 5), ("name", ["a"]), ("dtype", 4)])
def test_a_crafted_placeholder_is_damage_not_a_type_error(field: str, value: object) -> None:
    """A placeholder whose fields have the wrong type (only a crafted file has one) is
    :class:`CheckpointCorruptError` for ``load`` and ``verify`` alike (the one check they
    share), not a ``TypeError`` escaping the loader's fallback."""
    from checkpoint._skeleton import _RefUnpickler, fill, find_ref, load_tree

    ref = _snapshot.TensorRef("a", "float32", (4, 4))
    object.__setattr__(ref, field, value)
    skeleton = pickle.dumps({"a": ref, "n": [1, (ref,)]})
    with pytest.raises(CheckpointCorruptError, match=r"^w: "):
        _snapshot.rebuild(skeleton, {"a": torch.zeros(4, 4)}, where="w")
    tree = load_tree(_RefUnpickler(io.BytesIO(skeleton)), "w")
    with pytest.raises(CheckpointCorruptError, match=r"^w: "):
        fill(tree, lambda r: find_ref(r, {"a": ("float32", (4, 4))}, lambda s: s, "w"))
