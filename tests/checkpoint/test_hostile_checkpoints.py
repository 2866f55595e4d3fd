"""Checkpoints as untrusted input, and conversions that must never write over one.

Found by the checkpoint acceptance probe: a crafted skeleton ran code on ``load()`` (its
checksums were valid), ``convert SRC SRC`` and ``import`` into an existing root replaced a
committed step, ``convert`` stopped at a damaged step that ``load()`` skips, a misfit
state left the model loaded and the optimizer not, with torch's multi-line message, and
``python -m checkpoint.cli`` printed a usage panel for a bad argument.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import checkpoint
from checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointLayoutError,
    CheckpointUntrustedError,
    _snapshot,
    load,
    verify,
)
from checkpoint.cli import app, main
from checkpoint.crc import crc32
from checkpoint.manifest import SKELETON_ENTRY, rank_data_name, step_dir_name

runner = CliRunner()


@dataclass
class Progress:
    """A user type kept in the training state (needs an opt-in to load)."""

    epoch: int
    seen: int


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _save(root: Path, steps: tuple[int, ...] = (1, 2), **extra: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(CheckpointConfig(root=root, keep_last=5), rank=0, world_size=1) as ckpt:
        for step in steps:
            ckpt.save({"model": model, "optim": opt, "data": step, **extra}, step)
            ckpt.wait()
    return model


def _replace_skeleton(root: Path, step: int, payload: bytes) -> None:
    """Rewrite ``step``'s skeleton with ``payload``, every checksum made consistent again
    (what an attacker who can write the directory does)."""
    step_dir = root / step_dir_name(step)
    part_path = step_dir / "rank-00000.json"
    part = json.loads(part_path.read_text())
    data = bytearray((step_dir / rank_data_name(0)).read_bytes())
    skeleton = next(e for e in part["entries"] if e["name"] == SKELETON_ENTRY)
    skeleton.update(offset=len(data), nbytes=len(payload), shape=[len(payload)])
    data += payload
    (step_dir / rank_data_name(0)).write_bytes(bytes(data))
    info = part["data_file"]
    chunk = info["chunk_bytes"]
    info["size_bytes"] = len(data)
    info["chunk_crc32"] = [crc32(bytes(data[i : i + chunk])) for i in range(0, len(data), chunk)]
    if info.get("sha256"):
        info["sha256"] = hashlib.sha256(data).hexdigest()
    raw = json.dumps(part).encode()
    part_path.write_bytes(raw)
    manifest_path = step_dir / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["ranks"][0].update(
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        size_bytes=len(data),
        sha256=info.get("sha256"),
    )
    manifest["total_bytes"] = len(data)
    manifest_path.write_text(json.dumps(manifest))


def test_crafted_skeleton_runs_no_code_and_is_refused_not_skipped(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    marker = tmp_path / "PWNED"
    _replace_skeleton(root, 2, pickle.dumps({"model": _RunsCode(marker)}))
    assert verify(root) == 2  # the bytes are what the manifest promises
    with pytest.raises(CheckpointUntrustedError) as info:
        load(root, {"model": torch.nn.Linear(4, 3)})
    assert not marker.exists()
    message = str(info.value)
    assert "\n" not in message
    assert f"'{os.system.__module__}.system'" in message and "allowed_globals" in message
    assert str(root / step_dir_name(2)) in message  # the step, not a fallback to step 1


def test_opt_in_allows_exactly_what_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, steps=(1,), progress=Progress(epoch=3, seen=96))
    name = f"{Progress.__module__}.{Progress.__qualname__}"
    with pytest.raises(CheckpointUntrustedError, match=name.replace(".", r"\.")):
        load(root, {"model": torch.nn.Linear(4, 3)})
    restored = load(root, {"model": torch.nn.Linear(4, 3)}, allowed_globals=[Progress])
    assert restored.values["progress"] == Progress(epoch=3, seen=96)
    assert load(root, {}, allowed_globals=[name]).values["progress"].seen == 96
    assert load(root, {}, trusted=True).values["progress"].epoch == 3
    with pytest.raises(CheckpointUntrustedError):  # the opt-in was for that call only
        load(root, {})
    checkpoint.add_safe_globals([Progress])
    try:
        assert load(root, {}).values["progress"].epoch == 3
    finally:
        _snapshot._EXTRA_GLOBALS.discard(name)


def test_a_training_state_loads_without_opt_in(tmp_path: Path) -> None:
    """What a job saves (modules, Adam, a scheduler, every RNG, plain containers, torch
    dtypes and sizes, NumPy values) needs no allowed_globals."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    extras = {
        "ordered": collections.OrderedDict(a=1),
        "counts": collections.defaultdict(int, b=2),
        "window": collections.deque([1.0, 2.0]),
        "tags": {"x", "y"},
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "np_loss": np.float64(0.25),
        "np_array": np.arange(3),
    }
    root = tmp_path / "ckpt"
    with Checkpointer(CheckpointConfig(root=root), rank=0, world_size=1) as ckpt:
        ckpt.save({"model": model, "optim": opt, "sched": sched, "extras": extras}, 5)
        ckpt.wait()
    random.random()
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    restored = load(root, {"model": model2, "optim": opt2, "sched": sched2})
    got = restored.values["extras"]
    assert got["dtype"] is torch.bfloat16 and got["size"] == torch.Size([2, 3])
    assert got["counts"]["b"] == 2 and list(got["window"]) == [1.0, 2.0]
    assert got["np_loss"] == 0.25 and got["np_array"].tolist() == [0, 1, 2]
    assert opt2.param_groups[0]["betas"] == (0.9, 0.95)
    assert torch.equal(model2.state_dict()["1.running_mean"], model.state_dict()["1.running_mean"])


