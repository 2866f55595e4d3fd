"""The jobs file's model and the local actuator's spec share one rule for what a rank can
be started with, and the jobs file is refused at load for every rule the spec has."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.logic.remediation.rules import PolicyError
from controller.services.remediation.wiring import load_local_jobs

BASE = '"name": "j", "argv": ["x"], "pool": ["a", "b"]'


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        # Spec-only rules: before, the file loaded and the actuator's build raised later,
        # without naming the file.
        ('"ranks_per_node": 1, "tp": 2', "job 'j': tp=2 must divide ranks_per_node=1"),
        ('"node_env": {"z": {"X": "1"}}', "job 'j': node_env names nodes outside the pool"),
    ],
)
def test_the_spec_rules_refuse_the_file_at_load(tmp_path: Path, entry: str, fragment: str) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(f"[{{{BASE}, {entry}}}]")
    with pytest.raises(PolicyError) as err:
        load_local_jobs(path)
    assert fragment in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('"env": {"X": "bad\\u0000"}', "[0].env: Value error, env contains a NUL byte"),
        (
            '"node_env": {"a": {"=X": "v"}}',
            "[0].node_env: Value error, bad environment variable names: ['=X']",
        ),
        ('"env": {"": "v"}', "[0].env: Value error, bad environment variable names: ['']"),
    ],
)
def test_the_file_names_the_field_with_the_spec_s_words(
    tmp_path: Path, entry: str, message: str
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(f"[{{{BASE}, {entry}}}]")
    with pytest.raises(PolicyError) as err:
        load_local_jobs(path)
    assert str(err.value) == f"local_jobs_file {path}: {message}"
