"""The object-storage tier honours a fence per bucket prefix: a zombie of the previous start
(its node lost the network, an old pod not yet killed) keeps its upload thread; once the
new start has claimed the bucket, the zombie's late upload, its retention and its resumed
leftovers stop before they replace or delete anything, instead of putting its step over
the new start's after a rollback or deleting the new start's remote steps. Against moto's
real S3 server (``make s3-server``), as the other tier tests."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer
from checkpoint._commit import committed_steps
from checkpoint._load import load_state
from checkpoint._tier import TierUploader, make_client, read_tier_state
from checkpoint._tier_bucket import remote_steps
from checkpoint._tier_restore import load_nearest, tier_rows
from checkpoint.config import ObjectStoreConfig
from checkpoint.manifest import rank_data_name, rank_manifest_name, step_dir_name
from tests.checkpoint.s3_server import s3_endpoint

pytestmark = pytest.mark.slow  # a server process; a few seconds a test

PART = 64 << 10
OLD, NEW = "run-old", "run-new"  # a caller's own ids: not ordered, the claim decides


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with s3_endpoint(tmp_path_factory.mktemp("s3"), "tg-fence-secret") as url:
        yield url


@pytest.fixture
def store(endpoint: str) -> ObjectStoreConfig:
    cfg = ObjectStoreConfig(
        bucket=f"fence-{uuid.uuid4().hex[:12]}",
        prefix="jobs/fence",
        endpoint_url=endpoint,
        region="us-east-1",
        part_bytes=PART,
        max_concurrency=2,
        keep_last=2,
    )
    make_client(cfg).create_bucket(Bucket=cfg.bucket)
    return cfg


def _weights(seed: int | None) -> torch.nn.ParameterDict:
    """128 KiB: a multipart upload of 3 parts; loaded in place."""
    g = torch.Generator().manual_seed(seed or 0)
    w = torch.randn(32, 1024, generator=g) if seed is not None else torch.zeros(32, 1024)
    return torch.nn.ParameterDict({"w": torch.nn.Parameter(w)})


def _state(seed: int) -> dict[str, Any]:
    return {"model": _weights(seed)}


def _blank() -> dict[str, Any]:
    return {"model": _weights(None)}


def _w(state: dict[str, Any]) -> torch.Tensor:
    w: torch.Tensor = state["model"]["w"].detach()
    return w


def _ckpt(root: Path, store: ObjectStoreConfig | None, run_id: str, **kw: Any) -> Checkpointer:
    return Checkpointer(
        CheckpointConfig(root=root, writer="thread", object_store=store), run_id=run_id, **kw
    )


def _save(ckpt: Checkpointer, seed: int, step: int, *, upload: bool = True) -> None:
    assert ckpt.save(_state(seed), step=step)
    ckpt.wait()
    if upload:
        assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)


def _remote_seed(store: ObjectStoreConfig, tmp: Path, step: int) -> torch.Tensor:
    """The tensor the bucket's copy of ``step`` restores (into a fresh root)."""
    target = _blank()
    root = tmp / f"restore-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    _, choice = load_nearest(
        root, store, lambda s: load_state(root, target, step=s, restore_rng=False), step=step
    )
    assert choice.source == "object_store"
    return _w(target)


def _fence(store: ObjectStoreConfig) -> str:
    client = make_client(store)
    try:
        body = client.get_object(Bucket=store.bucket, Key=f"{store.prefix}/FENCE")["Body"]
    except client.exceptions.NoSuchKey:
        return ""
    return str(body.read().decode().strip())


def _on_call(ckpt: Checkpointer, event: str, hook: Callable[..., None]) -> None:
    assert ckpt.uploader is not None
    ckpt.uploader.client.meta.events.register(event, hook)


def _refusals(caplog: pytest.LogCaptureFixture, step: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name.startswith("checkpoint") and r.levelno >= logging.WARNING
        if f"step {step}" in r.getMessage()
    ]


