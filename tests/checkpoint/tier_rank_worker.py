"""One rank of a gloo job saving with the object-store tier (run by
``test_tier_ranks.py``): every rank uploads its own files; prints what it uploaded and the
checkpoint events it reported. ``root`` is this rank's root; a sixth argument
``node-local`` says the ranks' roots are not shared (``shared_root=False``)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint.config import ObjectStoreConfig
from trainguard.wire import CheckpointEvent


def shard(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tensor at ``step`` (the test rebuilds it to compare)."""
    return torch.randn(300, 1024, generator=torch.Generator().manual_seed(100 * rank + step))


def main() -> None:
    rank, world, init, root, store_json = sys.argv[1:6]
    node_local = sys.argv[6:] == ["node-local"]
    r, w = int(rank), int(world)
    dist.init_process_group(
        "gloo", init_method=init, rank=r, world_size=w, timeout=timedelta(seconds=120)
    )
    store = ObjectStoreConfig(**json.loads(store_json))
    cfg = CheckpointConfig(
        root=Path(root),
        writer="thread",
        object_store=store,
        keep_last=1,
        shared_root=not node_local,
    )
    events: list[CheckpointEvent] = []
    engine = Checkpointer(cfg, rank=r, world_size=w, job="tier-ranks", event_sink=events.append)
    for step in (1, 2):
        engine.save({"shard": shard(r, step)}, step=step)
        engine.wait()
        dist.barrier()
    engine.close()  # waits for this rank's uploads
    assert engine.uploader is not None
    stats = engine.uploader.stats
    seen = [(e.step, e.kind, e.tier) for e in events]
    print(
        json.dumps({"rank": r, "keys": stats.keys, "steps": stats.steps_uploaded, "events": seen})
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
