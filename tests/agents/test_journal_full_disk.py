"""A journal the agent cannot rewrite at start (a full disk) keeps its old files.

At start the agent replays the journals of reports it had not spooled yet, re-journals
what it recovered under the seq it will go into, then deletes the old files. When that
rewrite fails (ENOSPC: the disk is full, and this host cannot fill one for a test, so
``write_atomic`` raises as it would), the recovered items live only in memory: deleting
the old files then would lose them for good if the agent died before its next report.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from agents import batch as batch_module
from agents.batch import Batch


def _journal(path: Path, time_unix_s: float) -> None:
    line = {"t": "sample", "v": {"time_unix_s": time_unix_s}}
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")


def test_old_journals_stay_when_the_rewrite_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    _journal(journal / "pending-000000000003.jsonl", 1.0)
    _journal(journal / "pending-000000000004.jsonl", 2.0)

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(batch_module, "write_atomic", full_disk)
    batch = Batch(journal, next_seq=3)
    assert sorted(p.name for p in journal.iterdir()) == [
        "pending-000000000003.jsonl",
        "pending-000000000004.jsonl",
    ]  # before: pending-4 deleted, its sample in memory only
    assert [s.time_unix_s for s in batch.peek().samples] == [1.0, 2.0]
    batch.close()
