"""The test launcher returns only when the crash's checkpoint writers are done.

A rank that crashes leaves its checkpoint writer process running on purpose: it persists
and commits the snapshot that was already whole in shared memory. ``test_resume``'s
``crashed`` root was copied while that writer was still committing step 8 on a loaded
machine, and the relaunch resumed from step 4. Here the writer is made slow on purpose
(a ``sitecustomize`` that only the fresh writer interpreter runs: the rank is forked from
the zygote and never reads it), so the race is lost every time without the wait.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint import CheckpointStore
from tests.demojob.launch import ROOT, launch
from tests.zygote import Zygote

pytestmark = pytest.mark.slow

SLOW_WRITER = """\
import os, sys, time
if "checkpoint._writer_process" in sys.orig_argv:
    import checkpoint._persist as persist
    original = persist.persist_part
    def persist_part(job, *args, **kwargs):
        time.sleep(float(os.environ["SLOW_WRITER_S"]))
        return original(job, *args, **kwargs)
    persist.persist_part = persist_part
"""


def test_launch_waits_for_the_writer_a_crashed_rank_left(
    tmp_path: Path, torch_zygote: Zygote
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_WRITER)
    root = tmp_path / "ckpt"
    crash = [{"kind": "crash", "rank": 0, "at_step": 6, "exit_code": 17}]
    run = launch(
        torch_zygote,
        1,
        tmp_path,
        log=tmp_path / "crash.jsonl",
        TG_TP=1,
        TG_STEPS=8,
        TG_CKPT_EVERY=4,  # one checkpoint (step 4), whole in memory by step 4's optimizer step
        TG_CKPT_DIR=str(root),
        TRAINGUARD_FAULTS=json.dumps(crash),
        PYTHONPATH=f"{site}:{ROOT}",
        SLOW_WRITER_S=3,  # the crash comes two fast steps after the save
    )
    assert run.codes == [17], run.explain()
    assert [r["step"] for r in run.log] == list(range(6))
    # what the crash leaves, not a snapshot of the writer's progress
    assert CheckpointStore(root).latest_pointer() == 4
