"""Where the write and commit stages run: a thread of the trainer, or a separate process.

Both run :func:`checkpoint._persist.persist_part`; they differ in where. The process keeps
SHA-256, CRC and ``write`` syscalls entirely off the trainer's interpreter and survives the
trainer's death; the thread costs no extra process. docs/checkpoint.md has the numbers.

A back end knows the engine only as a :class:`WriterHost` (the callbacks below), so this
module does not import the engine and the engine imports it, never the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import subprocess
import sys
import threading
from typing import Any, Protocol

from checkpoint._persist import PersistJob, PersistResult, lower_priority, persist_part, pin_cpus
from checkpoint._stage import HostBuffer, Snapshot
from checkpoint.errors import CheckpointWriteError

log = logging.getLogger(__name__)


class WriterHost(Protocol):
    """What a writer back end calls on the engine that owns the snapshots."""

    cond: threading.Condition

    def wait_ready(self, snap: Snapshot, index: int) -> bool:
        """Block until entry ``index`` is final in the buffer; False if abandoned."""
        ...

    def on_durable(self, snap: Snapshot, size_bytes: int) -> None: ...

    def on_committed(self, snap: Snapshot, deleted: list[int]) -> None:
        """``snap`` is committed; ``deleted``: the steps retention removed right after."""
        ...

    def on_failed(self, snap: Snapshot, error: str) -> None: ...

    def on_done(self, snap: Snapshot) -> None:
        """The writer will not touch ``snap``'s buffer again (success or not)."""
        ...


class ThreadWriter:
    def __init__(self, host: WriterHost, *, nice: int = 0, cpus: tuple[int, ...] = ()) -> None:
        self.host = host
        self._nice = nice
        self._cpus = cpus
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
        host = self.host
        lower_priority(self._nice)  # this thread and the ones it starts
        pin_cpus(self._cpus)
        while True:
            item = self._q.get()
            if item is None:
                return
            snap, job = item

            def durable(result: PersistResult, snap: Snapshot = snap) -> None:
                host.on_durable(snap, result.bytes_written)

            def committed(result: PersistResult, snap: Snapshot = snap) -> None:
                host.on_committed(snap, result.deleted_steps)

            try:
                persist_part(
                    job,
                    snap.buffer.memory(),
                    functools.partial(host.wait_ready, snap),
                    durable,
                    committed,
                )
            except Exception as exc:
                host.on_failed(snap, f"{type(exc).__name__}: {exc}")
            finally:
                host.on_done(snap)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class ProcessWriter:
    """Client of :mod:`checkpoint._writer_process`, started in its own session so that a
    launcher killing the trainer's process group does not kill the flush as well.

    The child runs ``python -m checkpoint._writer_process`` and finds the package the way
    the trainer did (installed, or on the inherited ``PYTHONPATH`` / working directory);
    nothing patches its environment.
    """

    def __init__(self, host: WriterHost, *, nice: int = 0, cpus: tuple[int, ...] = ()) -> None:
        self.host = host
        self._cpus = cpus
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "checkpoint._writer_process", str(nice)]
            + [",".join(map(str, cpus))] * bool(cpus),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        #: Snapshots this writer was given and has not reported done (see _read).
        self._owned: dict[int, Snapshot] = {}
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
        with self.host.cond:
            self._owned[snap.snap_id] = snap
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
        host = self.host
        pin_cpus(self._cpus)  # off the training cores: it parses the writer's replies
        stdout = self._proc.stdout
        assert stdout is not None
        for line in stdout:
            msg = json.loads(line)
            with host.cond:
                snap = self._owned.get(msg["id"])
            if snap is None:
                continue
            event = msg["event"]
            if event == "durable":
                host.on_durable(snap, int(msg["bytes"]))
            elif event == "committed":
                host.on_committed(snap, [int(s) for s in msg.get("deleted", [])])
            elif event == "failed":
                host.on_failed(snap, str(msg["error"]))
            elif event == "done":
                with host.cond:
                    self._owned.pop(snap.snap_id, None)
                host.on_done(snap)
        # The writer exited: what it had not finished will not be. Only its own snapshots:
        # the engine may already have started a replacement writer.
        with host.cond:
            orphans, self._owned = list(self._owned.values()), {}
        for snap in orphans:
            host.on_failed(snap, f"writer process exited (code {self._proc.poll()})")
            host.on_done(snap)

    def close(self) -> None:
        stdin = self._proc.stdin
        if stdin is not None:
            with self._lock, contextlib.suppress(OSError, ValueError):
                stdin.close()
        self._proc.wait()
        self._reader.join()
