"""An acceptance sweep of damaged and hostile checkpoint directories, and of saves that fail.

The rule: a damaged checkpoint is a one-line ``CheckpointError`` naming the file and what
is wrong (``checkpoint verify``: one ``error:`` line, no traceback), or the right data,
never wrong numbers, never a hang; ``load()`` without a step passes over it to the previous
step. A save that fails on I/O is reported once, naming the file, leaves ``latest`` on a
complete step, and the next save works.

What the other damage tests do not cover, and so this one does: data files truncated,
extended, bit-flipped mid-tensor, swapped for another step's, a FIFO or a directory; a
``latest`` that is a symbolic-link loop, a directory or ``../..``; an I/O error (EIO) while
reading a data file; a shape whose zero dimension hides dimensions that overflow torch's
strides; and ENOSPC at each write and ``fsync`` of a save, and at its commit. Three of
these were bugs (fixed in ``checkpoint/``): EIO escaped as a bare ``OSError`` (``load()``
did not fall back, ``verify`` printed a traceback), the zero-dimension shape escaped as
torch's ``RuntimeError``, and a failed write said ``[Errno 28] No space left on device``
without a file name, leaving ``.MANIFEST.json.tmp-*`` files behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from checkpoint import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    load,
)
from checkpoint.cli import app
from checkpoint.manifest import step_dir_name
from trainguard.wire import CheckpointEvent

DATA = "rank-00000.bin"
runner = CliRunner()


def _model(step: int) -> torch.nn.Linear:
    torch.manual_seed(step)
    return torch.nn.Linear(8, 4)


def _engine(root: Path, events: list[CheckpointEvent] | None = None) -> Checkpointer:
    sink = events.append if events is not None else None
    cfg = CheckpointConfig(root=root, writer="thread", include_rng=False)
    return Checkpointer(cfg, rank=0, world_size=1, event_sink=sink)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of a one-rank job, committed; copied per test."""
    root = tmp_path_factory.mktemp("sweep") / "ckpt"
    with _engine(root) as engine:
        for step in (1, 2):
            engine.save({"model": _model(step)}, step)
            engine.wait()
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "ckpt", symlinks=True))


def _load(root: Path, step: int | None = None) -> tuple[int, list[str]]:
    """Load into a fresh model; whatever loads must be exactly the step it says."""
    fresh = torch.nn.Linear(8, 4)
    got = load(root, {"model": fresh}, step=step, restore_rng=False)
    want = _model(got.step)
    assert torch.equal(fresh.weight, want.weight) and torch.equal(fresh.bias, want.bias)
    return got.step, got.skipped


def _cli_verify(root: Path, step: int, says: str) -> None:
    """``checkpoint verify --step``: exit 1 with one ``error:`` line naming the damage."""
    result = runner.invoke(app, ["verify", str(root), "--step", str(step)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 10)


def _extend(path: Path) -> None:
    with open(path, "ab") as fh:
        fh.write(b"junk")


def _flip_mid_tensor(path: Path) -> None:
    part = json.loads(path.with_name("rank-00000.json").read_bytes())
    weight = next(e for e in part["entries"] if e["name"] == "model/weight")
    data = bytearray(path.read_bytes())
    data[weight["offset"] + weight["nbytes"] // 2 + 3] ^= 0x10  # one bit of model/weight
    path.write_bytes(data)


def _older_step(path: Path) -> None:
    shutil.copy(path.parents[1] / step_dir_name(1) / DATA, path)  # same size, step 1's bytes


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncate, "326 bytes on disk, manifest says 336"),
        (_extend, "340 bytes on disk, manifest says 336"),
        (_flip_mid_tensor, "CRC mismatch in bytes 0..336"),
        (_older_step, "CRC mismatch in bytes 0..336"),
        (_fifo, "not a regular file"),
        (_directory, "not a regular file"),
        (Path.unlink, "data file missing"),
    ],
    ids=["truncated", "extended", "bit-flip", "step-1-bytes", "fifo", "directory", "missing"],
)
def test_damaged_data_file_is_named_and_passed_over(
    root: Path, damage: Callable[[Path], Any], says: str
) -> None:
    data = root / step_dir_name(2) / DATA
    damage(data)
    with pytest.raises(CheckpointError, match=f"{data}: {says}"):
        _load(root, step=2)
    step, skipped = _load(root)
    assert step == 1 and says in skipped[0]
    _cli_verify(root, 2, f"{data}: {says}")


