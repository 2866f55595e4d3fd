"""Every rank's files reach the object store (issue 19): a 2-rank gloo job saves with the
object-store tier against moto's S3 server; each rank uploads its own shard, rank 0's
``MANIFEST.json`` and ``TIER.json`` go last, and a restore from the bucket alone is
complete for both ranks, bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint
from checkpoint._tier import RANK_RECORD, make_client
from checkpoint._tier_bucket import TIER_RECORD, remote_steps
from checkpoint.config import ObjectStoreConfig
from checkpoint.manifest import MANIFEST_NAME, rank_data_name, rank_manifest_name, step_dir_name
from tests.checkpoint.s3_server import s3_endpoint
from tests.checkpoint.tier_rank_worker import shard

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with s3_endpoint(tmp_path_factory.mktemp("s3"), "tg-ranks-secret") as url:
        yield url


def _run_ranks(
    zygote: Any, tmp_path: Path, fields: dict[str, object], roots: list[Path], *extra: str
) -> dict[int, dict[str, Any]]:
    """Run ``tier_rank_worker`` as ``len(roots)`` gloo ranks, rank r on ``roots[r]``, each
    forked from the torch zygote; each rank's last stdout line, by rank."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    init = f"file://{tmp_path / 'rendezvous'}"
    world = str(len(roots))
    ranks = []
    for r, root in enumerate(roots):
        out, err = tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err"
        argv = ["-m", "tests.checkpoint.tier_rank_worker", str(r), world, init, str(root)]
        proc = zygote.spawn(
            [*argv, json.dumps(fields), *extra], env=env, stdout=out, stderr=err, cwd=REPO
        )
        ranks.append((proc, out, err))
    reports = {}
    for proc, out, err in ranks:
        assert proc.wait(timeout=240) == 0, err.read_text()[-3000:]
        line = json.loads(out.read_text().strip().splitlines()[-1])
        reports[line["rank"]] = line
    return reports


def test_every_rank_uploads_its_files_and_the_commit_goes_last(
    tmp_path: Path, endpoint: str, torch_zygote: Any
) -> None:
    fields = {
        "bucket": f"ranks-{uuid.uuid4().hex[:12]}",
        "prefix": "jobs/ranks",
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "part_bytes": 256 << 10,  # the 1.2 MB shards go up as multipart uploads
        "keep_last": 2,
        "peer_timeout_s": 60.0,
    }
    store = ObjectStoreConfig(**fields)  # type: ignore[arg-type]
    client = make_client(store)
    client.create_bucket(Bucket=store.bucket)
    root = tmp_path / "shared"
    reports = _run_ranks(torch_zygote, tmp_path, fields, [root, root])

    assert remote_steps(client, store) == [1, 2]
    for step in (1, 2):
        prefix = f"{store.prefix}/{step_dir_name(step)}/"
        rank0 = [k for k in reports[0]["keys"] if k.startswith(prefix)]
        rank1 = [k for k in reports[1]["keys"] if k.startswith(prefix)]
        # Each rank sent its own shard and manifest, nothing of the other's.
        assert sorted(rank1) == sorted(
            prefix + n for n in (rank_data_name(1), rank_manifest_name(1), RANK_RECORD.format(1))
        )
        assert {prefix + rank_data_name(0), prefix + rank_manifest_name(0)} <= set(rank0)
        assert not any("rank-00001" in k for k in rank0)
        # Rank 0 commits last: MANIFEST.json, then TIER.json, after its own files.
        assert rank0[-2:] == [prefix + MANIFEST_NAME, prefix + TIER_RECORD]
        record = json.loads(
            client.get_object(Bucket=store.bucket, Key=prefix + TIER_RECORD)["Body"].read()
        )
        assert set(record["files"]) == {
            MANIFEST_NAME,
            rank_data_name(0),
            rank_manifest_name(0),
            rank_data_name(1),
            rank_manifest_name(1),
        }

    # The local copies are gone: a restore from the bucket alone is complete for each rank.
    shutil.rmtree(root)
    fresh = tmp_path / "fresh"
    for r in range(2):
        restored = checkpoint.load(fresh, {"shard": None}, rank=r, object_store=store)
        assert restored.step == 2
        assert restored.source == ("object_store" if r == 0 else "local")  # r=1: r=0 fetched
        assert torch.equal(restored.values["shard"], shard(r, 2))


