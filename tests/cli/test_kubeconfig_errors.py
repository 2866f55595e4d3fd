"""A kubeconfig that cannot be used is one line naming it and what is wrong, exit 2.

Through the real CLI where the operator meets it: the controller with the Kubernetes
actuator (``KUBECONFIG``), and the kubectl plugin (``--kubeconfig``). Before, these printed
the client's ``ParserError``/``TypeError``/``SSLError``, ``ActuatorError: ...`` (exit 1), or
a stray ``ERROR:root:`` log line followed by a misleading "connection refused".
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.conftest import Tg

pytestmark = pytest.mark.slow  # each test runs the CLI as a process of its own

HEAD = (
    "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
    "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
)
SERVER = 'clusters: [{name: k, cluster: {server: "https://127.0.0.1:9"}}]\n'
#: name -> (kubeconfig text, what the error line says after "kubeconfig PATH").
BAD = {
    "truncated": (
        "apiVersion: v1\nclusters: [\n",
        " cannot be used: while parsing a flow node expected the node content, but found "
        "'<stream end>' in \"{path}\", line 3, column 1",
    ),
    "list": (
        "- a\n- b\n",
        " is not a kubeconfig (expected a YAML mapping with clusters, contexts and users)",
    ),
    "bad-base64": (
        HEAD + 'clusters: [{name: k, cluster: {server: "https://127.0.0.1:9", '
        'certificate-authority-data: "!!notbase64!!"}}]\n'
        "users: [{name: u, user: {token: abc}}]\n",
        " cannot be used: Invalid base64-encoded string: number of data characters (9) "
        "cannot be 1 more than a multiple of 4",
    ),
    "bad-client-cert": (
        HEAD + SERVER + 'users: [{name: u, user: {client-certificate-data: "aGVsbG8=", '
        'client-key-data: "aGVsbG8="}}]\n',
        ": its client certificate or key cannot be loaded ([SSL] PEM lib",
    ),
    "missing-exec-plugin": (
        HEAD + SERVER + "users: [{name: u, user: {exec: {command: /nonexistent/bin, "
        "apiVersion: client.authentication.k8s.io/v1}}}]\n",
        ": its exec credential plugin failed: [Errno 2] No such file or directory: "
        "'/nonexistent/bin'",
    ),
}


def _env(**extra: str) -> dict[str, str]:
    tokens = [{"name": "v", "role": "viewer", "token": secrets.token_urlsafe(24)}]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINGUARD_", "KUBERNETES_")) and k != "KUBECONFIG"
    }
    return env | {"TRAINGUARD_TOKENS": json.dumps(tokens)} | extra


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(BAD[name][0])
    return path


def _assert_one_line(proc: subprocess.CompletedProcess[str], path: Path, name: str) -> None:
    said = BAD[name][1].format(path=path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: kubeconfig {path}{said}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", sorted(BAD))
def test_controller_refuses_an_unusable_kubeconfig_in_one_line(
    tmp_path: Path, name: str, tg: Tg
) -> None:
    path = _write(tmp_path, name)
    env = _env(TRAINGUARD_ACTUATOR="kubernetes", KUBECONFIG=str(path))
    proc = tg("controller", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/t.db", env=env)
    _assert_one_line(proc, path, name)


@pytest.mark.parametrize("name", ["bad-client-cert", "missing-exec-plugin"])
def test_plugin_refuses_an_unusable_kubeconfig_in_one_line(
    tmp_path: Path, name: str, tg: Tg
) -> None:
    """The plugin parsed these already; its TLS context and the exec plugin's (logged, not
    raised) failure are what reached the user as ``SSLError`` and "connection refused"."""
    path = _write(tmp_path, name)
    proc = tg("--kubeconfig", str(path), "status", env=_env())
    _assert_one_line(proc, path, name)


@pytest.mark.timeout(90)
def test_controller_refuses_a_kubeconfig_that_is_a_fifo_instead_of_waiting_on_it(
    tmp_path: Path, tg: Tg
) -> None:
    """The client's open() of a FIFO waits for a writer for ever: the controller hung at
    start. Every $KUBECONFIG entry that exists is checked first (a missing one is skipped,
    as the client skips it)."""
    fifo = tmp_path / "kubeconfig"
    os.mkfifo(fifo)
    env = _env(TRAINGUARD_ACTUATOR="kubernetes", KUBECONFIG=f"{tmp_path}/absent:{fifo}")
    proc = tg("controller", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/t.db", env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: kubeconfig {fifo} cannot be used: "), proc.stderr
    assert "FIFO" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
