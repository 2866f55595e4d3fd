"""The on-call sweep: what a hostile or broken controller can put on an operator's terminal,
kubectl's spellings of its own flags, and where a usage error sends the user for help.

Everything runs in-process against a small canned HTTP server (no controller needed): each
test says what the "controller" answers and reads what the CLI printed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli.cli_testkit import Canned, CliResult, canned_server
from tests.cli.conftest import in_process_cli
from trainguard.cli.kubeproxy import hoist_kube_flags

Cli = Callable[..., CliResult]

#: What a terminal would act on: escape sequences (CSI, OSC), BEL, carriage return.
TERMINAL_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
#: A label, a reason or an evidence key that tries to clear the screen, retitle the
#: window, paint the rest red and start a line of its own.
EVIL = "x\x1b[2J\x1b]0;owned\x07\x1b[31m\r\nnode/forged"


@pytest.fixture
def canned() -> Iterator[tuple[str, Canned]]:
    with canned_server() as served:
        yield served


@pytest.fixture
def cli(
    canned: tuple[str, Canned],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Cli:
    return in_process_cli(capsys, monkeypatch, canned[0], "viewer-token")


def _page(*items: dict[str, Any]) -> dict[str, Any]:
    return {"data": list(items), "count": len(items)}


NODE = {"name": "node-a", "health": "unhealthy", "gpu_count": 8, "backend": "nvml"}

#: command line -> (the controller's answer, how many lines the output must have).
HOSTILE = {
    "node: label key and health reason": (
        ["node", "node-a"],
        NODE | {"health_reason": EVIL, "labels": {EVIL: "v", "rack": EVIL}, "gpus": []},
        13,  # 11 describe lines, a blank line, "No GPUs reported."
    ),
    "status: health and incident kinds": (
        ["status"],
        {
            "version": "1.0",
            "nodes_total": 1,
            "nodes_by_health": {EVIL: 1},
            "incidents_open_by_kind": {EVIL: EVIL},
        },
        9,
    ),
    "nodes -o name": (["nodes", "-o", "name"], _page(NODE | {"name": EVIL}), 1),
    "actions -o wide: params key": (
        ["actions", "-o", "wide"],
        _page({"id": 1, "kind": "cordon_node", "params": {EVIL: EVIL}, "outcome": EVIL}),
        2,
    ),
    "incidents -o wide: evidence key": (
        ["incidents", "--state", "all", "-o", "wide"],
        _page({"id": 1, "kind": "not_a_kind", "evidence": {EVIL: 1}, "summary": EVIL}),
        2,
    ),
    "policy: guard rail name": (
        ["policy"],
        {"policy": {"rules": [{"kind": EVIL}], "guards": {EVIL: 1}, "restarts": {}}},
        4,
    ),
    "plan get: layout, NCCL env, changes, source ports": (
        ["plan", "get", "p1", "-o", "wide"],
        {
            "plan_id": "p1",
            "layout": {EVIL: EVIL},
            "nccl_env": {EVIL: EVIL},
            "versions": [{"version": 1, "changes": [{"link": EVIL, "health": EVIL}]}],
            "source_ports": {"nodes": {EVIL: [{"nic": "mlx5_0", "path": [EVIL, "spine-1"]}]}},
        },
        21,
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_server_text_cannot_drive_the_terminal_nor_forge_lines(
    cli: Cli, canned: tuple[str, Canned], case: str
) -> None:
    """Every cell, key and describe line is server text: no escape sequence, no BEL, no
    carriage return, and no line break of its own (a forged ``node/forged`` line under
    ``-o name`` would feed ``xargs`` a node nobody has)."""
    args, body, lines = HOSTILE[case]
    canned[1].body = body
    result = cli(*args)
    assert result.code == 0, result.err
    assert not TERMINAL_CONTROL.search(result.out), repr(result.out)
    assert "owned" not in result.out  # the OSC's payload goes with it
    assert len(result.out.splitlines()) == lines, result.out
    assert not any(line.startswith("node/forged") for line in result.out.splitlines())


def test_node_describe_keeps_one_line_per_field(cli: Cli, canned: tuple[str, Canned]) -> None:
    canned[1].body = NODE | {"health_reason": EVIL, "labels": {EVIL: "v"}, "gpus": []}
    out = cli("node", "node-a").out
    labels = [line for line in out.splitlines() if line.startswith("Labels:")]
    assert labels == ["Labels:         x node/forged=v"], out
    health = [line for line in out.splitlines() if line.startswith("Health:")]
    assert health == ["Health:         unhealthy (x node/forged)"], out


def test_json_and_yaml_stay_exact_for_hostile_text(cli: Cli, canned: tuple[str, Canned]) -> None:
    """The structured formats are data, not terminal text: every byte survives (escaped)."""
    nodes = [
        NODE | {"name": EVIL, "labels": {EVIL: EVIL, "ü": "✓" * 300}},
        NODE | {"name": "n" * 253, "power_w": 0.1 + 0.2, "big": 2**70},
    ]
    canned[1].body = _page(*nodes)
    as_json = cli("nodes", "-o", "json")
    assert as_json.code == 0 and json.loads(as_json.out) == nodes
    assert "\x1b" not in as_json.out  # JSON escapes control characters itself
    as_yaml = cli("nodes", "-o", "yaml")
    assert as_yaml.code == 0 and yaml.safe_load(as_yaml.out) == nodes
    assert "\x1b" not in as_yaml.out


@pytest.mark.parametrize(
    ("args", "plural"),
    [
        (["nodes"], "nodes"),
        (["jobs"], "jobs"),
        (["incidents", "--state", "all"], "incidents"),
        (["actions"], "actions"),
        (["plan", "list"], "plans"),
    ],
)
def test_empty_lists_in_every_format(
    cli: Cli, canned: tuple[str, Canned], args: list[str], plural: str
) -> None:
    canned[1].body = _page()
    for fmt in ("table", "wide", "name"):
        result = cli(*args, "-o", fmt)
        assert (result.code, result.out, result.err) == (0, "", f"No {plural} found.\n"), fmt
    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        result = cli(*args, "-o", fmt)
        assert result.code == 0 and result.err == "" and load(result.out) == [], fmt


# ------------------------------------------------------------------ kubectl's spellings


@pytest.mark.parametrize(
    ("argv", "hoisted"),
    [
        (["nodes", "-n=tg-system"], ["-ntg-system", "nodes"]),
        (["nodes", "-ntg-system"], ["-ntg-system", "nodes"]),
        (["nodes", "--namespace=tg-system"], ["--namespace=tg-system", "nodes"]),
        (["nodes", "-n="], ["-n=", "nodes"]),  # no value: refused as before
    ],
)
def test_kubectl_short_namespace_with_equals(argv: list[str], hoisted: list[str]) -> None:
    assert hoist_kube_flags(argv) == hoisted


def test_namespace_given_as_kubectl_writes_it_reaches_the_proxy_path(
    cli: Cli, canned: tuple[str, Canned], tmp_path: Path
) -> None:
    """``kubectl trainguard nodes -n=tg-system`` (pflag's form): the namespace is
    ``tg-system``, not ``=tg-system`` (which is no DNS label, so it was refused)."""
    url, answer = canned
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "kube-token"}}],
                "contexts": [{"name": "prod", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "prod",
            }
        )
    )
    answer.body = _page(NODE)
    result = cli("nodes", "--kubeconfig", str(kubeconfig), "-n=tg-system", "-o", "name")
    assert (result.code, result.out, result.err) == (0, "node/node-a\n", "")
    assert answer.seen[0].startswith(
        "GET /api/v1/namespaces/tg-system/services/trainguard:http/proxy/api/v1/nodes?"
    )


# ------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    ("args", "command"),
    [
        (["nodes", "--health"], "trainguard nodes"),
        (["nodes", "-o"], "trainguard nodes"),
        (["--server", "http://127.0.0.1:9", "incidents", "--kind"], "trainguard incidents"),
        (["agent-token", "issue", "-o"], "trainguard agent-token issue"),
        (["plan", "get", "p1", "-o"], "trainguard plan get"),
        (["--server"], "trainguard"),
    ],
)
def test_an_option_without_its_value_points_to_its_command_help(
    cli: Cli, args: list[str], command: str
) -> None:
    """The parser raises this error without a context; the hint must still name the
    command whose option it is, not the root (whose help does not list it)."""
    result = cli(*args)
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1 and "requires an argument" in result.err
    assert result.err.rstrip().endswith(f"(see '{command} --help')"), result.err


def test_ctrl_c_is_exit_130_without_a_traceback(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.cli.client import ApiClient

    def interrupted(*_args: object, **_kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ApiClient, "nodes", interrupted)
    result = cli("nodes")
    assert result.code == 130 and result.out == ""
    assert "Traceback" not in result.err and "KeyboardInterrupt" not in result.err