def test_upload_state_reaches_the_checkpoint_events(tmp_path: Path, endpoint: str) -> None:
    """Issue 19: the controller learns each step's object-store state from the same
    ``CheckpointEvent`` stream as the local tier's (queued, sending, in the bucket with the
    time since ``save``, or failed with the reason)."""
    from checkpoint import CheckpointConfig, Checkpointer
    from trainguard.wire import CheckpointEvent

    good = ObjectStoreConfig(
        bucket=f"events-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, region="us-east-1"
    )
    make_client(good).create_bucket(Bucket=good.bucket)
    missing = ObjectStoreConfig(
        bucket=f"missing-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, region="us-east-1"
    )
    for store, final in ((good, "uploaded"), (missing, "upload_failed")):
        events: list[CheckpointEvent] = []
        cfg = CheckpointConfig(root=tmp_path / store.bucket, writer="thread", object_store=store)
        with Checkpointer(cfg, event_sink=events.append) as engine:
            engine.save({"x": torch.arange(1000.0)}, step=3)
        remote = [e for e in events if e.tier == "object_store"]
        assert [e.kind for e in remote] == ["upload_pending", "uploading", final]
        assert all(e.step == 3 for e in remote)
        assert all(e.tier == "local" for e in events if e not in remote)
        last = CheckpointEvent.model_validate(remote[-1].model_dump())  # as sent on the wire
        durable = next(e for e in events if e.kind == "durable")
        if final == "uploaded":
            assert last.duration_s is not None and durable.duration_s is not None
            assert last.duration_s >= durable.duration_s and not last.error
        else:
            assert "NoSuchBucket" in last.error and last.duration_s is None


