"""The operator's hands in the plugin: isolate says which jobs still run on the node, and
``restart`` / ``approve`` do what the dashboard's buttons do, against a live controller
whose engine has a recording actuator (job ``gpt`` on n0 and n1)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests import http_calls
from tests.cli.cli_testkit import CliResult
from tests.cli.conftest import in_process_cli
from tests.remediation.test_engine import Agents, actions, open_incident, recording

Cli = Callable[..., CliResult]


@pytest.fixture
def operator(
    controller_factory: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Cli]:
    live = controller_factory()
    agents = Agents(live)
    for i in range(4):
        agents.report(f"n{i}")
    agents.steps("n1", "gpt", [(1, time.time())])  # a rank of gpt runs on n1
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    return live, actuator, in_process_cli(capsys, monkeypatch, live.url, live.operator_token)


def test_isolate_names_the_jobs_it_leaves_running_and_restart_moves_them(
    operator: tuple[Any, Any, Cli],
) -> None:
    live, actuator, cli = operator
    isolated = cli("isolate", "n1", "--reason", "bad fan")
    assert isolated.code == 0, isolated.err
    lines = isolated.out.splitlines()
    assert lines[0].startswith("node/n1 isolated: ")
    assert lines[1] == (
        "still running there: gpt; isolation does not move them: "
        "trainguard restart gpt --reason 'bad fan'"
    )
    quiet = cli("isolate", "n3", "--reason", "spare check")  # nothing runs on n3
    assert quiet.code == 0 and len(quiet.out.splitlines()) == 1, quiet.out
    restarted = cli("restart", "gpt", "--reason", "move off n1")
    assert restarted.code == 0, restarted.err
    assert restarted.out.startswith("job/gpt restarted: ")
    assert [m for m, _ in actuator.calls].count("restart_job") == 1
    row = next(a for a in actions(live) if a["kind"] == "restart_job")
    assert row["trigger"].startswith("operator:"), row
    assert "move off n1" in row["outcome"]


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["restart", "gpt", "--reason", "  "], 2, "--reason must not be empty"),
        (["restart", "no-such-job", "--reason", "x"], 2, "job 'no-such-job' not found"),
        (["restart", "gpt"], 2, "missing option '--reason'"),
        (["approve", "0"], 2, "greater than or equal to 1"),
        (["approve", "999999"], 2, "action 999999 not found"),
        (["approve", "x"], 2, "valid integer"),
    ],
)
def test_refusals_are_one_line_with_their_exit_status(
    operator: tuple[Any, Any, Cli], args: list[str], code: int, fragment: str
) -> None:
    *_, cli = operator
    result = cli(*args)
    assert result.code == code, (result.out, result.err)
    assert fragment in result.err and len(result.err.splitlines()) == 1, result.err


def test_approve_carries_out_a_dry_run_once(operator: tuple[Any, Any, Cli]) -> None:
    live, actuator, cli = operator
    assert cli("restart", "gpt", "--reason", "warm up").code == 0  # the engine knows gpt
    dry_run = http_calls.request(
        "PATCH",
        f"{live.url}/api/v1/remediation/policy",
        json={"dry_run": True},
        headers=live.headers("operator"),
        timeout=10,
    )
    assert dry_run.status_code == 200, dry_run.text
    before = len([m for m, _ in actuator.calls if m == "isolate_node"])
    open_incident(live, "gpu_fault", node="n1", severity="critical")
    deadline = time.monotonic() + 15
    dry: list[dict[str, Any]] = []
    while not dry and time.monotonic() < deadline:
        dry = [a for a in actions(live) if a["kind"] == "isolate_node" and a["status"] == "dry_run"]
        time.sleep(0.1)
    assert dry, actions(live)
    approved = cli("approve", str(dry[0]["id"]))
    assert approved.code == 0, approved.err
    assert approved.out.startswith(f"action/{dry[0]['id']} approved: ")
    assert len([m for m, _ in actuator.calls if m == "isolate_node"]) == before + 1
    again = cli("approve", str(dry[0]["id"]))
    assert again.code == 2 and "approved already" in again.err, again.err
