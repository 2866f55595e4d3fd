"""``kubectl trainguard`` through a real kubectl binary's plugin mechanism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.cli_k8s_tools import ToolUnavailable, kubectl
from tests.cli.cli_testkit import NODES, CliServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kubectl_bin() -> Path:
    try:
        return kubectl()
    except ToolUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no kubectl here: {exc}")


def _env(cli_server: CliServer, tmp_path: Path) -> dict[str, str]:
    bindir = Path(sys.executable).parent
    if not (bindir / "kubectl-trainguard").exists():
        pytest.fail("kubectl-trainguard is not installed next to python; run `make venv`")
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),  # no user kubeconfig: plugins need none
        "TRAINGUARD_SERVER": cli_server.url,
        "TRAINGUARD_TOKEN": cli_server.viewer_token,
    }


def test_kubectl_lists_and_runs_the_plugin(
    kubectl_bin: Path, cli_server: CliServer, tmp_path: Path
) -> None:
    env = _env(cli_server, tmp_path)
    listed = subprocess.run(
        [str(kubectl_bin), "plugin", "list"], capture_output=True, text=True, env=env
    )
    assert listed.returncode == 0, listed.stderr
    assert str(Path(sys.executable).parent / "kubectl-trainguard") in listed.stdout

    nodes = subprocess.run(
        [str(kubectl_bin), "trainguard", "nodes", "-o", "json"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert nodes.returncode == 0, nodes.stderr
    assert sorted(n["name"] for n in json.loads(nodes.stdout)) == sorted(NODES)

    helped = subprocess.run(
        [str(kubectl_bin), "trainguard", "--help"], capture_output=True, text=True, env=env
    )
    assert helped.returncode == 0 and "Usage: kubectl trainguard" in helped.stdout

    bad = subprocess.run(
        [str(kubectl_bin), "trainguard", "node", "nope"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2
    assert bad.stderr == 'error: node "nope" not found\n'
