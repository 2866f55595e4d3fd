"""The on-disk report spool: nothing a report carries is lost while the controller is away.

Layout under ``spool_dir``::

    state.json              agent_instance, next_seq, dropped/quarantined counters (atomic)
    reports/000000000042.json   one report per file, named by zero-padded seq
    journal/                pending-<seq>.jsonl, what the next report will carry (agents.batch)
    rejected/               reports the controller refused as malformed (4xx), kept to inspect
    quarantine/             files found torn or unreadable at start

Guarantees: a report file is written with tmp + fsync + rename + directory fsync before it is
sent, so after a crash (even ``kill -9`` or power loss) a report is either whole or absent;
``seq`` never repeats for one ``agent_instance`` because ``next_seq`` is recovered as the
larger of the state file and the newest spooled report; reports are sent oldest first and
deleted only after the controller acknowledged them. The spool is bounded by bytes: when a
new report does not fit, the oldest are dropped and counted in ``dropped_total``, which the
next report carries to the controller; a report larger than the whole bound is not spooled
at all (it goes to ``rejected/`` with its reason, counted in ``dropped_total``), so the bound
holds and the older reports are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from agents.atomic import fsync_dir, write_atomic
from agents.errors import SpoolError
from trainguard import limits
from trainguard.textfile import Unreadable, read_bytes
from trainguard.wire import Report

log = logging.getLogger(__name__)

_REPORT_RE = re.compile(r"^(\d{12})\.json$")
#: Rejected reports kept for inspection; older ones are deleted.
MAX_REJECTED_FILES = 100
#: state.json is five short fields; a larger one is not ours.
_STATE_MAX_BYTES = 64 * 1024


def _encode(report: Report) -> bytes:
    """The report's JSON without ``null`` fields: every nullable wire field defaults to
    ``None`` (a test checks it), so leaving them out changes nothing for the reader and
    keeps a report of 8 GPUs x 5 samples about half the size."""
    return report.model_dump_json(exclude_none=True).encode()


#: What ``agent_instance`` may be on the wire (``Report.agent_instance``): 1-64, no NUL.
_INSTANCE_RE = re.compile(r"^[^\x00]{1,64}$")


def _count(raw: dict[str, object], key: str, *, required: bool = False) -> int:
    """``raw[key]`` as a wire count (an integer 0 .. 2^63-1, not a bool or a float)."""
    if key not in raw and not required:
        return 0
    value = raw[key]
    if type(value) is not int or not 0 <= value <= limits.INT64_MAX:
        raise ValueError(f"{key} {value!r:.40} is not an integer 0 .. {limits.INT64_MAX}")
    return value


@dataclass(kw_only=True, slots=True)
class SpoolState:
    agent_instance: str
    next_seq: int = 0
    dropped_total: int = 0
    quarantined_total: int = 0
    rejected_total: int = 0


class Spool:
    """Thread-safe; the daemon appends, the reporter thread reads, acknowledges, rejects."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.reports_dir = root / "reports"
        self.journal_dir = root / "journal"
        self.rejected_dir = root / "rejected"
        self.quarantine_dir = root / "quarantine"
        self._state_path = root / "state.json"
        self._lock = threading.RLock()
        self._sizes: dict[int, int] = {}
        self._total_bytes = 0
        #: state.json holds an older next_seq than memory (its last write failed).
        self._state_behind = False
        self.state = SpoolState(agent_instance="")
        self._open()

    # ------------------------------------------------------------------ start-up

    def _open(self) -> None:
        try:
            self._recover()
        except OSError as exc:
            raise SpoolError(f"spool directory {self.root} is unusable: {exc}") from None

    def _recover(self) -> None:
        for d in (self.reports_dir, self.journal_dir, self.rejected_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.state = self._load_state()
        for path in sorted(self.reports_dir.iterdir()):
            self._admit_at_start(path)
        newest = max(self._sizes, default=-1)
        if newest + 1 > self.state.next_seq:
            # The crash came after a report was written and before state.json caught up.
            self.state.next_seq = newest + 1
        self._save_state()

    def _load_state(self) -> SpoolState:
        """The saved state, or a fresh instance when it is missing or not exactly what
        ``_save_state`` writes: every field is checked for type and range, because a value
        that reads but is wrong (a negative total, ``next_seq`` of ``1.5`` or ``true``) would
        otherwise be carried into every report and fail it forever, or reuse seqs."""
        try:
            # Never waits on a FIFO or reads a device planted as state.json (textfile).
            raw = json.loads(read_bytes(self._state_path, max_bytes=_STATE_MAX_BYTES))
            if not isinstance(raw, dict):
                raise ValueError(f"not an object: {type(raw).__name__}")
            instance = raw.get("agent_instance")
            if not isinstance(instance, str) or not _INSTANCE_RE.fullmatch(instance):
                raise ValueError(f"agent_instance {instance!r:.80} is not 1-64 characters")
            state = SpoolState(
                agent_instance=instance,
                next_seq=_count(raw, "next_seq", required=True),
                dropped_total=_count(raw, "dropped_total"),
                quarantined_total=_count(raw, "quarantined_total"),
                rejected_total=_count(raw, "rejected_total"),
            )
            return state
        except Unreadable as exc:
            if not exc.missing:
                self._quarantine(self._state_path, f"unreadable state file ({exc.reason})")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            self._quarantine(self._state_path, f"unreadable state file ({exc})")
        # A fresh instance id tells the controller this seq space is new, not a replay.
        state = SpoolState(
            agent_instance=uuid.uuid4().hex, quarantined_total=self.state.quarantined_total
        )
        log.info("spool %s: new agent instance %s", self.root, state.agent_instance)
        return state

    def _admit_at_start(self, path: Path) -> None:
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)  # a write that never reached its rename
            return
        match = _REPORT_RE.fullmatch(path.name)
        if not match:
            self._quarantine(path, "unexpected file name")
            return
        seq = int(match.group(1))
        try:
            # A report never exceeds the whole spool's bound; a FIFO is never waited on.
            data = read_bytes(path, max_bytes=self.max_bytes)
            report = Report.model_validate_json(data)
            if report.seq != seq:
                raise ValueError(f"holds seq {report.seq}")
        except Unreadable as exc:
            self._quarantine(path, f"unreadable report ({exc.reason})")
            return
        except (OSError, ValueError, ValidationError) as exc:
            self._quarantine(path, f"torn or invalid report ({str(exc).splitlines()[0]})")
            return
        self._sizes[seq] = len(data)
        self._total_bytes += len(data)

    def _quarantine(self, path: Path, why: str) -> None:
        self.state.quarantined_total += 1
        target = self.quarantine_dir / f"{path.name}.{uuid.uuid4().hex[:8]}"
        log.warning("spool: quarantined %s: %s (moved to %s)", path.name, why, target)
        try:
            os.replace(path, target)
        except OSError:
            path.unlink(missing_ok=True)

    def _save_state(self) -> None:
        s = self.state
        payload = {
            "agent_instance": s.agent_instance,
            "next_seq": s.next_seq,
            "dropped_total": s.dropped_total,
            "quarantined_total": s.quarantined_total,
            "rejected_total": s.rejected_total,
        }
        write_atomic(self._state_path, json.dumps(payload).encode())
        self._state_behind = False

    def _try_save_state(self) -> bool:
        """``_save_state``, logging instead of raising when state.json cannot be written."""
        try:
            self._save_state()
        except OSError as exc:
            self._state_behind = True
            log.error(
                "spool: cannot write %s (%s); next_seq %d is kept by the newest report file "
                "until a later write succeeds",
                self._state_path,
                exc,
                self.state.next_seq,
            )
            return False
        return True

    # ------------------------------------------------------------------ writing

    @property
    def agent_instance(self) -> str:
        return self.state.agent_instance

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self.state.next_seq

    def path_for(self, seq: int) -> Path:
        return self.reports_dir / f"{seq:012d}.json"

    def append(self, build: Callable[[int, int], Report]) -> int:
        """Build report ``next_seq`` with ``build(seq, dropped_total)`` and make it durable.

        The oldest reports make room for a new one. A report larger than ``max_bytes`` on
        its own could never fit: it is not spooled (emptying the spool for it would lose
        every older report and still break the bound) but set aside in ``rejected/`` with
        the reason, its seq used up and counted in ``dropped_total`` (so the next report
        tells the controller one went missing); the older reports stay queued.
        """
        with self._lock:
            seq = self.state.next_seq
            while True:  # rebuilt after a drop: the new dropped_total may change its size
                data = _encode(build(seq, self.state.dropped_total))
                if len(data) > self.max_bytes:
                    self._set_aside_oversized(seq, data)
                    return seq
                if not self._make_room(len(data)):
                    break
            write_atomic(self.path_for(seq), data)
            self._sizes[seq] = len(data)
            self._total_bytes += len(data)
            self.state.next_seq = seq + 1
            # The report is durable, so the append is done: a failed state.json write (a
            # full disk) is logged, not raised, because the caller would otherwise build
            # the same samples into the next report too. ``next_seq`` is recovered at start
            # from the newest report file, and ``acknowledge`` keeps that file while
            # state.json is behind (see ``_state_behind``).
            self._try_save_state()
            return seq

    def _set_aside_oversized(self, seq: int, data: bytes) -> None:
        self.state.dropped_total += 1
        self.state.next_seq = seq + 1
        reason = f"{len(data)} bytes, larger than the whole spool ({self.max_bytes} bytes max)"
        log.error(
            "spool: report %d not spooled: %s; set aside in %s", seq, reason, self.rejected_dir
        )
        target = self.rejected_dir / self.path_for(seq).name
        try:
            write_atomic(target, data)
            (self.rejected_dir / f"{target.name}.reason.txt").write_text(reason + "\n")
        except OSError as exc:
            log.error(
                "spool: cannot keep oversized report %d in %s (%s)", seq, self.rejected_dir, exc
            )
        self._save_state()
        self._prune_rejected()

    def _make_room(self, incoming: int) -> int:
        dropped = 0
        while self._sizes and self._total_bytes + incoming > self.max_bytes:
            oldest = min(self._sizes)
            self.path_for(oldest).unlink(missing_ok=True)
            self._forget(oldest)
            dropped += 1
        if dropped:
            self.state.dropped_total += dropped
            log.warning(
                "spool full (%d bytes max): dropped the %d oldest report(s), %d in total",
                self.max_bytes,
                dropped,
                self.state.dropped_total,
            )
        return dropped

    # ------------------------------------------------------------------ reading, acknowledging

    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._sizes)

    def oldest(self) -> tuple[int, bytes] | None:
        """The oldest unacknowledged report's seq and bytes (exactly as spooled)."""
        with self._lock:
            for seq in sorted(self._sizes):
                try:
                    return seq, read_bytes(self.path_for(seq), max_bytes=self.max_bytes)
                except Unreadable as exc:
                    self._forget(seq)
                    log.error("spool: report %d vanished (%s); skipping it", seq, exc.reason)
            return None

    def acknowledge(self, seq: int) -> None:
        with self._lock:
            if self._state_behind and seq + 1 == self.state.next_seq and not self._try_save_state():
                # state.json still holds an older next_seq and this is the newest report:
                # its file is what recovery reads next_seq from after a restart (else the
                # seq would be reused and dropped by the controller as a duplicate). It is
                # kept on disk, out of the send queue; after a restart it is sent once more
                # and the controller answers it as a duplicate.
                self._forget(seq)
                return
            self.path_for(seq).unlink(missing_ok=True)
            self._forget(seq)

    def reject(self, seq: int, reason: str) -> None:
        """Move a report the controller refused out of the send queue, with the reason."""
        with self._lock:
            src = self.path_for(seq)
            if seq not in self._sizes:
                return
            self._forget(seq)
            self.state.rejected_total += 1
            try:
                os.replace(src, self.rejected_dir / src.name)
                (self.rejected_dir / f"{src.name}.reason.txt").write_text(reason + "\n")
                fsync_dir(self.rejected_dir)
            except OSError as exc:
                log.error("spool: cannot move rejected report %d (%s); deleting it", seq, exc)
                src.unlink(missing_ok=True)
            self._save_state()
            self._prune_rejected()

    def _prune_rejected(self) -> None:
        files = sorted(p for p in self.rejected_dir.iterdir() if _REPORT_RE.match(p.name))
        for old in files[:-MAX_REJECTED_FILES]:
            old.unlink(missing_ok=True)
            (self.rejected_dir / f"{old.name}.reason.txt").unlink(missing_ok=True)

    # ------------------------------------------------------------------ stats

    def stats(self) -> tuple[int, int]:
        """(reports waiting, bytes waiting)."""
        with self._lock:
            return len(self._sizes), self._total_bytes

    def _forget(self, seq: int) -> None:
        self._total_bytes -= self._sizes.pop(seq, 0)


__all__ = ["MAX_REJECTED_FILES", "Spool", "SpoolState"]