def test_misfit_state_is_one_line_and_restores_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(7.0)
    bad_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(CheckpointLayoutError, match=r"'optim'.*saved \[2\], target \[1\]"):
        load(root, {"model": model, "optim": bad_opt})
    assert bool((model.weight == 7.0).all())  # checked before anything was loaded
    with pytest.raises(CheckpointLayoutError) as info:
        load(root, {"model": torch.nn.Linear(5, 3)})
    message = str(info.value)
    assert "\n" not in message and "\t" not in message
    assert "weight [3, 4] vs [3, 5]" in message


def test_convert_never_writes_over_the_source(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    step2 = root / step_dir_name(2)
    before = {p.name: p.read_bytes() for p in step2.iterdir()}
    for out in (str(root), f"{root}/../{root.name}/"):
        result = runner.invoke(app, ["convert", str(root), out, "--to", "universal"])
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and "is the source" in result.output
    assert {p.name: p.read_bytes() for p in step2.iterdir()} == before
    other = tmp_path / "other"
    _save(other)  # holds step 2 too
    result = runner.invoke(app, ["convert", str(root), str(other), "--to", "universal"])
    assert result.exit_code == 2 and "already holds step 2" in result.output


def test_import_refuses_an_existing_or_newer_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    file = tmp_path / "m.safetensors"
    assert (
        runner.invoke(app, ["convert", str(root), str(file), "--to", "safetensors"]).exit_code == 0
    )
    step2 = root / step_dir_name(2)
    before = {p.name: p.read_bytes() for p in step2.iterdir()}
    latest = (root / "latest").read_bytes()
    for step in ("2", "0"):
        result = runner.invoke(
            app, ["import", str(file), str(root), "--from", "safetensors", "--step", step]
        )
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and "already holds step" in result.output
    assert {p.name: p.read_bytes() for p in step2.iterdir()} == before
    assert (root / "latest").read_bytes() == latest
    assert not (root / step_dir_name(0)).exists()
    result = runner.invoke(
        app, ["import", str(file), str(root), "--from", "safetensors", "--step", "3"]
    )
    assert result.exit_code == 0, result.output  # a newer step is fine


def test_convert_uses_the_step_load_resumes_from(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    data = root / step_dir_name(2) / rank_data_name(0)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["convert", str(root), str(out), "--to", "safetensors"])
    assert result.exit_code == 0, result.output
    assert "from step 1; skipped newer step 2" in result.output
    result = runner.invoke(
        app, ["convert", str(root), str(tmp_path / "x"), "--to", "universal", "--step", "2"]
    )
    assert result.exit_code == 1, result.output  # damage, as verify says it
    assert "CRC mismatch" in result.output


def test_module_main_bad_argument_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    _save(root, steps=(1,))
    assert main(["verify", str(root), "--step", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "--step" in err
    assert main(["verify", str(root)]) == 0
    assert main(["verify", str(tmp_path / "missing")]) == 2
