"""Writing the data file straight from the host buffer: same bytes, same CRCs, any path."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import zlib
from pathlib import Path

import pytest

from checkpoint import crc
from checkpoint._persist import PersistJob, persist_part
from checkpoint._write import BufferFileWriter, DataFileWriter, gaps_are_zero
from checkpoint.crc import crc32
from checkpoint.manifest import Entry, GlobalMap, Piece, to_json_bytes

CHUNK = 64 << 10


def _buffer(size: int) -> mmap.mmap:
    mm = mmap.mmap(-1, size)
    mm[:] = os.urandom(size)
    return mm


def _direct_supported(folder: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    (folder / "probe").unlink()
    return True


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [10 * CHUNK, 10 * CHUNK + 12345, 777])
def test_file_and_crcs_equal_the_buffer_prefix(tmp_path: Path, direct: bool, size: int) -> None:
    mm = _buffer(size + 8192)
    view = memoryview(mm)
    writer = BufferFileWriter(
        tmp_path / "d.bin", view, chunk_bytes=CHUNK, sha256=True, hash_threads=3, direct=direct
    )
    for ready in (1000, 3 * CHUNK + 5, 3 * CHUNK + 5, size // 2, size):  # a growing prefix
        writer.advance(min(ready, size))
    info = writer.finish(size)
    data = (tmp_path / "d.bin").read_bytes()
    assert data == mm[:size]
    assert info.size_bytes == size
    assert info.chunk_crc32 == [zlib.crc32(data[i : i + CHUNK]) for i in range(0, size, CHUNK)]
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    if direct and size >= 4096 and _direct_supported(tmp_path):
        assert writer.direct_bytes >= size // 4096 * 4096 - 4096  # the bulk skipped the cache
    if not direct:
        assert writer.direct_bytes == 0
    assert not list(tmp_path.glob(".*tmp*"))
    view.release()


@pytest.mark.parametrize("hint_extra", [0, 3 * CHUNK + 7])
@pytest.mark.parametrize("size", [10 * CHUNK + 12345, 20 * CHUNK])
def test_preallocated_file_is_the_same_file(tmp_path: Path, size: int, hint_extra: int) -> None:
    """Issue 19's durable bandwidth: with the size known, the temp file is preallocated
    (``fallocate``) so the O_DIRECT writes overwrite rather than extend it; the file, its
    size and its CRCs are what they are without, and a hint larger than what was written
    is cut back to the size ``finish`` is given."""
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system: no preallocation either")
    mm = _buffer(size + hint_extra + 8192)
    view = memoryview(mm)
    writer = BufferFileWriter(
        tmp_path / "d.bin", view, chunk_bytes=CHUNK, sha256=False, size_hint=size + hint_extra
    )
    assert writer.preallocated  # ext4, xfs, btrfs, tmpfs all have fallocate
    assert os.stat(next(tmp_path.glob(".d.bin.tmp-*"))).st_size == size + hint_extra
    for ready in (CHUNK, size // 3, size):
        writer.advance(ready)
    info = writer.finish(size)
    data = (tmp_path / "d.bin").read_bytes()
    assert data == mm[:size] and info.size_bytes == size
    assert info.chunk_crc32 == [zlib.crc32(data[i : i + CHUNK]) for i in range(0, size, CHUNK)]
    assert writer.direct_bytes >= size // 4096 * 4096 - 4096
    view.release()


def test_unaligned_memory_falls_back_to_buffered_writes(tmp_path: Path) -> None:
    """O_DIRECT refuses a buffer that is not page-aligned; the writer must not fail."""
    blob = bytearray(os.urandom(5 * CHUNK + 1))
    view = memoryview(blob)[1:]  # almost surely not 4096-aligned
    writer = BufferFileWriter(tmp_path / "d.bin", view, chunk_bytes=CHUNK, sha256=False)
    writer.advance(len(view))
    info = writer.finish(len(view))
    assert (tmp_path / "d.bin").read_bytes() == bytes(view)
    assert info.sha256 == ""


def test_abort_leaves_no_file(tmp_path: Path) -> None:
    writer = BufferFileWriter(
        tmp_path / "d.bin", memoryview(_buffer(CHUNK)), chunk_bytes=4096, sha256=False
    )
    writer.advance(CHUNK)
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_gap_check() -> None:
    buf = memoryview(bytes(10) + b"x" + bytes(10))
    assert gaps_are_zero(buf, [(0, 4), (8, 3), (12, 3)])  # byte 10 is inside a tensor
    assert not gaps_are_zero(buf, [(0, 4), (12, 3)])  # byte 10 is padding and not zero
    assert not gaps_are_zero(buf, [(4, 4), (0, 2)])


def test_persist_pads_with_zeros_when_the_buffer_gaps_are_dirty(tmp_path: Path) -> None:
    """A caller whose buffer holds garbage between tensors still gets zero padding and the
    same file as the streaming writer produces."""
    entries = [
        Entry(name="a", dtype="uint8", shape=[100], offset=0, nbytes=100),
        Entry(name="b", dtype="uint8", shape=[5000], offset=128, nbytes=5000),
    ]
    blob = bytearray(os.urandom(5128))
    job = PersistJob(
        job_id=1,
        root=str(tmp_path),
        step=1,
        rank=0,
        world_size=1,
        layout={"world": 1},
        entries=entries,
        keep_last=1,
        commit_timeout_s=5.0,
        chunk_bytes=4096,
    )
    persist_part(job, memoryview(blob), lambda i: True)
    data = (tmp_path / "step-000000000001" / "rank-00000.bin").read_bytes()
    ref = DataFileWriter(tmp_path / "ref.bin", chunk_bytes=4096, sha256=False)
    ref.write(bytes(blob[:100]))
    ref.pad_to(128)
    ref.write(bytes(blob[128:]))
    ref.finish()
    assert data == (tmp_path / "ref.bin").read_bytes()
    assert data[100:128] == bytes(28)


def test_crc32_equals_zlib_on_any_buffer(tmp_path: Path) -> None:
    """Whichever implementation runs (libdeflate or zlib), the value is zlib's CRC-32, for
    writable, read-only (the writer process's mapping) and sliced buffers."""
    data = os.urandom(3 * CHUNK + 17)
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as fh:
        ro = mmap.mmap(fh.fileno(), len(data), prot=mmap.PROT_READ)
    for buf in (data, bytearray(data), memoryview(ro)[5:], memoryview(data)[:100]):
        assert crc32(buf) == zlib.crc32(buf)
        assert crc32(buf, 12345) == zlib.crc32(buf, 12345)
    assert crc.IMPLEMENTATION in ("libdeflate", "zlib")


def test_persist_job_dict_round_trips() -> None:
    gm = GlobalMap(
        name="w", shape=[4, 2], pieces=[Piece(offsets=[2, 0], shape=[2, 2], base=0, strides=[2, 1])]
    )
    job = PersistJob(
        job_id=7,
        root="/r",
        step=3,
        rank=1,
        world_size=2,
        layout={"tp": 2},
        entries=[
            Entry(name="w", dtype="float32", shape=[2, 2], offset=0, nbytes=16, global_map=gm),
            Entry(name="b", dtype="uint8", shape=[3], offset=64, nbytes=3),
        ],
        keep_last=2,
        commit_timeout_s=1.0,
        hash_threads=3,
        direct_io=False,
    )
    raw = job.to_dict()
    assert raw == dataclasses.asdict(job)
    assert json.loads(to_json_bytes(job)) == json.loads(json.dumps(dataclasses.asdict(job)))
    assert PersistJob.from_dict(json.loads(json.dumps(raw))) == job


def test_read_only_shared_mapping_is_written_direct(tmp_path: Path) -> None:
    """The writer process maps the shared host buffer read-only; O_DIRECT still applies."""
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    src = tmp_path / "shm-like"
    src.write_bytes(os.urandom(4 * CHUNK))
    with open(src, "rb") as fh:
        ro = mmap.mmap(fh.fileno(), 4 * CHUNK, prot=mmap.PROT_READ)
    writer = BufferFileWriter(tmp_path / "d.bin", memoryview(ro), chunk_bytes=CHUNK, sha256=False)
    writer.advance(4 * CHUNK)
    writer.finish(4 * CHUNK)
    assert writer.direct_bytes == 4 * CHUNK
    assert (tmp_path / "d.bin").read_bytes() == src.read_bytes()
