"""The writer process: persists snapshots from shared memory, outliving the trainer.

Run as ``python -m checkpoint._writer_process``. It reads JSON lines on stdin (``job``,
``ready``, ``abort``) and answers JSON lines on stdout (``durable``, ``committed``,
``failed``, ``done``). End of stdin means the trainer is gone or closing: every snapshot
already whole in shared memory is still persisted and committed (persist-at-breakpoint), the
others are dropped, and the process exits. It imports no torch, so it starts in ~50 ms.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import sys
import threading
from collections import deque
from typing import Any

from checkpoint._persist import PersistJob, PersistResult, lower_priority, persist_part, pin_cpus


class _Job:
    def __init__(self, job: PersistJob, mm: mmap.mmap, ready: int) -> None:
        self.job = job
        self.mm = mm
        self.ready = ready
        self.aborted = False


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


class WriterProcess:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[_Job] = deque()
        self.by_id: dict[int, _Job] = {}
        self.eof = False
        self.out_lock = threading.Lock()
        #: Host buffers mapped once and kept: the trainer reuses them save after save, and
        #: mapping 1 GB afresh costs a page fault per 4 KiB page on every save.
        self.maps: dict[str, mmap.mmap] = {}

    def reply(self, msg: dict[str, Any]) -> None:
        with self.out_lock, contextlib.suppress(OSError, ValueError):
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def read_stdin(self) -> None:
        try:
            for line in sys.stdin:
                self._handle(json.loads(line))
        finally:  # EOF, or a message we cannot parse: either way, no more instructions
            with self.cond:
                self.eof = True
                self.cond.notify_all()

    def _handle(self, msg: dict[str, Any]) -> None:
        with self.cond:
            op = msg["op"]
            if op == "job":
                path = msg["shm"]
                if path not in self.maps or len(self.maps[path]) != msg["size"]:
                    self.maps[path] = _map(path, msg["size"])
                job = _Job(PersistJob.from_dict(msg["job"]), self.maps[path], msg["ready"])
                self.by_id[job.job.job_id] = job
                self.queue.append(job)
            elif op in ("ready", "abort"):
                known = self.by_id.get(msg["id"])  # gone already if its write failed early
                if known is not None and op == "ready":
                    known.ready = msg["upto"]
                elif known is not None:
                    known.aborted = True
            elif op == "unlink":
                old = self.maps.pop(msg["shm"], None)
                if old is not None:
                    with contextlib.suppress(BufferError):
                        old.close()
            self.cond.notify_all()

    def _wait_ready(self, job: _Job, index: int) -> bool:
        with self.cond:
            while job.ready <= index and not job.aborted and not self.eof:
                self.cond.wait()
            return job.ready > index and not job.aborted

    def run(self) -> None:
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while True:
            with self.cond:
                while not self.queue and not self.eof:
                    self.cond.wait()
                if not self.queue:
                    break
                job = self.queue.popleft()
            jid = job.job.job_id

            def durable(result: PersistResult, jid: int = jid) -> None:
                self.reply(
                    {
                        "id": jid,
                        "event": "durable",
                        "bytes": result.bytes_written,
                        "durable_s": result.durable_s,
                    }
                )

            def committed(result: PersistResult, jid: int = jid) -> None:
                self.reply(
                    {
                        "id": jid,
                        "event": "committed",
                        "commit_s": result.commit_s,
                        "deleted": result.deleted_steps,
                    }
                )

            try:
                persist_part(
                    job.job,
                    memoryview(job.mm),
                    functools.partial(self._wait_ready, job),
                    durable,
                    committed,
                )
            except Exception as exc:
                self.reply({"id": jid, "event": "failed", "error": f"{type(exc).__name__}: {exc}"})
            finally:
                with self.cond:
                    self.by_id.pop(jid, None)
                self.reply({"id": jid, "event": "done"})
        for path in self.maps:  # the trainer is gone: nobody else will remove them
            with contextlib.suppress(OSError):
                os.unlink(path)


def main() -> None:
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    cpus = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else []
    lower_priority(nice)  # before any thread starts: Linux threads inherit it
    pin_cpus(cpus)  # likewise (CheckpointConfig.writer_cpus)
    WriterProcess().run()


if __name__ == "__main__":
    main()