def test_node_local_roots_commit_in_the_bucket_and_restore_where_nothing_is_local(
    tmp_path: Path, endpoint: str, torch_zygote: Any
) -> None:
    """Multi-node with node-local disks (``shared_root=False``): rank 0 alone on node A,
    ranks 1 and 2 sharing node B's root. No root sees every part, so nothing commits
    locally; each rank uploads its own files, and rank 0 commits in the bucket once every
    part is there (``MANIFEST.json``, built from the ranks' manifests in the bucket, then
    ``TIER.json``). With node A's disk gone, rank 0 restores from the bucket alone; on node
    B, rank 1 restores fetching only what the node lacks (its own part is reused, not
    downloaded again), and rank 2 then loads that copy locally."""
    fields = {
        "bucket": f"nodes-{uuid.uuid4().hex[:12]}",
        "prefix": "jobs/nodes",
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "part_bytes": 256 << 10,
        "keep_last": 2,
        "peer_timeout_s": 60.0,
    }
    store = ObjectStoreConfig(**fields)  # type: ignore[arg-type]
    client = make_client(store)
    client.create_bucket(Bucket=store.bucket)
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    reports = _run_ranks(torch_zygote, tmp_path, fields, [node_a, node_b, node_b], "node-local")

    assert remote_steps(client, store) == [1, 2]
    last = step_dir_name(2)
    # No local commit anywhere; local retention (keep_last=1) pruned each rank's step 1.
    for node, ranks in ((node_a, [0]), (node_b, [1, 2])):
        assert not list(node.glob("step-*/MANIFEST.json"))
        assert sorted(p.name for p in node.glob("step-*")) == [last]
        names = {p.name for p in (node / last).iterdir()}
        assert names == {f(r) for r in ranks for f in (rank_data_name, rank_manifest_name)}
    for step in (1, 2):
        prefix = f"{store.prefix}/{step_dir_name(step)}/"
        for r in (1, 2):
            sent = [k for k in reports[r]["keys"] if k.startswith(prefix)]
            assert sorted(sent) == sorted(
                prefix + n
                for n in (rank_data_name(r), rank_manifest_name(r), RANK_RECORD.format(r))
            )
        rank0 = [k for k in reports[0]["keys"] if k.startswith(prefix)]
        assert not any("rank-00001" in k or "rank-00002" in k for k in rank0)
        assert rank0[-2:] == [prefix + MANIFEST_NAME, prefix + TIER_RECORD]
        manifest = json.loads(
            client.get_object(Bucket=store.bucket, Key=prefix + MANIFEST_NAME)["Body"].read()
        )
        assert [r["rank"] for r in manifest["ranks"]] == [0, 1, 2]
        for r in range(3):
            body = client.get_object(Bucket=store.bucket, Key=prefix + rank_manifest_name(r))
            digest = hashlib.sha256(body["Body"].read()).hexdigest()
            assert manifest["ranks"][r]["manifest_sha256"] == digest
    # Rank 0's commit is the bucket's, and says so; the other ranks never commit.
    commits = {r: [e for e in reports[r]["events"] if e[1] == "committed"] for r in range(3)}
    assert commits == {0: [[1, "committed", "object_store"], [2, "committed", "object_store"]],
                       1: [], 2: []}  # fmt: skip

    shutil.rmtree(node_a)  # node A's disk is lost (or the rank moved to a fresh node)
    restored = checkpoint.load(node_a, {"shard": None}, rank=0, object_store=store)
    assert (restored.step, restored.source) == (2, "object_store")
    assert torch.equal(restored.values["shard"], shard(0, 2))
    own = (node_b / last / rank_data_name(1)).stat().st_ino
    restored = checkpoint.load(node_b, {"shard": None}, rank=1, object_store=store)
    assert (restored.step, restored.source) == (2, "object_store")
    assert torch.equal(restored.values["shard"], shard(1, 2))
    assert (node_b / last / rank_data_name(1)).stat().st_ino == own  # linked, not fetched
    assert (node_b / last / rank_data_name(0)).stat().st_ino != own
    restored = checkpoint.load(node_b, {"shard": None}, rank=2, object_store=store)
    assert (restored.step, restored.source) == (2, "local")
    assert torch.equal(restored.values["shard"], shard(2, 2))


def test_node_local_roots_need_the_object_store() -> None:
    from checkpoint import CheckpointConfig
    from checkpoint.errors import CheckpointConfigError

    with pytest.raises(CheckpointConfigError, match=r"shared_root=False .* needs object_store"):
        CheckpointConfig(root="/tmp/x", shared_root=False).validate()


def test_node_local_root_with_the_writer_process(tmp_path: Path, endpoint: str) -> None:
    """The default writer (a separate process) on a node-local root: its part is durable
    and pruned locally, never committed there; the commit is the bucket's (``committed``,
    ``tier=object_store``, after ``uploading`` and before ``uploaded``), and a fresh root
    restores from it."""
    from checkpoint import CheckpointConfig, Checkpointer
    from trainguard.wire import CheckpointEvent

    store = ObjectStoreConfig(
        bucket=f"proc-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, region="us-east-1"
    )
    make_client(store).create_bucket(Bucket=store.bucket)
    events: list[CheckpointEvent] = []
    root = tmp_path / "node"
    cfg = CheckpointConfig(root=root, object_store=store, shared_root=False, keep_last=1)
    with Checkpointer(cfg, event_sink=events.append) as engine:
        for step in (1, 2):
            engine.save({"shard": shard(0, step)}, step=step)
            engine.wait()
    assert not list(root.glob("step-*/MANIFEST.json"))
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir_name(2)]
    seen = [(e.kind, e.tier) for e in events if e.step == 2]
    assert seen[-4:] == [
        ("upload_pending", "object_store"),
        ("uploading", "object_store"),
        ("committed", "object_store"),
        ("uploaded", "object_store"),
    ]
    assert ("committed", "local") not in seen
    restored = checkpoint.load(tmp_path / "fresh", {"shard": None}, object_store=store)
    assert (restored.step, restored.source) == (2, "object_store")
    assert torch.equal(restored.values["shard"], shard(0, 2))
