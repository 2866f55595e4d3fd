"""The object-storage tier against a real S3-compatible server (moto's, over HTTP on
127.0.0.1): multipart upload, restore from the bucket bit for bit, checksum fallback,
resume after an interrupted upload, retention per tier, never blocking the trainer."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import checkpoint
import checkpoint._tier_restore as tier_restore
from checkpoint import CheckpointConfig, Checkpointer, CheckpointStore
from checkpoint._commit import committed_steps
from checkpoint._load import load_state
from checkpoint._tier import TIER_DIR, TierUploader, _file_sha256, make_client, read_tier_state
from checkpoint._tier_bucket import list_step_prefixes, remote_steps
from checkpoint._tier_restore import download_step, load_nearest
from checkpoint.config import ObjectStoreConfig
from checkpoint.manifest import rank_data_name, step_dir_name
from tests.checkpoint.s3_server import s3_endpoint

pytestmark = pytest.mark.slow  # a server process; the tests themselves take well under 1 s

PART = 64 << 10  # 64 KiB parts: a ~1 MiB data file is ~17 parts
SECRET = "tg-secret-7d1f0c9e2b"  # must never show up in a log line or a journal


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with s3_endpoint(tmp_path_factory.mktemp("s3"), SECRET) as url:
        yield url


@pytest.fixture
def store(endpoint: str) -> ObjectStoreConfig:
    cfg = ObjectStoreConfig(
        bucket=f"ckpt-{uuid.uuid4().hex[:12]}",
        prefix="jobs/unit",
        endpoint_url=endpoint,
        region="us-east-1",
        part_bytes=PART,
        max_concurrency=4,
        keep_last=3,
    )
    make_client(cfg).create_bucket(Bucket=cfg.bucket)
    return cfg


class Holder(torch.nn.Module):
    """A 1 MiB fp32 weight and a bf16 buffer: loaded in place through load_state_dict."""

    def __init__(self, seed: int | None = None, rows: int = 256) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed or 0)
        fill = seed is not None
        self.w = torch.nn.Parameter(
            torch.randn(rows, 1024, generator=g) if fill else torch.zeros(rows, 1024)
        )
        self.register_buffer(
            "b",
            (torch.randn(1000, generator=g) if fill else torch.zeros(1000)).to(torch.bfloat16),
        )


def _state(seed: int, rows: int = 256) -> dict[str, Any]:
    return {"model": Holder(seed, rows), "extras": {"step_seed": seed}}


def _blank() -> dict[str, Any]:
    return {"model": Holder()}


def _config(
    root: Path, store: ObjectStoreConfig | None, writer: str = "thread", **kw: Any
) -> CheckpointConfig:
    return CheckpointConfig(root=root, writer=writer, object_store=store, **kw)  # type: ignore[arg-type]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    got, want = a["model"].state_dict(), b["model"].state_dict()
    assert list(got) == ["w", "b"]
    for key in got:
        assert got[key].dtype == want[key].dtype
        assert got[key].view(torch.uint8).numpy().tobytes() == (
            want[key].view(torch.uint8).numpy().tobytes()
        ), key
    assert got["w"].abs().sum() > 0  # not two blanks


def _wipe_local(root: Path) -> None:
    for path in root.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_save_uploads_multipart_then_restores_bit_exact_from_the_bucket(
    tmp_path: Path, store: ObjectStoreConfig, writer: str
) -> None:
    state = _state(1)
    with Checkpointer(_config(tmp_path, store, writer)) as ckpt:
        assert ckpt.save(state, step=7)
        ckpt.wait()
        assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
        stats = ckpt.uploader.stats
    assert stats.errors == []
    assert stats.steps_uploaded == [7]
    data_size = (tmp_path / step_dir_name(7) / rank_data_name(0)).stat().st_size
    assert data_size > 10 * PART
    # The data file went up as parts: one request per part plus one per small file.
    assert stats.parts_sent >= -(-data_size // PART) + 2
    client = make_client(store)
    assert remote_steps(client, store) == [7]
    head = client.head_object(
        Bucket=store.bucket, Key=f"jobs/unit/{step_dir_name(7)}/{rank_data_name(0)}"
    )
    assert head["ContentLength"] == data_size
    assert head["ETag"].strip('"').endswith(f"-{-(-data_size // PART)}")  # multipart ETag
    assert read_tier_state(tmp_path)[7]["state"] == "uploaded"

    _wipe_local(tmp_path)
    target = _blank()
    if writer == "thread":
        with Checkpointer(_config(tmp_path, store)) as ckpt:
            restored = ckpt.load(target)
    else:  # the module-level function takes the same tier
        restored = checkpoint.load(tmp_path, target, object_store=store)
    assert (restored.step, restored.source) == (7, "object_store")
    assert restored.values["extras"] == {"step_seed": 1}
    _same(target, state)
    # The downloaded copy is now the local tier: the next restore needs no network.
    assert committed_steps(tmp_path) == [7]


def test_damaged_remote_copy_fails_its_checksum_and_the_next_one_is_used(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    states = {1: _state(1), 2: _state(2)}
    with Checkpointer(_config(tmp_path, store)) as ckpt:
        for step, state in states.items():
            assert ckpt.save(state, step=step)
            ckpt.wait()
            assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
    client = make_client(store)
    key = f"jobs/unit/{step_dir_name(2)}/{rank_data_name(0)}"
    body = bytearray(client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01  # one flipped bit, same size: only a checksum sees it
    client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))

    # The local copy of step 2 is damaged too; step 1 is gone locally.
    local = tmp_path / step_dir_name(2) / rank_data_name(0)
    raw = bytearray(local.read_bytes())
    raw[100] ^= 0x01
    local.write_bytes(bytes(raw))
    shutil.rmtree(tmp_path / step_dir_name(1))

    target = _blank()
    with Checkpointer(_config(tmp_path, store)) as ckpt:
        restored = ckpt.load(target)
    assert (restored.step, restored.source) == (1, "object_store")
    _same(target, states[1])
    assert any("local step 2" in s and "CRC" in s for s in restored.skipped), restored.skipped
    assert any("remote step 2" in s and "SHA-256" in s for s in restored.skipped)


def _uploaded_then_damaged_locally(
    root: Path, store: ObjectStoreConfig, state: dict[str, Any], *, step: int
) -> None:
    """Save ``state`` at ``step``, wait for its upload, then flip a byte of the local data."""
    with Checkpointer(_config(root, store)) as ckpt:
        assert ckpt.save(state, step=step)
        ckpt.wait()
        assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
    local = root / step_dir_name(step) / rank_data_name(0)
    raw = bytearray(local.read_bytes())
    raw[-10] ^= 0x80
    local.write_bytes(bytes(raw))


def test_damaged_local_copy_is_replaced_by_the_remote_copy_of_the_same_step(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    state = _state(3)
    _uploaded_then_damaged_locally(tmp_path, store, state, step=5)
    target = _blank()
    _, choice = load_nearest(
        tmp_path, store, lambda s: load_state(tmp_path, target, step=s, restore_rng=False)
    )
    assert (choice.step, choice.source) == (5, "object_store")
    _same(target, state)
    # The damaged local copy is kept aside for forensics, not loaded again.
    assert any((tmp_path / TIER_DIR / "damaged").iterdir())


def test_a_restore_reads_each_file_once_for_its_checksum(
    tmp_path: Path, store: ObjectStoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged local copy is checked whole, its good files reused, the bad one fetched and
    the copies compared again: every file (a hard link of it included) is hashed once."""
    _uploaded_then_damaged_locally(tmp_path, store, _state(4), step=6)
    hashed: list[tuple[int, int]] = []
    real = _file_sha256

    def counting(path: Path) -> str:
        st = path.stat()
        hashed.append((st.st_dev, st.st_ino))
        return real(path)

    monkeypatch.setattr(tier_restore, "_file_sha256", counting)
    dest = download_step(make_client(store), store, 6, tmp_path)
    files = sorted(p.name for p in dest.iterdir())
    assert len(files) >= 3  # the manifest, the rank's manifest and its data
    # The local copy's files, then the two fetched (the manifest and the damaged data).
    assert len(hashed) == len(files) + 2, hashed
    assert len(set(hashed)) == len(hashed), hashed
    assert any((tmp_path / TIER_DIR / "damaged").iterdir())


