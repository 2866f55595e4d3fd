"""Retention reports what it deletes: a ``deleted`` checkpoint event per removed step.

The controller rolls a job back after NaN/Inf to the newest checkpoint committed before the
bad step, from the ranks' checkpoint events. Retention (``keep_last``) used to delete
committed steps silently: the controller sent a rollback to a step that was gone, and every
rank of the restarted job exited ("no committed checkpoint at or before
TRAINGUARD_RESUME_STEP"). Pinned here with real saves: rank 0 of a shared root reports each
step its commit's retention removed (after that commit's ``committed``), the object-store
tier each step its bucket retention removed (``tier=object_store``), and nothing is
reported for a step that is still there.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint._commit import committed_steps
from checkpoint._tier import make_client
from checkpoint._tier_bucket import remote_steps
from checkpoint.config import ObjectStoreConfig
from checkpoint.manifest import step_dir_name
from tests.checkpoint.s3_server import s3_endpoint
from trainguard.wire import CheckpointEvent


def _kinds(events: list[CheckpointEvent], tier: str = "local") -> list[tuple[str, int]]:
    """(kind, step) of the ``committed`` and ``deleted`` events of ``tier``, in order."""
    return [
        (e.kind, e.step) for e in events if e.tier == tier and e.kind in ("committed", "deleted")
    ]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_rank0_reports_each_step_retention_deleted_after_the_commit_that_deleted_it(
    tmp_path: Path, writer: str
) -> None:
    """keep_last=2, saves at 10, 20, 30, 40: the commit of 30 deletes 10 and the commit of
    40 deletes 20, each reported as ``deleted`` right after that commit, as a valid wire
    event naming the job, rank 0 and the step's directory. 30 and 40 are kept: no event."""
    events: list[CheckpointEvent] = []
    cfg = CheckpointConfig(root=tmp_path, writer=writer, keep_last=2)  # type: ignore[arg-type]
    with Checkpointer(cfg, event_sink=events.append, job="gpt") as engine:
        for step in (10, 20, 30, 40):
            engine.save({"w": torch.full((64,), float(step))}, step=step)
            engine.wait()
    assert committed_steps(tmp_path) == [30, 40]
    assert _kinds(events) == [
        ("committed", 10),
        ("committed", 20),
        ("committed", 30),
        ("deleted", 10),
        ("committed", 40),
        ("deleted", 20),
    ]
    for event in events:
        if event.kind == "deleted":
            sent = CheckpointEvent.model_validate(event.model_dump())  # as on the wire
            assert (sent.job, sent.rank, sent.tier) == ("gpt", 0, "local")
            assert sent.path == str(tmp_path / step_dir_name(sent.step))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local S3-compatible server (moto), with the test's credentials."""
    with s3_endpoint(tmp_path_factory.mktemp("s3"), "tg-retention-secret") as url:
        yield url


@pytest.mark.slow
def test_bucket_retention_reports_the_steps_it_deleted_as_object_store_events(
    tmp_path: Path, endpoint: str
) -> None:
    """Node-local roots commit in the bucket (``committed``, ``tier=object_store``): the
    bucket's retention (keep 1) deleting the older step is reported on that tier too, so
    the controller stops counting the bucket's copy as one to roll back to."""
    store = ObjectStoreConfig(
        bucket=f"ret-{uuid.uuid4().hex[:12]}",
        endpoint_url=endpoint,
        region="us-east-1",
        keep_last=1,
    )
    make_client(store).create_bucket(Bucket=store.bucket)
    events: list[CheckpointEvent] = []
    cfg = CheckpointConfig(
        root=tmp_path / "local", writer="thread", object_store=store, shared_root=False
    )
    with Checkpointer(cfg, event_sink=events.append, job="gpt") as engine:
        for step in (1, 2):
            engine.save({"w": torch.full((256,), float(step))}, step=step)
            engine.wait()
            assert engine.uploader is not None and engine.uploader.wait(timeout=60)
    assert remote_steps(make_client(store), store) == [2]
    assert _kinds(events, "object_store") == [
        ("committed", 1),
        ("committed", 2),
        ("deleted", 1),
    ]
