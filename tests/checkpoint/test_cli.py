"""``trainguard checkpoint`` commands on real checkpoints (typer's runner, same process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkpoint import CheckpointError, CheckpointStore, reshard
from checkpoint.cli import app
from checkpoint.manifest import rank_data_name, step_dir_name
from checkpoint.rules import ParallelLayout
from tests.checkpoint.megatron import PADDED_PER_TP, full_state, ln_mean, rank_state, save_sharded

runner = CliRunner()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    full = full_state()
    root = tmp_path / "ckpt"
    save_sharded(root, 2, 2, full, PADDED_PER_TP)
    (root / step_dir_name(11)).mkdir()  # a save that never committed
    return root, full


def test_inspect_lists_checkpoints(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = saved
    result = runner.invoke(app, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "WORLD", "SIZE", "AGE", "LATEST"]
    assert lines[1].split()[:3] == ["10", "complete", "4"] and lines[1].split()[-1] == "*"
    assert lines[2].split() == ["11", "partial", "-", "-", "-", "-"]
    out = json.loads(runner.invoke(app, ["inspect", str(root), "-o", "json"]).output)
    assert [c["step"] for c in out["checkpoints"]] == [10, 11]
    assert out["checkpoints"][0]["layout"] == {"tp": 2, "dp": 2}


def test_inspect_names_set_aside_steps(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = saved
    assert CheckpointStore(root).set_aside_after(10) == [11]
    result = runner.invoke(app, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == ["10"]
    assert lines[-1] == f"set aside in {root / 'abandoned'} (never loaded): steps 11"
    out = json.loads(runner.invoke(app, ["inspect", str(root), "-o", "json"]).output)
    assert ([c["step"] for c in out["checkpoints"]], out["abandoned"]) == ([10], [11])


def test_inspect_one_checkpoint_shows_global_mapping(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = saved
    out = json.loads(
        runner.invoke(app, ["inspect", str(root), "--step", "10", "-o", "json"]).output
    )
    qkv = [t for t in out["tensors"] if t["name"] == "model/qkv.weight"]
    assert [t["rank"] for t in qkv] == [0, 1, 2, 3]
    assert all(t["shape"] == [6, 4] and t["global_shape"] == [12, 4] for t in qkv)
    table = runner.invoke(app, ["inspect", str(root), "--step", "10"]).output
    assert table.splitlines()[0].split()[:3] == ["RANK", "NAME", "DTYPE"]


def test_verify_ok_then_damaged(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = saved
    ok = runner.invoke(app, ["verify", str(root)])
    assert ok.exit_code == 0 and ok.output.startswith("ok: step 10, 4 rank(s)")
    path = root / step_dir_name(10) / rank_data_name(2)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    bad = runner.invoke(app, ["verify", str(root)])
    assert bad.exit_code == 1
    assert bad.output.count("\n") == 1 and "rank-00002.bin: CRC mismatch" in bad.output
    assert runner.invoke(app, ["verify", str(root), "--quick"]).exit_code == 0


def test_verify_without_step_checks_what_load_resumes_from(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """'latest' is a hint for verify as for load(): one naming a save that never committed
    (step 11) is noted, and step 10 verified; garbage in it is damage (exit 1), reported in
    the command's own one-line error, not the app's fallback for an escaped exception."""
    root, _ = saved
    (root / "latest").write_text(f"{step_dir_name(11)}\n")
    lagging = runner.invoke(app, ["verify", str(root)])
    assert lagging.exit_code == 0, lagging.output
    assert lagging.stdout.startswith("ok: step 10, 4 rank(s), ")
    assert lagging.stdout.endswith("iB re-read\n")
    assert lagging.stderr == f"note: {root / 'latest'}: names step 11, which is incomplete\n"
    (root / "latest").write_text("../../etc\n")
    garbage = runner.invoke(app, ["verify", str(root)])
    assert garbage.exit_code == 1 and not isinstance(garbage.exception, CheckpointError)
    assert garbage.stderr == f"error: {root / 'latest'}: bad content '../../etc'; ignored\n"
    assert garbage.stdout.startswith("ok: step 10, 4 rank(s)")


@pytest.mark.parametrize("pointer", ["step-000000000011\n", "../../etc\n"])
def test_verify_without_step_reads_latest_once(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch, pointer: str
) -> None:
    """The note on ``latest`` (a lag, or garbage: damage) is classified from the one read
    that found it, not by reading the pointer again, which could find something else."""
    root, _ = saved
    (root / "latest").write_text(pointer)
    reads: list[Path] = []
    real = CheckpointStore.latest_pointer

    def counted(store: CheckpointStore) -> int | None:
        reads.append(store.root)
        return real(store)

    monkeypatch.setattr(CheckpointStore, "latest_pointer", counted)
    result = runner.invoke(app, ["verify", str(root)])
    assert result.stdout.startswith("ok: step 10, 4 rank(s)")
    assert result.exit_code == (0 if pointer.startswith("step-") else 1)
    assert result.stderr.startswith("note: " if pointer.startswith("step-") else "error: ")
    assert reads == [root]


def test_verify_without_step_reports_a_damaged_newest_and_verifies_the_fallback(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    for step in (9, 10):
        save_sharded(root, 2, 2, full_state(seed=step), PADDED_PER_TP, step=step)
    path = root / step_dir_name(10) / rank_data_name(3)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    result = runner.invoke(app, ["verify", str(root)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: step 10: ") and "rank-00003.bin: CRC" in result.stderr
    assert result.stdout.startswith("ok: step 9, 4 rank(s), ")
    assert result.stdout.endswith("; load() resumes from it, skipping damaged step(s) 10\n")
    assert runner.invoke(app, ["verify", str(root), "--step", "9"]).exit_code == 0
    (root / step_dir_name(9) / rank_data_name(0)).unlink()
    none = runner.invoke(app, ["verify", str(root)])
    assert none.exit_code == 1 and none.output.count("\n") == 1
    assert "no checkpoint verifies (step 10: " in none.output and "; step 9: " in none.output


@pytest.mark.parametrize("to", ["universal", "safetensors", "dcp"])
def test_convert_says_which_step_and_why_newer_ones_were_skipped(tmp_path: Path, to: str) -> None:
    root = tmp_path / "ckpt"
    for step in (9, 10):
        save_sharded(root, 2, 2, full_state(seed=step), PADDED_PER_TP, step=step)
    (root / step_dir_name(10) / "rank-00001.json").unlink()
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(root), str(out), "--to", to])
    assert result.exit_code == 0, result.output
    line = result.stdout.splitlines()
    assert len(line) == 1 and line[0].startswith(f"wrote {out} ({to}, ")
    assert f") from step 9; skipped newer step 10: {root / step_dir_name(10)}" in line[0]
    assert line[0].endswith("rank-00001.json: rank manifest missing")
    pinned = runner.invoke(app, ["convert", str(root), str(tmp_path / "o9"), "--step", "9"])
    assert pinned.stdout.endswith(") from step 9\n")


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "/nonexistent"],
        ["inspect", "/nonexistent"],
        ["convert", "/nonexistent", "x"],
        ["inspect", ".", "-o", "yaml"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2


def test_uncommitted_step_is_one_line_exit_2(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = saved
    result = runner.invoke(app, ["verify", str(root), "--step", "99"])
    assert result.exit_code == 2 and "no such checkpoint" in result.output


def test_convert_universal_then_load_into_tp2(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    root, full = saved
    out = tmp_path / "universal"
    result = runner.invoke(app, ["convert", str(root), str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {out} (universal, ")
    assert result.stdout.endswith(") from step 10\n")
    layout = ParallelLayout(tp=2, tp_rank=1, dp=1)
    expected, spec = rank_state(full, layout, PADDED_PER_TP)
    targets = {k: torch.zeros_like(v) for k, v in expected.items()}
    reshard(out, targets, sharding=spec)
    for name, value in targets.items():
        want = ln_mean(full, 4) if name == "model/ln.weight" else expected[name]
        assert torch.equal(value, want), name
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_safetensors_and_dcp_round_trips(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    root, full = saved
    st = tmp_path / "model.safetensors"
    assert runner.invoke(app, ["convert", str(root), str(st), "--to", "safetensors"]).exit_code == 0
    loaded = load_file(str(st))
    assert torch.equal(loaded["model/qkv.weight"], full["model/qkv.weight"])
    back = tmp_path / "from-st"
    assert (
        runner.invoke(
            app, ["import", str(st), str(back), "--from", "safetensors", "--step", "3"]
        ).exit_code
        == 0
    )
    dcp_dir = tmp_path / "dcp"
    result = runner.invoke(app, ["convert", str(back), str(dcp_dir), "--to", "dcp"])
    assert result.exit_code == 0, result.output
    again = tmp_path / "from-dcp"
    result = runner.invoke(app, ["import", str(dcp_dir), str(again), "--from", "dcp"])
    assert result.exit_code == 0, result.output
    for name, value in full.items():
        target = torch.zeros_like(value)
        reshard(again, {name: target})
        want = ln_mean(full, 4) if name == "model/ln.weight" else value
        assert torch.equal(target, want), name
    bad = runner.invoke(app, ["import", str(st), str(tmp_path / "x"), "--from", "dcp"])
    assert bad.exit_code == 2 and bad.output.startswith("error: ")


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, checkpoint.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
