"""``kubectl trainguard`` reaches the controller like kubectl reaches a Service.

A real HTTPS server stands in for the API server's service proxy (tests/cli/
kube_proxy_standin.py) in front of the session's real controller; a generated kubeconfig
names it with a bearer-token user and a client-certificate user. The plugin is run
in-process and through a real kubectl binary's plugin mechanism.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli.cli_k8s_tools import ToolUnavailable, kubectl
from tests.cli.cli_testkit import NODES, CliResult, CliServer
from tests.cli.kube_proxy_standin import (
    OpensslMissing,
    ProxyServer,
    ProxyStandin,
    make_pki,
    write_kubeconfig,
)
from trainguard.cli.errors import BadInput
from trainguard.cli.kubeproxy import TOKEN_HEADER, hoist_kube_flags

Cli = Callable[..., CliResult]
NAMESPACE = "tg-system"
SERVICE = "tg-trainguard"


@pytest.mark.parametrize(
    ("argv", "hoisted"),
    [
        (["nodes", "-n", "x", "-o", "json"], ["-n", "x", "nodes", "-o", "json"]),
        (["nodes", "--context=prod", "-ntg"], ["--context=prod", "-ntg", "nodes"]),
        (["node", "a", "--kubeconfig", "k", "--service", "s"],
         ["--kubeconfig", "k", "--service", "s", "node", "a"]),
        (["isolate", "n1", "--", "-n", "x"], ["isolate", "n1", "--", "-n", "x"]),
        (["--server", "http://x:1", "nodes"], ["--server", "http://x:1", "nodes"]),
    ],
)  # fmt: skip
def test_kubectl_global_flags_move_before_the_command(argv: list[str], hoisted: list[str]) -> None:
    assert hoist_kube_flags(argv) == hoisted


@pytest.mark.parametrize("argv", [["nodes", "-s", "https://api:6443"], ["nodes", "--context"]])
def test_bad_kubectl_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(BadInput):
        hoist_kube_flags(argv)


@pytest.fixture(scope="module")
def standin(
    cli_server: CliServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyStandin, Path]]:
    root = tmp_path_factory.mktemp("kube-standin")
    try:
        pki = make_pki(root)
    except OpensslMissing as exc:
        pytest.skip(str(exc))
    state = ProxyStandin(
        backend=cli_server.url, namespace=NAMESPACE, service=SERVICE, token="kube-token-abc"
    )
    with ProxyServer(state, pki):
        kubeconfig = write_kubeconfig(root / "config", state.url, pki, state.token)
        yield state, kubeconfig


@pytest.mark.slow
def test_reads_go_through_the_service_proxy_with_kubeconfig_credentials(
    cli: Cli, cli_server: CliServer, standin: tuple[ProxyStandin, Path]
) -> None:
    state, kubeconfig = standin
    state.seen.clear()
    # Flags beat TRAINGUARD_SERVER (set by the fixture), and stand after the command.
    result = cli("nodes", "-o", "json", "--kubeconfig", str(kubeconfig),
                 "--context", "token", "-n", NAMESPACE, "--service", SERVICE)  # fmt: skip
    assert result.code == 0, result.err
    assert sorted(n["name"] for n in json.loads(result.out)) == sorted(NODES)
    first = state.seen[0]
    assert first["user"] == "token-user" and first["path"] == "/api/v1/nodes"
    # The kube token authenticated the user and went no further; the controller's travelled.
    headers = {k.lower(): v for k, v in first["headers"].items()}
    assert "authorization" not in headers
    assert headers[TOKEN_HEADER.lower()] == cli_server.viewer_token


@pytest.mark.slow
def test_client_certificate_context_and_env_namespace(
    cli: Cli, standin: tuple[ProxyStandin, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    state, kubeconfig = standin
    state.seen.clear()
    monkeypatch.setenv("TRAINGUARD_NAMESPACE", NAMESPACE)
    monkeypatch.setenv("TRAINGUARD_SERVICE", SERVICE)
    result = cli("--kubeconfig", str(kubeconfig), "incidents", "-o", "name")
    assert result.code == 0, result.err
    assert result.out.startswith("incident/")
    assert {s["user"] for s in state.seen} == {"alice"}  # the current context's cert user


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["-n", "elsewhere"], 1, 'no controller Service: services "tg-trainguard" not found'),
        (["--context", "wrong-ca"], 1, "CERTIFICATE_VERIFY_FAILED"),
        (["--context", "nope"], 2, "cannot use kubeconfig"),
        (["-n", "Bad_NS"], 2, 'invalid namespace "Bad_NS"'),
    ],
)
def test_unreachable_through_the_proxy_is_one_line_with_a_hint(
    cli: Cli, standin: tuple[ProxyStandin, Path], args: list[str], code: int, fragment: str
) -> None:
    _, kubeconfig = standin
    base = ["--kubeconfig", str(kubeconfig), "--service", SERVICE]
    result = cli("status", *base, *(args if "-n" in args else ["-n", NAMESPACE, *args]))
    assert result.code == code, result.err
    assert result.out == "" and result.err.count("\n") == 1 and fragment in result.err
    if code == 1:
        assert "check --context and -n/--service" in result.err or "set -n" in result.err


@pytest.mark.slow
def test_no_ready_endpoint_and_refused_credentials(
    cli: Cli, standin: tuple[ProxyStandin, Path], tmp_path: Path
) -> None:
    state, kubeconfig = standin
    args = ["--kubeconfig", str(kubeconfig), "-n", NAMESPACE, "--service", SERVICE]
    state.endpoints_ready = False
    try:
        down = cli("nodes", *args)
    finally:
        state.endpoints_ready = True
    assert down.code == 1 and "no ready controller behind service tg-system/tg-trainguard" in (
        down.err
    )
    bad = tmp_path / "config"
    bad.write_text(kubeconfig.read_text().replace("kube-token-abc", "stolen"))
    refused = cli("nodes", "--kubeconfig", str(bad), "--context", "token", *args[2:])
    assert refused.code == 1
    assert refused.err.startswith("error: the API server rejected your kubeconfig credentials")


@pytest.mark.slow
def test_kubectl_runs_the_plugin_through_the_proxy(
    cli_server: CliServer, standin: tuple[ProxyStandin, Path], tmp_path: Path
) -> None:
    """No TRAINGUARD_SERVER: run by kubectl, the plugin uses the kubeconfig, like kubectl."""
    try:
        kubectl_bin = kubectl()
    except ToolUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no kubectl here: {exc}")
    state, kubeconfig = standin
    bindir = Path(sys.executable).parent
    if not (bindir / "kubectl-trainguard").exists():
        pytest.fail("kubectl-trainguard is not installed next to python; run `make venv`")
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(kubeconfig),
        "TRAINGUARD_TOKEN": cli_server.viewer_token,
    }
    state.seen.clear()
    proc = subprocess.run(
        [str(kubectl_bin), "trainguard", "nodes", "-n", NAMESPACE, "--service", SERVICE,
         "--context", "token", "-o", "name"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(f"node/{n}" for n in NODES)
    assert state.seen and state.seen[0]["user"] == "token-user"
    helped = subprocess.run(
        [str(kubectl_bin), "trainguard", "--help"], capture_output=True, text=True, env=env
    )
    assert "--kubeconfig" in helped.stdout and "TRAINGUARD_NAMESPACE" in helped.stdout


def test_help_shows_env_vars_and_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rich markup once swallowed the ``[env: ...]`` text as a tag; it must stay visible."""
    from trainguard.cli.app import run

    monkeypatch.setenv("COLUMNS", "250")
    assert run(["nodes", "--help"], prog_name="trainguard") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "[env: TRAINGUARD_SERVER; default: your kubeconfig when run as kubectl" in text
    assert "else http://127.0.0.1:8470]" in text and "[env: TRAINGUARD_TOKEN]" in text
    assert run(["--help"], prog_name="kubectl trainguard") == 0
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("[env: KUBECONFIG; default: ~/.kube/config]",
                     "[env: TRAINGUARD_NAMESPACE; default: trainguard]",
                     "[env: TRAINGUARD_SERVICE; default: trainguard]"):  # fmt: skip
        assert fragment in text, fragment
