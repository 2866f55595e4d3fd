"""Temporary files of the write path are never shared by two writers.

A root (or mirror) shared across nodes sees writers of several hosts, and containers start
their processes at the same small pids: a temp name of the target and the pid alone was
one file for a zombie rank and its replacement on another node, the later ``open(..., "wb")``
truncating the earlier writer's half-written copy.
"""

from __future__ import annotations

from pathlib import Path

from checkpoint._write import tmp_name, write_atomic


def test_two_writers_of_one_file_in_one_pid_get_two_temp_names(tmp_path: Path) -> None:
    target = tmp_path / "rank-00003.bin"
    names = {tmp_name(target) for _ in range(64)}
    assert len(names) == 64
    assert all(n.parent == tmp_path and n.name.startswith(".rank-00003.bin.tmp-") for n in names)


def test_an_atomic_write_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "MANIFEST.json"
    write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}"
    assert [p.name for p in tmp_path.iterdir()] == ["MANIFEST.json"]
