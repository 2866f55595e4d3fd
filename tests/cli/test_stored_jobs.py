"""Yesterday's job, everywhere an operator looks.

A job not heard from for ``job_retention_s`` leaves the controller's memory; its rows stay
in the database and ``GET /jobs/{name}`` answers from them (state ``ended``, source
``history``). The routes beside it and the command line did not follow:

- ``GET /jobs/{name}/checkpoints`` answered 404 for such a job although it reads the
  checkpoints from the database anyway; ``/steps`` answered "they start with its next
  report", which never comes for an ended job.
- ``trainguard jobs`` (and ``kubectl trainguard jobs``) had no way to list stored jobs, and
  there was no command to show one job: an ended job was invisible from the terminal.

A real controller (in-process, real HTTP) with a 1 s retention ends one job; the CLI runs
in-process against it, the plugin through a real kubectl.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls
from tests.cli.cli_testkit import CliResult, CliServer
from tests.cli.conftest import in_process_cli
from tests.cli.test_cli_kubectl import _env, kubectl_bin  # noqa: F401  (a fixture)
from tests.controller.conftest import report
from tests.controller.test_job_retention import ALERT_ONLY, job_records
from tests.remediation.test_engine import open_incident
from tests.waiting import wait_for

SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
ENDED, HELD, NEVER = "old-a", "held", "never-ran"
#: Ended too, and no step time of it is held (none sent; as after a controller restart, or
#: once newer jobs pushed its steps out of the bounded in-memory window).
NO_STEPS = "old-b"
WORLD = 2


def _with_an_ended_job(controller_factory: Any, tmp_path: Path) -> Any:
    """A controller holding ``held`` (an open incident keeps it) whose ``old-a`` ran two
    ranks, checkpointed step 2 and exited, then left memory after ``job_retention_s``; so
    did ``old-b``, whose ranks started and exited without a step."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(ALERT_ONLY)
    live = controller_factory(job_retention_s=1.0, policy_file=policy)
    running = job_records([ENDED, HELD], world=WORLD)
    running["checkpoints"] = [
        {"job": ENDED, "rank": rank, "step": 2, "kind": "committed", "time_unix_s": time.time()}
        for rank in range(WORLD)
    ]
    live.report(report("n1", 0, gpus=WORLD, samples=1, job=running))
    exited = job_records([ENDED, NO_STEPS], world=WORLD, exited=True)
    exited["steps"] = [s for s in exited["steps"] if s["job"] == ENDED]
    live.report(report("n1", 1, gpus=WORLD, samples=1, job=exited))
    open_incident(live, "comm_failure", job=HELD)
    wait_for(lambda: live.controller.state.jobs.keys() == {HELD}, timeout_s=30)
    return live


def _get(live: Any, path: str) -> Any:
    return http_calls.get(f"{live.url}/api/v1{path}", headers=live.headers("viewer"), timeout=10)


