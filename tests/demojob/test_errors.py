"""The demo job refuses a bad environment (exit 2) and a checkpoint it cannot load (exit 3)
with one line that says why, and steps over a damaged newest checkpoint to an older one,
setting aside what it stepped over."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint import CheckpointStore
from demojob.config import JobConfigError, config_from_env
from tests.demojob.launch import job_env, launch, start_rank
from tests.zygote import Zygote
from trainguard.ports import free_port

GOOD = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TRAINGUARD_JOB": "demo",
    "TG_TP": "2",
    "TG_STEPS": "10",
    "TG_CKPT_DIR": "/tmp/x",
}


def test_good_environment_parses_with_documented_defaults() -> None:
    cfg = config_from_env(GOOD)
    assert (cfg.tp, cfg.dp, cfg.tp_rank, cfg.dp_rank) == (2, 2, 1, 0)
    assert (cfg.ckpt_every, cfg.global_batch, cfg.step_sleep_s, cfg.seed) == (5, 8, 0.1, 0)
    assert (cfg.generation, cfg.local_rank, cfg.log_path, cfg.resume_step) == (0, 1, None, None)
    # a downward-API mapping of a missing annotation gives an empty string: unset
    assert config_from_env({**GOOD, "TRAINGUARD_RESUME_STEP": ""}).resume_step is None
    assert config_from_env({**GOOD, "TRAINGUARD_RESUME_STEP": "40"}).resume_step == 40
    # torch's default process-group timeout unless the launcher asks for another
    assert cfg.pg_timeout_s is None
    assert config_from_env({**GOOD, "TG_PG_TIMEOUT_S": "20"}).pg_timeout_s == 20.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"TG_TP": None}, "TG_TP is not set"),
        ({"TG_TP": "3"}, "TG_TP=3 does not divide WORLD_SIZE=4"),
        ({"TG_TP": "4", "WORLD_SIZE": "8"}, None),  # fine: 4 heads split 4 ways
        ({"TG_GLOBAL_BATCH": "6", "TG_TP": "1"}, "not divisible by the data-parallel size 4"),
        ({"TG_STEPS": "ten"}, "TG_STEPS='ten' is not an integer"),
        ({"TG_STEPS": "0"}, "TG_STEPS must be >= 1, got 0"),
        ({"TG_STEP_SLEEP_S": "-1"}, "TG_STEP_SLEEP_S must be a finite number >= 0"),
        ({"RANK": "4"}, "RANK 4 is outside WORLD_SIZE 4"),
        ({"TG_CKPT_DIR": ""}, "TG_CKPT_DIR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"TRAINGUARD_RESUME_STEP": "latest"}, "TRAINGUARD_RESUME_STEP='latest' is not an int"),
        ({"TRAINGUARD_RESUME_STEP": "-1"}, "TRAINGUARD_RESUME_STEP must be >= 0, got -1"),
        ({"TG_PG_TIMEOUT_S": "0"}, "TG_PG_TIMEOUT_S must be > 0 seconds"),
        ({"TG_PG_TIMEOUT_S": "inf"}, "TG_PG_TIMEOUT_S must be a finite number >= 0"),
    ],
)
def test_bad_settings_are_named(change: dict[str, str | None], message: str | None) -> None:
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    if message is None:
        config_from_env(env)
        return
    with pytest.raises(JobConfigError, match=message):
        config_from_env(env)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "line"),
    [
        (  # DP=2 cannot split a batch of 7
            {"TG_GLOBAL_BATCH": "7"},
            "TG_GLOBAL_BATCH=7 is not divisible by the data-parallel size 2",
        ),
        ({"TRAINGUARD_RESUME_STEP": "step-8"}, "TRAINGUARD_RESUME_STEP='step-8' is not an integer"),
    ],
    ids=["batch", "resume-step"],
)
def test_bad_environment_exits_2_with_one_line(
    tmp_path: Path, torch_zygote: Zygote, change: dict[str, str], line: str
) -> None:
    env = job_env(0, 2, free_port(), tmp_path, TG_TP=1, TG_STEPS=4, **change)
    env["TG_CKPT_DIR"] = str(tmp_path / "ckpt")
    rank = start_rank(torch_zygote, env, tmp_path)
    _out, err = rank.communicate(timeout=60)
    assert rank.proc.returncode == 2
    assert err.splitlines() == [f"demojob: bad environment: {line}"]


@pytest.mark.slow
def test_ranks_with_different_resume_steps_exit_2(tmp_path: Path, torch_zygote: Zygote) -> None:
    """Ranks walking different candidate lists could resume from different checkpoints."""
    port = free_port()
    ranks = [
        start_rank(
            torch_zygote,
            job_env(
                rank,
                2,
                port,
                tmp_path,
                TG_TP=1,
                TG_STEPS=2,
                TG_CKPT_DIR=tmp_path / "ckpt",
                TRAINGUARD_RESUME_STEP=bound,
            ),
            tmp_path,
        )
        for rank, bound in enumerate(("8", ""))
    ]
    errs = [rank.communicate(timeout=60)[1] for rank in ranks]
    assert [rank.proc.returncode for rank in ranks] == [2, 2], errs
    for err in errs:
        assert err.splitlines()[-1] == (
            "demojob: bad environment: TRAINGUARD_RESUME_STEP differs between ranks (-1..8)"
        )


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_then_exit_3(tmp_path: Path, torch_zygote: Zygote) -> None:
    root, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    job = {"TG_TP": 1, "TG_CKPT_DIR": root, "TG_CKPT_EVERY": 2, "log": log}
    (root / "step-000000000003").mkdir(parents=True)  # a crash mid-save, before any commit
    (root / "step-000000000003" / "rank-00000.json").write_text("{}")
    first = launch(torch_zygote, 1, tmp_path, TG_STEPS=4, **job)
    assert first.codes == [0], first.explain()
    assert "started fresh at step 0" in first.stdout[0]
    assert "set aside checkpoint steps 3 (before a fresh start)" in first.stderr[0]
    newest, older = root / "step-000000000004", root / "step-000000000002"
    _flip_byte(newest / "rank-00000.bin", (newest / "rank-00000.bin").stat().st_size // 2)

    again = launch(torch_zygote, 1, tmp_path, TG_STEPS=5, **job)
    assert again.codes == [0], again.explain()
    assert "resumed from step 2 (tp=1 dp=1 -> tp=1 dp=1)" in again.stdout[0]
    assert "skipping checkpoint step 4: " in again.stderr[0]
    assert "CRC mismatch" in again.stderr[0]
    # the damaged step 4 is kept aside, and saved anew by the resumed run
    assert "set aside checkpoint steps 4 (newer than the resume step 2)" in again.stderr[0]
    assert CheckpointStore(root).abandoned() == [3, 4]

    for step_dir in (root / "step-000000000005", newest, older):
        _flip_byte(step_dir / "rank-00000.bin", (step_dir / "rank-00000.bin").stat().st_size // 2)
    last = launch(torch_zygote, 1, tmp_path, TG_STEPS=6, **job)
    assert last.codes == [3], last.explain()
    final = last.stderr[0].splitlines()[-1]
    assert final.startswith(f"demojob: rank 0: cannot resume from {root}: ")
    assert "CRC mismatch" in final