def test_io_error_reading_a_data_file_is_damage_not_a_crash(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad sector under step 2's data file (EIO): once a bare OSError, so ``load()`` did
    not fall back to step 1 and ``checkpoint verify`` printed a traceback."""
    bad = root / step_dir_name(2) / DATA
    real = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}") == str(bad):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    with pytest.raises(CheckpointCorruptError, match=f"{bad}: unreadable at bytes 0..336"):
        _load(root, step=2)
    step, skipped = _load(root)
    assert step == 1 and "Input/output error" in skipped[0]
    _cli_verify(root, 2, f"{bad}: unreadable at bytes 0..")


def _repin(root: Path, step: int, edit: Callable[[dict[str, Any]], None]) -> Path:
    """Edit ``step``'s rank manifest and record its new SHA-256 in MANIFEST.json, as a
    buggy writer would (so the validators, not the digest, have to catch it)."""
    step_dir = root / step_dir_name(step)
    part = step_dir / "rank-00000.json"
    raw = json.loads(part.read_bytes())
    edit(raw)
    data = json.dumps(raw).encode()
    part.write_bytes(data)
    manifest = json.loads((step_dir / "MANIFEST.json").read_bytes())
    manifest["ranks"][0]["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (step_dir / "MANIFEST.json").write_bytes(json.dumps(manifest).encode())
    return part


@pytest.mark.parametrize("with_map", [False, True])
def test_an_empty_shape_of_huge_dimensions_is_corrupt(root: Path, with_map: bool) -> None:
    """``[0, 2**48, 2**48, 2**48]`` has no elements, so ``nbytes`` 0 passes the size check,
    but torch cannot compute its strides: load() raised torch's RuntimeError instead of
    falling back past it."""
    shape = [0, 1 << 48, 1 << 48, 1 << 48]

    def edit(raw: dict[str, Any]) -> None:
        entry = next(e for e in raw["entries"] if e["name"] == "model/weight")
        entry.update(shape=shape, nbytes=0)
        if with_map:
            gmap = entry["global_map"]
            gmap["shape"] = shape
            gmap["pieces"] = [{"base": 0, "offsets": [0] * 4, "shape": shape, "strides": [1] * 4}]
        else:
            entry["global_map"] = None

    part = _repin(root, 2, edit)
    with pytest.raises(CheckpointCorruptError, match=rf"{part}: field entries\[1\]\.shape: "):
        _load(root, step=2)
    assert _load(root)[0] == 1
    _cli_verify(root, 2, "dimensions multiply past")


@pytest.mark.parametrize("kind", ["dotdot", "loop", "directory", "empty"])
def test_a_hostile_latest_is_ignored(root: Path, kind: str) -> None:
    latest = root / "latest"
    latest.unlink()
    if kind == "dotdot":
        latest.write_bytes(b"../../etc\n")
    elif kind == "loop":
        latest.symlink_to("latest")
    elif kind == "directory":
        latest.mkdir()
    else:
        latest.write_bytes(b"")
    fresh = torch.nn.Linear(8, 4)
    got = load(root, {"model": fresh}, restore_rng=False)
    assert got.step == 2 and str(latest) in got.latest_note
    assert torch.equal(fresh.weight, _model(2).weight)
    result = runner.invoke(app, ["verify", str(root)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "step 2" in result.output


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


# (function patched, which call fails: a predicate on its arguments, the file named)
ENOSPC_AT = {
    "data-pwrite": ("pwrite", lambda a: DATA in _fd_path(a[0]), DATA),
    "data-fsync": ("fsync", lambda a: f".{DATA}.tmp" in _fd_path(a[0]), DATA),
    "data-rename": ("replace", lambda a: str(a[1]).endswith(DATA), DATA),
    "part-fsync": ("fsync", lambda a: ".rank-00000.json.tmp" in _fd_path(a[0]), "rank-00000.json"),
    "part-rename": ("replace", lambda a: str(a[1]).endswith("rank-00000.json"), "rank-00000.json"),
    "commit-fsync": ("fsync", lambda a: ".MANIFEST.json.tmp" in _fd_path(a[0]), "MANIFEST.json"),
    "commit-rename": ("replace", lambda a: str(a[1]).endswith("MANIFEST.json"), "MANIFEST.json"),
    "latest-rename": ("replace", lambda a: str(a[1]).endswith("latest"), "latest"),
}


@pytest.mark.parametrize("where", list(ENOSPC_AT))
def test_a_save_that_hits_enospc_fails_once_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The disk fills during step 2's save: ``wait()`` raises once, naming the file; no
    temporary file is left; ``latest`` still names step 1 and the newest step that opens
    is whole (step 1, or step 2 when only moving ``latest`` failed: that is after the
    commit point, so the save is reported committed, with a warning, not failed); step 3
    then saves."""
    name, fails, file_named = ENOSPC_AT[where]
    root = tmp_path / "ckpt"
    events: list[CheckpointEvent] = []
    engine = _engine(root, events)
    engine.save({"model": _model(1)}, 1)
    engine.wait()
    real = getattr(os, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if fails(args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, name, failing)
        engine.save({"model": _model(2)}, 2)
        if where == "latest-rename":  # after the commit point: committed, with a warning
            engine.wait()
        else:
            with pytest.raises(CheckpointWriteError) as raised:
                engine.wait()
    if where == "latest-rename":
        assert [e.kind for e in events if e.step == 2][-1] == "committed"
        assert not [e for e in events if e.kind == "failed"]
    else:
        message = str(raised.value)
        assert message.startswith("step 2: ") and "No space left on device" in message
        assert file_named in message and str(root) in message, message
        engine.wait()  # reported once
        assert [e.step for e in events if e.kind == "failed"] == [2]
    leftovers = [p.name for p in root.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    assert (root / "latest").read_text() == step_dir_name(1) + "\n"
    assert _load(root)[0] == (2 if where == "latest-rename" else 1)
    engine.save({"model": _model(3)}, 3)
    engine.wait()
    engine.close()
    assert _load(root) == (3, [])
    assert (root / "latest").read_text() == step_dir_name(3) + "\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_root_fails_the_save_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    engine = _engine(root)
    engine.save({"model": _model(1)}, 1)
    engine.wait()
    root.chmod(0o555)
    try:
        engine.save({"model": _model(2)}, 2)
        with pytest.raises(CheckpointWriteError, match=str(root)):
            engine.wait()
    finally:
        root.chmod(0o755)
        engine.close()
    assert _load(root)[0] == 1


def test_a_root_that_is_a_file_is_refused_up_front_naming_it(tmp_path: Path) -> None:
    """A setting's mistake: CheckpointConfigError, not the OS's FileExistsError."""
    root = tmp_path / "ckpt"
    root.write_bytes(b"not a directory")
    events: list[CheckpointEvent] = []
    with pytest.raises(CheckpointConfigError, match=f"checkpoint root {root}: "):
        _engine(root, events)
    assert root.read_bytes() == b"not a directory"
