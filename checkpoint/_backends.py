"""The two writer back ends the engine can use: a thread, or a separate process.

Both run :func:`checkpoint.writer.persist_part`; they differ in where. The process keeps
SHA-256, CRC and ``write`` syscalls entirely off the trainer's interpreter and survives the
trainer's death; the thread costs no extra process. docs/checkpoint.md has the numbers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from checkpoint.buffers import HostBuffer
from checkpoint.errors import CheckpointWriteError
from checkpoint.writer import PersistJob, PersistResult, lower_priority, persist_part

if TYPE_CHECKING:
    from checkpoint.engine import Checkpointer, _Slot

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, eq=False)
class Snapshot:
    """One save in flight on this rank."""

    snap_id: int
    step: int
    slot: _Slot
    buffer: HostBuffer
    lazy: list[tuple[int, torch.Tensor, torch.Tensor]]
    ready: int
    t0: float
    total_bytes: int
    copy_done: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    error: str = ""
    blocking_s: float = 0.0
    #: Set while the training thread waits for this copy (the copier adds the wait up).
    waiting_since: float | None = None
    #: Recorded on the trainer's CUDA stream at save time; the copy stream waits on it.
    cuda_ready: Any = None
    durable_s: float = 0.0


class ThreadWriter:
    def __init__(self, engine: Checkpointer) -> None:
        self.engine = engine
        self._q: queue.Queue[tuple[Snapshot, PersistJob] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot, job: PersistJob) -> None:
        self._q.put((snap, job))

    def progress(self, snap: Snapshot) -> None:
        """The engine's condition variable already wakes this writer."""

    def abort(self, snap: Snapshot) -> None:
        """Same: ``wait_ready`` sees ``snap.aborted``."""

    def forget_buffer(self, buf: HostBuffer) -> None:
        """Nothing to tell: the buffer lives in this process."""

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        engine = self.engine
        lower_priority(engine.config.writer_nice)  # this thread and the ones it starts
        while True:
            item = self._q.get()
            if item is None:
                return
            snap, job = item

            def durable(result: PersistResult, snap: Snapshot = snap) -> None:
                engine.on_durable(snap, result.bytes_written)

            def committed(result: PersistResult, snap: Snapshot = snap) -> None:
                engine.on_committed(snap)

            try:
                persist_part(
                    job,
                    snap.buffer.memory(),
                    functools.partial(engine.wait_ready, snap),
                    durable,
                    committed,
                )
            except Exception as exc:
                engine.on_failed(snap, f"{type(exc).__name__}: {exc}")
            finally:
                engine.on_done(snap)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class ProcessWriter:
    """Client of :mod:`checkpoint._writer_proc`, started in its own session so that a
    launcher killing the trainer's process group does not kill the flush as well."""

    def __init__(self, engine: Checkpointer) -> None:
        self.engine = engine
        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint._writer_proc", str(engine.config.writer_nice)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self._owned: set[int] = set()  # snapshots this writer was given (see _read)
        self._reader = threading.Thread(target=self._read, name="ckpt-writer-rx", daemon=True)
        self._reader.start()

    def _send(self, msg: dict[str, Any]) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            with self._lock:
                stdin.write(json.dumps(msg) + "\n")
                stdin.flush()
        except (OSError, ValueError) as exc:
            raise CheckpointWriteError(f"writer process gone ({exc})") from None

    def submit(self, snap: Snapshot, job: PersistJob) -> None:
        assert snap.buffer.path is not None
        with self.engine.cond:
            self._owned.add(snap.snap_id)
        self._send(
            {
                "op": "job",
                "job": job.to_dict(),
                "shm": str(snap.buffer.path),
                "size": snap.buffer.size_bytes,
                "ready": snap.ready,
            }
        )

    def progress(self, snap: Snapshot) -> None:
        self._send({"op": "ready", "id": snap.snap_id, "upto": snap.ready})

    def abort(self, snap: Snapshot) -> None:
        self._send({"op": "abort", "id": snap.snap_id})

    def forget_buffer(self, buf: HostBuffer) -> None:
        self._send({"op": "unlink", "shm": str(buf.path)})

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self) -> None:
        engine = self.engine
        stdout = self._proc.stdout
        assert stdout is not None
        for line in stdout:
            msg = json.loads(line)
            with engine.cond:
                snap = engine._pending.get(msg["id"])
            if snap is None:
                continue
            event = msg["event"]
            if event == "durable":
                engine.on_durable(snap, int(msg["bytes"]))
            elif event == "committed":
                engine.on_committed(snap)
            elif event == "failed":
                engine.on_failed(snap, str(msg["error"]))
            elif event == "done":
                with engine.cond:
                    self._owned.discard(snap.snap_id)
                engine.on_done(snap)
        # The writer exited: what it had not finished will not be. Only its own snapshots:
        # the engine may already have started a replacement writer.
        with engine.cond:
            orphans = [s for i, s in engine._pending.items() if i in self._owned]
        for snap in orphans:
            engine.on_failed(snap, f"writer process exited (code {self._proc.poll()})")
            engine.on_done(snap)

    def close(self) -> None:
        stdin = self._proc.stdin
        if stdin is not None:
            with self._lock, contextlib.suppress(OSError, ValueError):
                stdin.close()
        self._proc.wait()
        self._reader.join()