@SQLITE
@pytest.mark.usefixtures("fast_remediation_engine")
def test_an_ended_job_answers_its_routes_and_the_cli_lists_and_shows_it(
    controller_factory: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live = _with_an_ended_job(controller_factory, tmp_path)

    # Its checkpoints are stored: served as for a live job. 404 only for a job never stored.
    checkpoints = _get(live, f"/jobs/{ENDED}/checkpoints")
    assert checkpoints.status_code == 200, checkpoints.text
    assert sorted((c["step"], c["rank"], c["kind"]) for c in checkpoints.json()["data"]) == [
        (2, rank, "committed") for rank in range(WORLD)
    ]
    assert _get(live, f"/jobs/{NEVER}/checkpoints").status_code == 404
    # Step times live in memory only: 404, saying the job ended rather than "next report".
    steps = _get(live, f"/jobs/{NO_STEPS}/steps")
    assert steps.status_code == 404, steps.text
    assert "ended" in steps.json()["detail"], steps.text
    assert "next report" not in steps.json()["detail"], steps.text
    never = _get(live, f"/jobs/{NEVER}/steps")
    assert never.status_code == 404
    assert "ended" not in never.json()["detail"], never.text
    # Its goodput record left memory with it: 404 that says so; restarting it is a 409
    # (nothing runs to restart), not "not found"; a job never stored is 404 for both.
    goodput = _get(live, f"/jobs/{ENDED}/goodput")
    assert goodput.status_code == 404 and "ended" in goodput.json()["detail"], goodput.text
    assert "ended" not in _get(live, f"/jobs/{NEVER}/goodput").json()["detail"]
    for job, status, said in ((ENDED, 409, "nothing runs to restart"), (NEVER, 404, "not found")):
        restart = http_calls.post(
            f"{live.url}/api/v1/jobs/{job}/restart",
            json={"reason": "check"},
            headers=live.headers("operator"),
            timeout=10,
        )
        assert restart.status_code == status and said in restart.json()["detail"], restart.text

    cli: Callable[..., CliResult] = in_process_cli(capsys, monkeypatch, live.url, live.viewer_token)
    # The default list is memory's; --history lists the stored job, marked as ended.
    assert cli("jobs", "-o", "name") == CliResult(0, f"job/{HELD}\n", "")
    listed = cli("jobs", "--history")
    assert listed.code == 0, listed.err
    header, *rows = [line.split() for line in listed.out.splitlines()]
    assert header[:3] == ["NAME", "STATE", "SOURCE"]
    assert [row[:3] for row in rows] == [
        [HELD, "running", "live"],
        [ENDED, "ended", "history"],
        [NO_STEPS, "ended", "history"],
    ]
    as_json = cli("jobs", "--history", "-o", "json")
    api = live.read("/api/v1/jobs", history="true")
    assert json.loads(as_json.out) == api["data"]

    # One job: the stored one says it ended, with its ranks as last written.
    shown = cli("job", ENDED)
    assert shown.code == 0, shown.err
    lines = shown.out.splitlines()
    assert lines[1].startswith("State:") and "ended (left the controller's memory" in lines[1]
    ranks = [line.split() for line in lines[lines.index("") + 1 :]]
    assert ranks[0][:4] == ["RANK", "NODE", "GPU", "STATE"]
    assert [r[:5] for r in ranks[1:]] == [[str(r), "n1", str(r), "exited", "2"] for r in (0, 1)]
    assert json.loads(cli("job", ENDED, "-o", "json").out) == live.read(f"/api/v1/jobs/{ENDED}")
    held = cli("job", HELD)
    assert held.code == 0 and held.out.splitlines()[1].split() == ["State:", "running"]
    assert cli("job", NEVER) == CliResult(2, "", f'error: job "{NEVER}" not found\n')


@SQLITE
@pytest.mark.slow
@pytest.mark.usefixtures("fast_remediation_engine")
def test_kubectl_trainguard_lists_and_shows_an_ended_job(
    controller_factory: Any,
    tmp_path: Path,
    kubectl_bin: Path,  # noqa: F811
) -> None:
    live = _with_an_ended_job(controller_factory, tmp_path)
    server = CliServer(live.url, live.viewer_token, live.agent_token)
    env = _env(server, tmp_path)

    def plugin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kubectl_bin), "trainguard", *args], capture_output=True, text=True, env=env
        )

    listed = plugin("jobs", "--history", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert [(j["name"], j["state"], j["source"]) for j in json.loads(listed.stdout)] == [
        (HELD, "running", "live"),
        (ENDED, "ended", "history"),
        (NO_STEPS, "ended", "history"),
    ]
    shown = plugin("job", ENDED)
    assert shown.returncode == 0, shown.stderr
    assert "State:" in shown.stdout and "ended (left the controller's memory" in shown.stdout
    missing = plugin("job", NEVER)
    assert (missing.returncode, missing.stderr) == (2, f'error: job "{NEVER}" not found\n')