def test_interrupted_upload_resumes_without_resending_stored_parts(
    tmp_path: Path, store: ObjectStoreConfig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    state = _state(4)
    with Checkpointer(_config(tmp_path, None)) as ckpt:  # local only; upload by hand
        assert ckpt.save(state, step=3)
        ckpt.wait()
    data_size = (tmp_path / step_dir_name(3) / rank_data_name(0)).stat().st_size
    total_parts = -(-data_size // PART)

    # First uploader: the network "fails" after 5 parts of the data file went up.
    first = TierUploader(tmp_path, store)
    sent = {"n": 0}
    lock = threading.Lock()

    def fail_after_five(**_: Any) -> None:
        with lock:
            sent["n"] += 1
            if sent["n"] > 5:
                raise ConnectionError("injected: link down")

    first.client.meta.events.register("before-call.s3.UploadPart", fail_after_five)
    first.submit(3)
    assert first.wait(timeout=30)
    first.close()
    assert first.stats.errors and "link down" in first.stats.errors[0]
    assert first.stats.parts_sent >= 5 + 2 - 2  # the small files may or may not have gone
    journal = read_tier_state(tmp_path)[3]
    assert journal["state"] == "failed"
    assert remote_steps(first.client, store) == []  # no TIER.json: incomplete remotely

    # A new process (new client, same root): it finds the staged step and resumes.
    attempts = {"n": 0}

    def count(**_: Any) -> None:
        with lock:
            attempts["n"] += 1

    second_client = make_client(store)
    second_client.meta.events.register("before-call.s3.UploadPart", count)
    second = TierUploader(tmp_path, store, client=second_client)
    assert second.wait(timeout=30)
    second.close()
    assert second.stats.errors == []
    assert second.stats.steps_uploaded == [3]
    assert second.stats.parts_reused == 5  # listed by ListParts, MD5 matched
    assert attempts["n"] == total_parts - 5  # only the missing parts crossed the wire
    assert remote_steps(second_client, store) == [3]

    _wipe_local(tmp_path)
    target = _blank()
    _, choice = load_nearest(
        tmp_path, store, lambda s: load_state(tmp_path, target, step=s, restore_rng=False)
    )
    assert choice.source == "object_store"
    _same(target, state)
    # Credentials came from the environment chain and went nowhere else.
    assert caplog.records and SECRET not in caplog.text
    for path in (tmp_path / TIER_DIR).rglob("*.json"):
        assert SECRET not in path.read_text()


def test_retention_per_tier(tmp_path: Path, store: ObjectStoreConfig) -> None:
    store.keep_last = 3
    with Checkpointer(_config(tmp_path, store, keep_last=2)) as ckpt:
        for step in range(1, 6):
            assert ckpt.save(_state(step, rows=32), step=step)  # 128 KiB: 2 parts
            ckpt.wait()
            assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
        assert ckpt.uploader is not None
        assert ckpt.uploader.stats.steps_uploaded == [1, 2, 3, 4, 5]
    client = make_client(store)
    assert committed_steps(tmp_path) == [4, 5]
    assert remote_steps(client, store) == [3, 4, 5]
    assert list_step_prefixes(client, store) == [3, 4, 5]  # no stray objects of 1 and 2
    assert client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []


def test_upload_does_not_block_saves(tmp_path: Path, store: ObjectStoreConfig) -> None:
    """The link is held shut (every part waits for ``link_open``) while the trainer saves
    twice: save() and wait() (local durability) return, and the second step queues behind
    the stalled upload; once the link opens both steps reach the bucket."""
    link_open = threading.Event()

    def stalled(**_: Any) -> None:
        assert link_open.wait(timeout=60)

    with Checkpointer(_config(tmp_path, store)) as ckpt:
        assert ckpt.uploader is not None
        ckpt.uploader.client.meta.events.register("before-call.s3.UploadPart", stalled)

        def save_and_wait(step: int) -> None:
            assert ckpt.save(_state(step), step=step)
            ckpt.wait()

        for step in (1, 2):
            trainer = threading.Thread(target=save_and_wait, args=(step,))
            trainer.start()
            trainer.join(timeout=30)
            assert not trainer.is_alive(), "save/wait waited on the object store"
        assert committed_steps(tmp_path) == [1, 2]
        states = read_tier_state(tmp_path)
        assert (states[1]["state"], states[2]["state"]) == ("uploading", "queued")
        link_open.set()
        assert ckpt.uploader.wait(timeout=30)
        assert ckpt.uploader.stats.steps_uploaded == [1, 2]
    assert remote_steps(make_client(store), store) == [1, 2]


def test_inspect_shows_the_object_store_state(tmp_path: Path, store: ObjectStoreConfig) -> None:
    from typer.testing import CliRunner

    from checkpoint.cli import app

    with Checkpointer(_config(tmp_path, store)) as ckpt:
        assert ckpt.save(_state(1), step=1)
        ckpt.wait()
        assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "-o", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["checkpoints"]
    assert [(r["step"], r["object_store"]) for r in rows] == [(1, "uploaded")]
    table = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert "OBJECT STORE" in table.output and "uploaded" in table.output
    assert CheckpointStore(tmp_path).list()[0].complete


def _journaled_parts(root: Path, step: int) -> int:
    """Parts of the data file that the uploader's journal records as stored."""
    try:
        raw = json.loads((root / TIER_DIR / f"{step_dir_name(step)}.json").read_bytes())
    except (FileNotFoundError, ValueError):
        return 0
    return len(raw.get("files", {}).get(rank_data_name(0), {}).get("parts", {}))


_KILLED_UPLOADER = """
import sys, time
from pathlib import Path
from checkpoint._tier import TierUploader
from checkpoint.config import ObjectStoreConfig
cfg = ObjectStoreConfig(bucket=sys.argv[2], prefix="jobs/unit", endpoint_url=sys.argv[3],
                        region="us-east-1", part_bytes=int(sys.argv[4]), max_concurrency=1)
up = TierUploader(Path(sys.argv[1]), cfg)
up.client.meta.events.register("before-call.s3.UploadPart", lambda **_: time.sleep(0.15))
up.submit(int(sys.argv[5]))
up.wait()
"""


def test_uploader_killed_mid_upload_resumes_from_the_parts_the_server_holds(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    """SIGKILL, not a polite failure: the journal (written atomically per part) and
    ListParts must be enough for the next uploader to send only what is missing."""
    root = tmp_path / "ckpt"
    state = _state(6)
    with Checkpointer(_config(root, None)) as ckpt:
        assert ckpt.save(state, step=9)
        ckpt.wait()
    total_parts = -(-(root / step_dir_name(9) / rank_data_name(0)).stat().st_size // PART)
    args = [str(store.endpoint_url), str(PART), "9"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_UPLOADER, str(root), store.bucket, *args],
        cwd=Path(__file__).resolve().parents[2],
    )
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if _journaled_parts(root, 9) >= 4:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the uploader finished or died before it was killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    client = make_client(store)
    assert remote_steps(client, store) == []

    attempts = {"n": 0}

    def count(**_: Any) -> None:
        attempts["n"] += 1

    client.meta.events.register("before-call.s3.UploadPart", count)
    resumed = TierUploader(root, store, client=client)
    assert resumed.wait(timeout=30)
    resumed.close()
    assert resumed.stats.errors == [] and resumed.stats.steps_uploaded == [9]
    assert 4 <= resumed.stats.parts_reused < total_parts
    assert attempts["n"] == total_parts - resumed.stats.parts_reused

    _wipe_local(root)
    target = _blank()
    restored = checkpoint.load(root, target, object_store=store)
    assert (restored.step, restored.source) == (9, "object_store")
    _same(target, state)


def test_stray_step_names_in_the_bucket_and_staging_are_not_steps(
    tmp_path: Path, store: ObjectStoreConfig
) -> None:
    """Only the writer's own ``step-<12 digits>`` names are steps: a hand-made ``step-3/``
    or a ``step-²/`` (``str.isdigit`` is true, ``int`` refuses it) used to crash the
    bucket listing and the restart's scan of leftover staging."""
    client = make_client(store)
    for stray in ("step-²", "step-3", "step-١٢"):
        client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{stray}/x", Body=b"x")
    (tmp_path / ".tier" / "staging" / "step-²").mkdir(parents=True)
    with Checkpointer(_config(tmp_path, store)) as ckpt:
        assert ckpt.save(_state(1, rows=32), step=1)
        ckpt.wait()
        assert ckpt.uploader is not None and ckpt.uploader.wait(timeout=30)
        assert ckpt.uploader.stats.steps_uploaded == [1]
    assert list_step_prefixes(client, store) == [1]
    assert remote_steps(client, store) == [1]
