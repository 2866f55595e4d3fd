"""The demo job resumes where a crash left it: bit for bit in the same layout, and on fewer
ranks from the resharded universal checkpoint.

Scenario (real gloo ranks, checkpoints every 4 steps, 12 steps in all):

* ``baseline``: TP=2 x DP=2 runs steps 0..11 uninterrupted.
* ``crashed``: the same job, but every rank dies at the start of step 10 (a ``crash``
  fault from ``TRAINGUARD_FAULTS``, as a chaos drill would inject): the newest complete
  checkpoint is step 8 (on a loaded machine committed only after the crash, by the writer
  processes the ranks leave behind: ``launch`` waits for them), and steps 8 and 9 are lost
  work.
* a relaunch then resumes from step 8, either as the same 4 ranks or as TP=2 x DP=1.
* ``rollback``: the finished baseline relaunched with TRAINGUARD_RESUME_STEP=8 (what the
  controller's NaN rollback sets) goes back to step 8 and sets step 12 aside.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointStore
from demojob.data import global_batch
from demojob.model import build_model
from demojob.parallel import Groups
from demojob.resume import committed_steps
from tests.demojob.launch import Run, launch
from tests.zygote import Zygote

pytestmark = pytest.mark.slow

STEPS, EVERY, CRASH_AT, RESUME_AT = 12, 4, 10, 8
CRASH_ALL = json.dumps(
    [{"kind": "crash", "rank": [0, 1, 2, 3], "at_step": CRASH_AT, "exit_code": 17}]
)


def _job(tmp: Path, name: str) -> dict[str, Any]:
    return {"log": tmp / f"{name}.jsonl", "TG_CKPT_EVERY": EVERY, "TG_STEPS": STEPS}


def _losses(run: Run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.log}


# Every directory is made new by the fixture or test that writes it: a failed test runs once
# more (pytest-rerunfailures) on the module's fixtures, and a fixture that failed runs again.


@pytest.fixture(scope="module")
def baseline_run(
    tmp_path_factory: pytest.TempPathFactory, torch_zygote: Zygote
) -> tuple[Path, dict[int, float]]:
    """The uninterrupted run: its checkpoint root and its losses by step."""
    tmp = tmp_path_factory.mktemp("baseline")
    root = tmp / "ckpt-baseline"
    run = launch(torch_zygote, 4, tmp, TG_TP=2, TG_CKPT_DIR=root, **_job(tmp, "baseline"))
    assert run.codes == [0] * 4, run.explain()
    assert "started fresh at step 0 (tp=2 dp=2)" in run.stdout[0]
    assert [r["step"] for r in run.log] == list(range(STEPS))
    return root, _losses(run)


@pytest.fixture(scope="module")
def baseline(baseline_run: tuple[Path, dict[int, float]]) -> dict[int, float]:
    return baseline_run[1]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, torch_zygote: Zygote) -> Path:
    """The checkpoint root the crashed run left (kept pristine; tests copy it)."""
    tmp = tmp_path_factory.mktemp("crashed")
    root = tmp / "ckpt-crashed"
    run = launch(
        torch_zygote,
        4,
        tmp,
        TG_TP=2,
        TG_CKPT_DIR=root,
        TRAINGUARD_FAULTS=CRASH_ALL,
        **_job(tmp, "crashed"),
    )
    assert run.codes == [17] * 4, run.explain()
    assert [r["step"] for r in run.log] == list(range(CRASH_AT))
    # step 8 is committed by the writer processes the crash left (launch waits for them)
    assert CheckpointStore(root).latest_pointer() == RESUME_AT
    return root


def _relaunch(zygote: Zygote, tmp: Path, crashed: Path, name: str, world: int) -> Run:
    """Relaunch from a copy of ``crashed`` in ``tmp`` (the test's own ``tmp_path``)."""
    root = tmp / f"ckpt-{name}"
    shutil.copytree(crashed, root)
    job = _job(tmp, name)
    return launch(zygote, world, tmp, TG_TP=2, TG_CKPT_DIR=root, TRAINGUARD_GENERATION=1, **job)


def test_resumed_run_continues_bit_for_bit(
    tmp_path: Path, baseline: dict[int, float], crashed: Path, torch_zygote: Zygote
) -> None:
    run = _relaunch(torch_zygote, tmp_path, crashed, "same-layout", 4)
    assert run.codes == [0] * 4, run.explain()
    assert "generation 1 resumed from step 8 (tp=2 dp=2 -> tp=2 dp=2)" in run.stdout[0]
    assert [r["step"] for r in run.log] == list(range(RESUME_AT, STEPS))
    assert run.log[0]["resumed_from"] == RESUME_AT
    assert all("resumed_from" not in r for r in run.log[1:])
    assert {r["generation"] for r in run.log} == {1}
    assert _losses(run) == {s: baseline[s] for s in range(RESUME_AT, STEPS)}


def _fresh_loss(step: int) -> float:
    """The loss a fresh model (TP=1, no communication) has on the global batch of ``step``."""
    model = build_model(Groups(tp=None, dp=None, tp_size=1, dp_size=1), 0, seed=0)
    with torch.no_grad():
        return float(model(global_batch(0, step, 8)))


def test_shrunk_run_resumes_from_resharded_checkpoint(
    tmp_path: Path, baseline: dict[int, float], crashed: Path, torch_zygote: Zygote
) -> None:
    run = _relaunch(torch_zygote, tmp_path, crashed, "shrunk", 2)
    assert run.codes == [0] * 2, run.explain()
    assert "generation 1 resumed from step 8 (tp=2 dp=2 -> tp=2 dp=1)" in run.stdout[0]
    assert [(r["step"], r["world_size"], r["dp"]) for r in run.log] == [
        (s, 2, 1) for s in range(RESUME_AT, STEPS)
    ]
    # Same weights, moments and samples; only the order of the float32 sums changes (one
    # mean over 8 sequences instead of a mean of two means over 4, gradients likewise).
    # Measured: differences of 0 to 2.4e-7 (1 ulp at loss ~3). 1e-4 leaves room for that
    # rounding to grow through Adam for 4 steps, and is 3-4 orders of magnitude below
    # the progress the run would lose by starting over (checked below).
    resumed = _losses(run)
    for step, loss in resumed.items():
        assert loss == pytest.approx(baseline[step], abs=1e-4), step
    fresh = _fresh_loss(RESUME_AT)
    assert fresh - resumed[RESUME_AT] > 0.5, (fresh, resumed[RESUME_AT])
    # its own checkpoints now have the new layout, so the next restart needs no resharding
    meta = json.loads(
        (tmp_path / "ckpt-shrunk" / "step-000000000012" / "MANIFEST.json").read_text()
    )
    assert (meta["world_size"], meta["layout"]) == (2, {"tp": 2, "dp": 1})


def test_rollback_resumes_at_the_bound_and_sets_newer_steps_aside(
    tmp_path: Path, baseline_run: tuple[Path, dict[int, float]], torch_zygote: Zygote
) -> None:
    baseline_root, baseline = baseline_run
    root = tmp_path / "ckpt-rollback"
    shutil.copytree(baseline_root, root)
    assert CheckpointStore(root).latest_pointer() == STEPS
    job = {**_job(tmp_path, "rollback"), "TG_TP": 2, "TG_CKPT_DIR": root}
    # two ranks, not four: half the start-up time on a small machine, at the price of a
    # resharded resume (losses close to the baseline's, not equal)
    run = launch(
        torch_zygote, 2, tmp_path, TRAINGUARD_GENERATION=1, TRAINGUARD_RESUME_STEP=RESUME_AT, **job
    )
    assert run.codes == [0] * 2, run.explain()
    assert (
        "generation 1 resumed from step 8 (tp=2 dp=2 -> tp=2 dp=1), TRAINGUARD_RESUME_STEP=8"
        in run.stdout[0]
    )
    assert (
        f"demojob: rank 0: set aside checkpoint steps 12 (newer than the resume step 8) "
        f"in {root / 'abandoned'}" in run.stderr[0].splitlines()
    )
    assert [r["step"] for r in run.log] == list(range(RESUME_AT, STEPS))
    assert run.log[0]["resumed_from"] == RESUME_AT
    for step, loss in _losses(run).items():  # the rolled-back timeline, not a fresh model
        assert loss == pytest.approx(baseline[step], abs=1e-4), step

    store = CheckpointStore(root)
    assert store.abandoned() == [STEPS]
    assert [(i.step, i.complete) for i in store.list()] == [(4, True), (8, True), (12, True)]
    with store.open_latest() as reader:
        assert reader.step == STEPS
        reader.verify(deep=True)
        old = json.loads((store.abandoned_root / reader.path.name / "MANIFEST.json").read_text())
        assert reader.manifest.created_unix_s > old["created_unix_s"]  # saved anew
    # the bound is an upper limit: a step between checkpoints takes the one before it
    assert committed_steps(root, at_most=11) == [8, 4]
    assert committed_steps(root, at_most=12) == [12, 8, 4]

    # a rollback point before every committed checkpoint: refuse, touch nothing
    short = {**job, "TG_TP": 1, "log": tmp_path / "rollback-too-far.jsonl"}
    refused = launch(
        torch_zygote, 1, tmp_path, TRAINGUARD_GENERATION=2, TRAINGUARD_RESUME_STEP=3, **short
    )
    assert refused.codes == [3], refused.explain()
    assert refused.stderr[0].splitlines()[-1] == (
        f"demojob: rank 0: cannot resume from {root}: no committed checkpoint at or before "
        "TRAINGUARD_RESUME_STEP=3 (committed: 4, 8, 12)"
    )
    assert (store.abandoned(), [i.step for i in store.list()]) == ([STEPS], [4, 8, 12])
