"""A real controller process, fed real reports, for the CLI tests (one per test session).

The CLI is exercised in-process through :func:`trainguard.cli.app.run` (fast, and pytest
captures stdout/stderr), and as a subprocess where the console script itself matters.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli.cli_testkit import (
    CliResult,
    CliServer,
    controller_ready,
    feed,
    has_incident,
    seed_actions,
)
from tests.environ import clean_env
from trainguard.cli.app import run
from trainguard.cli.procs import ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    workdir = tmp_path_factory.mktemp("cli-controller")
    port = free_port()
    server = CliServer(
        url=f"http://127.0.0.1:{port}",
        viewer_token=secrets.token_urlsafe(24),
        agent_token=secrets.token_urlsafe(24),
    )
    tokens = [
        {"name": "cli-agent", "role": "agent", "token": server.agent_token},
        {"name": "cli-viewer", "role": "viewer", "token": server.viewer_token},
    ]
    env = clean_env()
    # The listings are checked against a fixed data set: the remediation engine, which
    # would add its own actions for the fed incidents, stays off.
    policy = workdir / "policy.json"
    policy.write_text(json.dumps({"enabled": False}))
    env |= {
        "TRAINGUARD_TOKENS": json.dumps(tokens),
        "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",  # one token for the fed nodes
        "TRAINGUARD_NODE_LOST_AFTER_S": "3600",
        "TRAINGUARD_POLICY_FILE": str(policy),
    }
    database_url = f"sqlite:///{workdir / 'tg.db'}"
    argv = cli_argv("controller", "--port", str(port), "--database-url", database_url)
    with ProcessSet(workdir / "logs") as procs:
        child = procs.start("controller", argv, env=env)
        up = wait_until(lambda: controller_ready(server.url) or not child.alive(), timeout_s=60)
        assert up and child.alive(), child.log_tail(40)
        feed(server)
        seed_actions(database_url)
        wait_until(lambda: has_incident(server), timeout_s=10)
        yield server


@pytest.fixture
def cli(
    cli_server: CliServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., CliResult]:
    """Run the CLI in-process against the session's controller (token from the env)."""
    return in_process_cli(capsys, monkeypatch, cli_server.url, cli_server.viewer_token)


def in_process_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, token: str
) -> Callable[..., CliResult]:
    """``trainguard ARGS...`` run in this process against ``url`` with ``token`` (from the
    environment, as a user sets them), returning its exit status and what it printed."""
    monkeypatch.setenv("TRAINGUARD_SERVER", url)
    monkeypatch.setenv("TRAINGUARD_TOKEN", token)
    monkeypatch.delenv("TRAINGUARD_DEBUG", raising=False)

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        code = run(list(args), prog_name="trainguard")
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return invoke


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
