"""Real gloo jobs: 4 ranks (TP=2 x DP=2, DTensor + plain shards) save; 3 ranks load."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from checkpoint import CheckpointStore
from tests.checkpoint import dist_worker


@pytest.mark.slow
def test_world_4_tp2_dp2_reshards_into_world_3(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    # forkserver: ranks fork from a server that imported torch once (spawn re-imports it,
    # seconds per rank here; plain fork can deadlock in OpenMP after earlier tests).
    multiprocessing.set_forkserver_preload(dist_worker.FORKSERVER_PRELOAD)
    mp.start_processes(
        dist_worker.save_rank,
        args=(str(root), str(tmp_path / "init-save")),
        nprocs=4,
        start_method="forkserver",
    )
    with CheckpointStore(root).open_latest() as reader:
        assert reader.manifest.world_size == 4
        reader.verify(deep=True)
    mp.start_processes(
        dist_worker.load_rank,
        args=(str(root), str(tmp_path / "init-load"), str(tmp_path)),
        nprocs=3,
        start_method="forkserver",
    )
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1", "ok-2"]
