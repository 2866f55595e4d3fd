"""Policy and local-jobs files: a mistake is refused at start with a line naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from controller.logic.remediation.rules import PolicyError, Step, load_policy
from controller.services.remediation.wiring import load_local_jobs

GOOD_JOB = (
    "- name: gpt\n"
    "  argv: [python, -m, demojob.train]\n"
    "  pool: [a, b, c]\n"
    "  nodes_count: 2\n"
    "  ranks_per_node: 2\n"
    "  tp: 2\n"
    "  global_batch: 8\n"
)


def test_a_local_job_file_becomes_a_spec_and_a_first_placement(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(GOOD_JOB)
    (job,) = load_local_jobs(path)
    spec, placement = job.spec(), job.placement()
    assert list(spec.argv) == [sys.executable, "-m", "demojob.train"]  # "python" = ours
    assert spec.dp_must_divide == 8 and list(spec.pool) == ["a", "b", "c"]
    assert placement.nodes == ("a", "b") and placement.world_size == 4 and placement.dp == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- {name: gpt}\n", "[0].argv: Field required"),
        ("name: gpt\n", "expected a YAML list of jobs"),
        ("- [unclosed\n", "is not valid YAML"),
        (GOOD_JOB + "  nodes: [a, z]\n", "nodes must be a non-empty subset of pool"),
        (GOOD_JOB + "  colour: blue\n", "[0].colour: Extra inputs are not permitted"),
    ],
)
def test_bad_local_jobs_files_are_named(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_local_jobs(path)
    assert fragment in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_policy_files(tmp_path: Path) -> None:
    assert load_policy(None).rule_for("gpu_fault", "critical").steps[-1] is Step.RESTART  # type: ignore[union-attr]
    path = tmp_path / "policy.yaml"
    path.write_text("rules: [{kind: hang, steps: [restart, restart]}]\n")
    with pytest.raises(PolicyError, match="repeats a step"):
        load_policy(path)
    path.write_text("rules: [{kind: hang, steps: [alert, restart]}]\n")
    assert load_policy(path).rules[0].actions == [Step.RESTART]  # alert first, then act
    path.write_text("rules: [{kind: hang, steps: [restart, alert]}]\n")
    with pytest.raises(PolicyError, match="'alert' must be the first step"):
        load_policy(path)
    path.write_text("rules: [{kind: nonfinite, steps: [restart, rollback]}]\n")
    with pytest.raises(PolicyError, match="'restart' and 'rollback' both restart the job"):
        load_policy(path)
    assert load_policy(None).rule_for("nonfinite", "critical").steps[-1] is Step.ROLLBACK  # type: ignore[union-attr]
    path.write_text("rules: [{kind: straggler, steps: [restart], after_s: 400}]\n")
    with pytest.raises(PolicyError, match=r"must be below guards\.stale_after_s=300"):
        load_policy(path)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("kind", "fragment"),
    [
        ("gpu_fualt", "did you mean 'gpu_fault'?"),
        ("straggle", "did you mean 'straggler'?"),
        ("Hang", "did you mean 'hang'"),
        ("ecc", "known kinds: gpu_fault, "),  # nothing close: the list to choose from
        ("**", "unknown incident kind '**'"),
    ],
)
def test_a_rule_for_a_kind_nothing_opens_is_refused(
    tmp_path: Path, kind: str, fragment: str
) -> None:
    """A typo in a rule's kind would make a rule that never matches: the fault it meant
    would only ever get the catch-all alert."""
    path = tmp_path / "policy.yaml"
    path.write_text(f"rules: [{{kind: '{kind}', severity: critical, steps: [isolate]}}]\n")
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert str(path) in message and "rules.0.kind" in message and fragment in message
    assert "\n" not in message
