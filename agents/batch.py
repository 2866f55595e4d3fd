"""What the next report will carry, journaled so a killed agent loses none of it.

Samples, job records and command acks accumulate here between reports. Each item is also
appended as one JSON line to ``journal/pending-<seq>.jsonl`` (``seq`` = the report it will
go into) and flushed to the kernel, so ``kill -9`` loses nothing; there is no fsync per
line (a power cut may lose up to one report interval, in exchange for no disk flush per
sample). When report ``seq`` is durably spooled the journal file is deleted; at start any
journal whose seq is already spooled is deleted and the rest is replayed, so an item lands
in exactly one report. A torn last line (the process died mid-write) is skipped.

Job records are bounded by item counts that keep a report under ``wire.MAX_REPORT_BYTES``;
past ``flush_hint_bytes`` the batch asks the daemon to report early.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from agents.atomic import write_atomic
from trainguard.wire import CommandAck, JobRecords, NodeSample

log = logging.getLogger(__name__)

#: Item caps per report: half of the wire limits, so a report always validates.
MAX_STEPS = 10_000
MAX_OTHER_RECORDS = 2_048
#: Kinds that come once per rank and step get the larger cap; the rest MAX_OTHER_RECORDS.
_RECORD_CAPS = {"steps": MAX_STEPS, "probes": MAX_STEPS}
MAX_SAMPLES = 3_600
MAX_ACKS = 2_048
#: Serialized job-record bytes past which the daemon is asked to report at once.
FLUSH_HINT_BYTES = 1024 * 1024


@dataclass(slots=True)
class BatchContents:
    samples: list[NodeSample] = field(default_factory=list)
    records: JobRecords = field(default_factory=JobRecords)
    acks: list[CommandAck] = field(default_factory=list)


class Batch:
    """Thread-safe accumulator for the next report, backed by an append-only journal."""

    def __init__(self, journal_dir: Path, *, next_seq: int) -> None:
        self._dir = journal_dir
        self._lock = threading.RLock()
        self._contents = BatchContents()
        self._record_bytes = 0
        self._file: IO[str] | None = None
        self.dropped_records_total = 0
        self._replay(next_seq)
        self._open(next_seq)

    # ------------------------------------------------------------------ journal

    def _path(self, seq: int) -> Path:
        return self._dir / f"pending-{seq:012d}.jsonl"

    def _open(self, seq: int) -> None:
        self._file = self._path(seq).open("a", encoding="utf-8")
        self._seq = seq

    def _replay(self, next_seq: int) -> None:
        for path in sorted(self._dir.glob("pending-*.jsonl")):
            try:
                seq = int(path.stem.removeprefix("pending-"))
            except ValueError:
                path.unlink(missing_ok=True)
                continue
            if seq < next_seq:
                path.unlink(missing_ok=True)  # its report was spooled before the crash
                continue
            replayed = 0
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    self._apply(json.loads(line))
                    replayed += 1
                except (ValueError, KeyError, TypeError, RecursionError, ValidationError):
                    # A torn tail, or any line that is not one of ours (valid JSON but not an
                    # object, nested past the parser's depth): skipped, never fatal at start.
                    log.warning("journal %s: skipped a torn line", path.name)
            if replayed:
                log.info("journal: recovered %d item(s) from %s", replayed, path.name)
        # Re-journal what was recovered, whole lines only, under the seq it will go into
        # (a torn tail must not swallow the next line appended after it).
        c = self._contents
        lines = [("sample", s.model_dump(mode="json")) for s in c.samples]
        if not c.records.is_empty():
            lines.append(("records", c.records.model_dump(mode="json", exclude_defaults=True)))
        lines += [("ack", a.model_dump(mode="json")) for a in c.acks]
        text = "".join(json.dumps({"t": k, "v": v}, separators=(",", ":")) + "\n" for k, v in lines)
        if text:
            write_atomic(self._path(next_seq), text.encode())
        for path in self._dir.glob("pending-*.jsonl"):
            if path != self._path(next_seq) or not text:
                path.unlink(missing_ok=True)

    def _apply(self, entry: Any) -> None:
        if not isinstance(entry, dict):
            raise ValueError(f"not an object: {type(entry).__name__}")
        kind, value = entry["t"], entry["v"]
        # Replay honours the same caps as live adds, so a recovered report always validates.
        if kind == "sample":
            self._contents.samples.append(NodeSample.model_validate(value))
            del self._contents.samples[:-MAX_SAMPLES]
        elif kind == "records":
            self._merge(JobRecords.model_validate(value), len(json.dumps(value)))
        elif kind == "ack":
            if len(self._contents.acks) < MAX_ACKS:
                self._contents.acks.append(CommandAck.model_validate(value))
        else:
            raise KeyError(kind)

    def _write(self, kind: str, value: Any) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"t": kind, "v": value}, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:
            log.error("journal write failed (%s); item kept in memory only", exc)

    # ------------------------------------------------------------------ adding

    def add_sample(self, sample: NodeSample) -> None:
        with self._lock:
            if len(self._contents.samples) >= MAX_SAMPLES:
                del self._contents.samples[0]
            self._contents.samples.append(sample)
            self._write("sample", sample.model_dump(mode="json"))

    def add_ack(self, ack: CommandAck) -> None:
        with self._lock:
            if len(self._contents.acks) < MAX_ACKS:
                self._contents.acks.append(ack)
                self._write("ack", ack.model_dump(mode="json"))
            else:
                log.error("too many command acks pending; dropped ack for %s", ack.command_id)

    def add_records(self, records: JobRecords, size_bytes: int) -> bool:
        """Add job records; returns True when the batch is big enough to report now."""
        with self._lock:
            kept = self._merge(records, size_bytes)
            if not kept.is_empty():
                self._write("records", kept.model_dump(mode="json", exclude_defaults=True))
            return self._record_bytes >= FLUSH_HINT_BYTES

    def _merge(self, records: JobRecords, size_bytes: int) -> JobRecords:
        """Append within the caps; what does not fit is dropped and counted."""
        kept = JobRecords()
        into = self._contents.records
        # Every record kind of the wire format, so a kind added there is never dropped here
        # (Flight Recorder dumps once were: the list named five kinds by hand).
        for name in JobRecords.model_fields:
            cap = _RECORD_CAPS.get(name, MAX_OTHER_RECORDS)
            items: list[Any] = getattr(records, name)
            target: list[Any] = getattr(into, name)
            room = max(0, cap - len(target))
            target.extend(items[:room])
            getattr(kept, name).extend(items[:room])
            if len(items) > room:
                self.dropped_records_total += len(items) - room
                log.warning("batch full: dropped %d %s record(s)", len(items) - room, name)
        self._record_bytes += size_bytes
        return kept

    # ------------------------------------------------------------------ taking

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def peek(self) -> BatchContents:
        """The current contents (call under :attr:`lock` and then :meth:`reset`)."""
        return self._contents

    def reset(self, next_seq: int) -> None:
        """The contents are in a spooled report now: start an empty journal for ``next_seq``."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._path(self._seq).unlink(missing_ok=True)
            self._contents = BatchContents()
            self._record_bytes = 0
            self._open(next_seq)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = ["Batch", "BatchContents"]
