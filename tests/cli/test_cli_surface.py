"""The CLI's public surface, frozen: a renamed flag breaks scripts, so it must break a test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from trainguard.cli.app import (
    OPTIONAL_SUBAPPS,
    build_app,
    command_word,
    mount_optional_subapps,
    program_name,
)
from trainguard.cli.output import human_age

CLIENT = ["--server", "--token", "--output/-o"]
EXPECTED = {
    "<root>": [
        "--server", "--token", "--kubeconfig", "--context", "--namespace/-n", "--service",
        "--version",
    ],
    "actions": CLIENT,
    "agent-token": [],
    "agent-token issue": ["NODE", *CLIENT],
    "agent-token revoke": ["NODE", *CLIENT],
    "agent": [
        "--controller", "--token", "--token-file", "--node-name", "--gpus", "--sim-fault",
        "--sim-fault-file", "--spool-dir", "--socket-path", "--job-listen", "--job-token-file",
        "--client-idle-timeout", "--metrics-port", "--sample-interval", "--report-interval",
        "--report-timeout", "--backoff-max", "--spool-max-bytes", "--metrics-host",
        "--node-base-power-w", "--powercap-dir", "--label", "--log-level", "--sim-seed",
        "--sim-no-permission", "--dev-dir", "--no-foreground/--foreground", "--nvml-timeout",
        "--sysfs-root", "--no-preflight-load/--preflight-load", "--preflight-load-s",
        "--preflight-load-grace", "--preflight-load-command", "--job-flush-steps",
        "--job-flush-min-interval", "--gpu-unreachable-after", "--xid-wait-failing",
    ],
    "controller": ["--host", "--port", "--database-url", "--config", "--dev"],
    "db": [],
    "db upgrade": ["--database-url"],
    "demo": ["--scenario", "--keep-running"],
    "goodput": ["JOB", *CLIENT],
    "incidents": ["--state", "--kind", "--node", "--job", *CLIENT],
    "isolate": ["NODE", "--reason", "--server", "--token"],
    "job": ["NAME", *CLIENT],
    "jobs": ["--history", *CLIENT],
    "leader-label": [
        "--selector", "--pod-namespace", "--port", "--interval", "--once",
    ],
    "node": ["NAME", *CLIENT],
    "nodes": ["--health", *CLIENT],
    "policy": CLIENT,
    "preflight": [
        "NODES", "--local", "--expected-nic-rate-gbps", "--wait", "--gpus", "--dev-dir",
        "--sysfs-root", "--nvml-timeout", "--load-s", *CLIENT,
    ],
    "release": ["NODE", "--reason", "--server", "--token"],
    "remediation": CLIENT,
    "restart": ["JOB", "--reason", "--server", "--token"],
    "approve": ["ACTION", "--server", "--token"],
    "status": CLIENT,
}  # fmt: skip


def _surface(command: Any, path: tuple[str, ...] = ()) -> dict[str, list[str]]:
    params = []
    for p in command.params:
        if p.param_type_name == "argument":
            params.append(p.name.upper())
        else:
            params.append("/".join(sorted(p.opts + p.secondary_opts, key=len, reverse=True)))
    found = {" ".join(path) or "<root>": params}
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        found |= _surface(sub, (*path, name))
    return found


def test_commands_and_flags_are_frozen() -> None:
    # Naming one of our own commands skips the optional sub-apps other packages own.
    command = typer.main.get_command(build_app(["status"]))
    assert _surface(command) == EXPECTED


def test_optional_subapps_mount_only_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    sub = typer.Typer()

    @sub.command()
    def simulate() -> None:
        """A stand-in command."""

    fake = types.ModuleType("power.cli")
    fake.app = sub  # type: ignore[attr-defined]

    monkeypatch.setitem(sys.modules, "power.cli", fake)
    app = typer.Typer()
    mounted = mount_optional_subapps(app, [])
    assert "power" in mounted
    assert set(mounted) <= {name for name, _ in OPTIONAL_SUBAPPS}
    assert mount_optional_subapps(typer.Typer(), ["power"]) == ["power"]
    monkeypatch.setitem(sys.modules, "power.cli", None)  # import of it now fails
    assert "power" not in mount_optional_subapps(typer.Typer(), [])


def test_own_commands_skip_optional_imports() -> None:
    app = build_app(["nodes"])
    assert {g.name for g in app.registered_groups} == {"db", "agent-token"}
    app = build_app(["--server", "http://x:1", "--token", "t", "nodes", "-o", "json"])
    assert {g.name for g in app.registered_groups} == {"db", "agent-token"}


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["nodes"], "nodes"),
        (["--server", "http://x:1", "incidents", "--kind", "gpu_fault"], "incidents"),
        (["-n", "tg", "--context", "prod", "nodes"], "nodes"),
        (["--token", "nodes", "status"], "status"),
        (["--server=http://x:1", "jobs"], "jobs"),
        (["--help"], None),
        ([], None),
    ],
)
def test_command_word_skips_root_option_values(argv: list[str], word: str | None) -> None:
    assert command_word(argv) == word


@pytest.mark.parametrize(
    ("argv0", "name"),
    [
        ("/usr/local/bin/kubectl-trainguard", "kubectl trainguard"),
        ("/venv/bin/trainguard", "trainguard"),
        ("/x/trainguard/cli/__main__.py", "trainguard"),
    ],
)
def test_program_name_follows_invocation(argv0: str, name: str) -> None:
    assert program_name(argv0) == name


def test_kubectl_plugin_script_calls_itself_kubectl_trainguard() -> None:
    script = Path(sys.executable).parent / "kubectl-trainguard"
    if not script.exists():
        pytest.skip("console scripts not installed (pip install -e .)")
    proc = subprocess.run([str(script), "nodes", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "Usage: kubectl trainguard nodes" in proc.stdout


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"), (-3, "0s"), (0, "0s"), (59, "59s"), (119, "119s"), (120, "2m"),
        (200, "3m20s"), (599, "9m59s"), (600, "10m"), (179 * 60, "179m"), (3 * 3600, "3h"),
        (5 * 3600 + 3 * 60, "5h3m"), (8 * 3600, "8h"), (47 * 3600, "47h"), (48 * 3600, "2d"),
        (3 * 86400 + 5 * 3600, "3d5h"), (8 * 86400, "8d"), (800 * 86400, "2y"),
    ],
)  # fmt: skip
def test_age_uses_kubectl_rounding(seconds: float | None, text: str) -> None:
    assert human_age(seconds) == text


def test_read_commands_import_no_service_or_torch() -> None:
    """``trainguard nodes`` must start fast: no FastAPI, SQLAlchemy, agent or torch."""
    code = (
        "import sys\n"
        "from trainguard.cli.app import run\n"
        "run(['nodes', '--server', 'http://127.0.0.1:9'])\n"
        "heavy = {'torch', 'fastapi', 'sqlalchemy', 'uvicorn', 'controller', 'agents', 'power'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