def test_a_zombies_late_upload_does_not_replace_the_new_starts_step_after_a_rollback(
    tmp_path: Path, store: ObjectStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The old start uploads step 3, then commits step 5 locally while its link is down.
    The new start restores step 3 from the bucket, re-does step 5 with other data and
    uploads it. The zombie's link comes back: before, its step 5 replaced the new one."""
    caplog.set_level(logging.WARNING)
    events: list[Any] = []
    link_open, stalled = threading.Event(), threading.Event()

    def held(**_: Any) -> None:
        stalled.set()
        assert link_open.wait(timeout=60)

    old_root, new_root = tmp_path / "old", tmp_path / "new"
    zombie = _ckpt(old_root, store, OLD, event_sink=events.append)
    try:
        _save(zombie, 3, step=3)
        _on_call(zombie, "before-call.s3.UploadPart", held)
        _save(zombie, 5, step=5, upload=False)
        assert stalled.wait(timeout=30)  # its step 5 is on the wire, parts held

        with _ckpt(new_root, store, NEW) as new:
            target = _blank()
            restored = new.load(target)
            assert (restored.step, restored.source) == (3, "object_store")
            _save(new, 50, step=5)
        link_open.set()
    finally:
        link_open.set()
        zombie.close()

    assert remote_steps(make_client(store), store) == [3, 5]
    assert torch.equal(_remote_seed(store, tmp_path, 5), _w(_state(50)))  # the new start's
    assert _fence(store) == NEW
    # The zombie: refused, said so once, its local checkpoint untouched.
    assert zombie.uploader is not None and zombie.uploader.stats.superseded == [5]
    assert zombie.uploader.stats.errors == []
    (record,) = _refusals(caplog, 5)
    assert record.levelno == logging.WARNING
    assert OLD in record.getMessage() and NEW in record.getMessage()
    assert read_tier_state(old_root)[5]["state"] == "superseded"
    assert tier_rows(old_root)[5] == "superseded"
    failed = [e for e in events if e.step == 5 and e.tier == "object_store"][-1]
    assert failed.kind == "upload_failed" and failed.error.startswith("superseded: ")
    assert committed_steps(old_root) == [3, 5]
    local = _blank()
    load_state(old_root, local, step=5, restore_rng=False)
    assert torch.equal(_w(local), _w(_state(5)))


def test_a_zombies_retention_does_not_delete_the_new_starts_remote_steps(
    tmp_path: Path, store: ObjectStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """The zombie commits its step 6 in the bucket just before the new start claims it;
    the new start uploads steps 3 and 4. The zombie's retention (keep 2) then ran: before,
    it deleted the new start's step 3 (complete steps <= 6: 3, 4, 6)."""
    caplog.set_level(logging.WARNING)
    committed6, resume = threading.Event(), threading.Event()
    last_put: list[str] = []

    def put(params: dict[str, Any], **_: Any) -> None:
        last_put.append(str(params.get("Key", "")))

    def listing(**_: Any) -> None:  # retention lists the bucket first
        if last_put and last_put[-1].endswith(f"{step_dir_name(6)}/TIER.json"):
            last_put.clear()
            committed6.set()
            assert resume.wait(timeout=60)

    zombie = _ckpt(tmp_path / "old", store, OLD)
    try:
        _save(zombie, 2, step=2)
        _on_call(zombie, "provide-client-params.s3.PutObject", put)
        _on_call(zombie, "before-call.s3.ListObjectsV2", listing)
        _save(zombie, 6, step=6, upload=False)
        assert committed6.wait(timeout=30)
        with _ckpt(tmp_path / "new", store, NEW) as new:
            _save(new, 30, step=3)
            _save(new, 40, step=4)
        resume.set()
    finally:
        resume.set()
        zombie.close()

    assert remote_steps(make_client(store), store) == [3, 4, 6]
    assert torch.equal(_remote_seed(store, tmp_path, 3), _w(_state(30)))
    assert zombie.uploader is not None and zombie.uploader.stats.steps_uploaded == [2, 6]
    (record,) = _refusals(caplog, 3)
    assert "retention" in record.getMessage() and NEW in record.getMessage()


def test_a_zombies_resumed_leftover_does_not_replace_the_new_starts_step(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    """The zombie's upload of step 5 fails half way (staging and journal stay); the new
    start uploads its own step 5; then an uploader on the zombie's root (its process made a
    new Checkpointer) resumes the leftover: before, it completed over the new step 5."""
    old_root = tmp_path / "old"
    with _ckpt(old_root, store, OLD) as zombie:
        _save(zombie, 3, step=3)

        def link_down(**_: Any) -> None:
            raise ConnectionError("injected: link down")

        _on_call(zombie, "before-call.s3.UploadPart", link_down)
        _save(zombie, 5, step=5)
        assert zombie.uploader is not None and zombie.uploader.stats.errors
    assert read_tier_state(old_root)[5]["state"] == "failed"

    with _ckpt(tmp_path / "new", store, NEW) as new:
        _save(new, 50, step=5)

    leftover = TierUploader(old_root, store)
    assert leftover.wait(timeout=30)
    leftover.close()
    assert torch.equal(_remote_seed(store, tmp_path, 5), _w(_state(50)))
    assert leftover.stats.superseded == [5] and leftover.stats.steps_uploaded == []
    assert read_tier_state(old_root)[5]["state"] == "superseded"


def test_derived_run_ids_are_ordered_a_later_start_is_never_claimed_back(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    """Generation 1's first upload comes after generation 2 claimed the bucket: it does not
    claim it back (a later start's fence stops it); generation 3 replaces generation 2's."""
    gen1, gen2, gen3 = (f"trainguard-gen{n}" for n in (1, 2, 3))
    with _ckpt(tmp_path / "b", store, gen2) as new:
        _save(new, 40, step=4)
    with _ckpt(tmp_path / "a", store, gen1) as zombie:
        _save(zombie, 4, step=4)
    assert torch.equal(_remote_seed(store, tmp_path, 4), _w(_state(40)))
    assert zombie.uploader is not None and zombie.uploader.stats.superseded == [4]
    assert _fence(store) == gen2
    with _ckpt(tmp_path / "c", store, gen3) as newer:
        _save(newer, 5, step=5)
        assert newer.uploader is not None and newer.uploader.stats.steps_uploaded == [5]
    assert _fence(store) == gen3


def _rank1_part(root: Path, step: int, run_id: str) -> None:
    """Rank 1's two files of ``step`` as its writer leaves them (the uploader reads only
    the run id from the manifest)."""
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True)
    (step_dir / rank_data_name(1)).write_bytes(b"\x01" * 10_000)
    (step_dir / rank_manifest_name(1)).write_text(f'{{"run_id": "{run_id}", "rank": 1}}')


def test_every_rank_honours_the_fence_and_waits_for_rank_0s_claim(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    """Rank 1 of generation 2, fence still generation 1's: it sends nothing until rank 0
    has claimed the bucket. Rank 1 of a zombie generation 1 then sends nothing at all."""
    gen1, gen2 = "trainguard-gen1", "trainguard-gen2"
    client = make_client(store)
    fence_key = f"{store.prefix}/FENCE"
    client.put_object(Bucket=store.bucket, Key=fence_key, Body=f"{gen1}\n".encode())
    calls: list[str] = []
    fence_read = threading.Event()

    def seen(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append(f"{model.name} {params.get('Key', '')}")
        if model.name == "GetObject" and params.get("Key") == fence_key:
            fence_read.set()

    root = tmp_path / "new"
    _rank1_part(root, 7, gen2)
    rank1 = TierUploader(root, store, rank=1, world_size=2)
    rank1.client.meta.events.register("provide-client-params.s3", seen)
    rank1.submit(7)
    fence_read.wait(timeout=5)
    time.sleep(0.3)  # a few more polls
    calls.append("claimed")
    client.put_object(Bucket=store.bucket, Key=fence_key, Body=f"{gen2}\n".encode())
    assert rank1.wait(timeout=30)
    rank1.close()
    assert rank1.stats.steps_uploaded == [7]
    puts = [i for i, c in enumerate(calls) if c.startswith("PutObject")]
    assert puts and min(puts) > calls.index("claimed"), calls

    zombie_root = tmp_path / "old"
    _rank1_part(zombie_root, 8, gen1)
    zombie = TierUploader(zombie_root, store, rank=1, world_size=2)
    zombie.submit(8)
    assert zombie.wait(timeout=30)
    zombie.close()
    assert zombie.stats.superseded == [8]
    listed = client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/")
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert not [k for k in keys if step_dir_name(8) in k], keys


def test_a_run_without_a_run_id_is_not_fenced(
    tmp_path: Path, store: ObjectStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run id (none given, none from the launcher): no fence written or read, and a
    fence some other run left does not stop it, exactly as before the fence existed."""
    for name in ("TRAINGUARD_GENERATION", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    fence_reads: list[str] = []

    def seen(params: dict[str, Any], **_: Any) -> None:
        if str(params.get("Key", "")).endswith("FENCE"):
            fence_reads.append(str(params["Key"]))

    with _ckpt(tmp_path, store, "") as ckpt:
        assert ckpt.run_id == ""
        _on_call(ckpt, "provide-client-params.s3.GetObject", seen)
        _save(ckpt, 1, step=1)
        assert _fence(store) == ""
        client = make_client(store)
        client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/FENCE", Body=b"other\n")
        _save(ckpt, 2, step=2)
        assert ckpt.uploader is not None and ckpt.uploader.stats.steps_uploaded == [1, 2]
    assert fence_reads == []
    assert remote_steps(make_client(store), store) == [1, 2]
    assert _fence(store) == "other"
