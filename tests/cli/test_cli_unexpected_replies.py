"""Answers the CLI cannot trust, and input it must refuse before asking (acceptance probe).

A server (a wrong service on the port, a proxy, an older or broken controller) may answer
200 with a body of another shape. Write commands must not report success the answer does
not confirm, reads must not show "No nodes found.", and no message may be a Python
exception's text. Text the server sends must not drive the terminal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.api.handlers import payload_too_large
from tests import http_calls
from tests.cli.cli_testkit import Canned, CliResult, CliServer, canned_server
from trainguard import wire

Cli = Callable[..., CliResult]


@pytest.fixture
def fake() -> Iterator[tuple[str, Canned]]:
    with canned_server() as served:
        yield served


def _one_line(result: CliResult, code: int) -> str:
    assert result.code == code, (result.out, result.err)
    assert result.out == ""
    assert result.err.endswith("\n") and result.err.count("\n") == 1, result.err
    assert result.err.startswith("error: ")
    return result.err.strip()


COMMANDS = {
    "status": (["status"], "GET /api/v1/status"),
    "nodes": (["nodes"], "GET /api/v1/nodes"),
    "node": (["node", "node-a"], "GET /api/v1/nodes/node-a"),
    "jobs": (["jobs"], "GET /api/v1/jobs"),
    "incidents": (["incidents"], "GET /api/v1/incidents"),
    "actions": (["actions"], "GET /api/v1/actions"),
    "isolate": (["isolate", "node-a", "--reason", "x"], "POST /api/v1/nodes/node-a/isolate"),
    "release": (["release", "node-a"], "POST /api/v1/nodes/node-a/release"),
    "issue": (["agent-token", "issue", "node-a"], "POST /api/v1/agent-credentials/node-a"),
    "revoke": (["agent-token", "revoke", "node-a"], "DELETE /api/v1/agent-credentials/node-a"),
    "preflight": (["preflight", "node-a"], "POST /api/v1/nodes/node-a/preflight"),
}

SHAPES = {
    "object-without-fields": b'{"foo": 1}',
    "list": b"[1, 2, 3]",
    "null-data": b'{"data": null, "count": 0}',
    "null": b"null",
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("command", COMMANDS)
def test_unexpected_answer_is_one_plain_line_exit_1(
    cli: Cli, fake: tuple[str, Canned], command: str, shape: str
) -> None:
    url, canned = fake
    canned.body = SHAPES[shape]
    args, route = COMMANDS[command]
    message = _one_line(cli("--server", url, *args), 1)
    assert message.startswith(f"error: controller at {url} sent an unexpected answer to {route}: ")
    for internal in ("KeyError", "TypeError", "AttributeError", "NoneType", "TRAINGUARD_DEBUG"):
        assert internal not in message


def test_list_without_its_list_is_not_an_empty_list(cli: Cli, fake: tuple[str, Canned]) -> None:
    url, canned = fake
    canned.body = b'{"foo": 1}'
    for args in (["nodes"], ["nodes", "-o", "json"], ["jobs"], ["incidents"], ["actions"]):
        message = _one_line(cli("--server", url, *args), 1)
        assert message.endswith(": data: missing"), message


ISOLATE = ["isolate", "node-a", "--reason", "x"]


@pytest.mark.parametrize(
    ("args", "answer"),
    [
        # the node stays as it was: no confirmation of the isolation
        (ISOLATE, {"node": "node-a", "isolated": False, "outcome": "done"}),
        (["release", "node-a"], {"node": "node-a", "isolated": True, "outcome": "done"}),
        # another node's answer
        (ISOLATE, {"node": "node-b", "isolated": True, "outcome": "done"}),
        # no outcome to show, or not a boolean
        (ISOLATE, {"node": "node-a", "isolated": True}),
        (ISOLATE, {"node": "node-a", "isolated": "yes", "outcome": "done"}),
    ],
)
def test_write_commands_need_a_confirming_answer(
    cli: Cli, fake: tuple[str, Canned], args: list[str], answer: dict[str, object]
) -> None:
    url, canned = fake
    canned.body = json.dumps(answer).encode()
    message = _one_line(cli("--server", url, *args), 1)
    assert "sent an unexpected answer to POST /api/v1/nodes/node-a/" in message


def test_confirmed_isolation_prints_the_outcome(cli: Cli, fake: tuple[str, Canned]) -> None:
    url, canned = fake
    canned.body = b'{"node": "node-a", "isolated": true, "action": 7, "outcome": "cordoned"}'
    result = cli("--server", url, "isolate", "node-a", "--reason", "x")
    assert (result.code, result.out, result.err) == (0, "node/node-a isolated: cordoned\n", "")


def test_server_text_is_capped_and_cannot_drive_the_terminal(
    cli: Cli, fake: tuple[str, Canned]
) -> None:
    url, canned = fake
    canned.status, canned.content_type = 502, "text/html"
    canned.body = ("\x1b]0;owned\x07\x1b[2J\x1b[31mred" + "A" * 5000 + "\rB\n2nd").encode()
    message = _one_line(cli("--server", url, "nodes"), 1)
    assert message.startswith(f"error: controller at {url} answered 502: redAAA")
    assert "owned" not in message and "\x1b" not in message and "\r" not in message
    assert message.endswith("...") and len(message) < 400

    canned.status, canned.content_type = 422, "application/json"
    canned.body = json.dumps({"detail": "bad \x1b[2J\x9b1m thing \x07"}).encode()
    message = _one_line(cli("--server", url, "nodes"), 2)
    assert message == "error: controller rejected the request: bad thing"

    # The name is echoed back, escaped; no node can have it, so nothing is asked.
    seen = len(canned.seen)
    message = _one_line(cli("--server", url, "node", "a\x1b]0;t\x07b"), 2)
    assert message.startswith("error: invalid node name 'a\\x1b]0;t\\x07b': expected")
    assert "\x1b" not in message and "\x07" not in message and len(canned.seen) == seen


def test_table_cells_drop_escape_sequences(cli: Cli, fake: tuple[str, Canned]) -> None:
    url, canned = fake
    node = {"name": "node-a\x1b[2J\x1b]0;t\x07", "health": "healthy"}
    canned.body = json.dumps({"data": [node], "count": 1}).encode()
    result = cli("--server", url, "nodes")
    assert result.code == 0, result.err
    assert "\x1b" not in result.out and "\x07" not in result.out
    assert result.out.splitlines()[1].startswith("node-a ")


@pytest.mark.parametrize("reason", ["", "   "])
def test_empty_reason_is_refused_before_asking(
    cli: Cli, fake: tuple[str, Canned], reason: str
) -> None:
    url, canned = fake
    for args in (
        ["isolate", "node-a", "--reason", reason],
        ["release", "node-a", "--reason", reason],
    ):
        message = _one_line(cli("--server", url, *args), 2)
        assert message.startswith("error: --reason must not be empty")
    assert canned.seen == []


@pytest.mark.parametrize("name", ["../x", "Node-A", "a/b", "a-", "a" * 254, "node_a"])
def test_agent_token_checks_the_node_name_before_asking(
    cli: Cli, fake: tuple[str, Canned], name: str
) -> None:
    url, canned = fake
    for verb in ("issue", "revoke"):
        message = _one_line(cli("--server", url, "agent-token", verb, name), 2)
        assert message.startswith("error: invalid node name "), message
        assert "lowercase DNS name" in message
    assert canned.seen == []


def test_a_file_that_is_not_a_kubeconfig(cli: Cli, tmp_path: Path) -> None:
    for name, text in (("word", "just-a-hostname\n"), ("list", "- 1\n- 2\n"), ("bad", "a: [\n")):
        path = tmp_path / name
        path.write_text(text)
        message = _one_line(cli("status", "--kubeconfig", str(path)), 2)
        assert message.startswith(f"error: {path} is not a kubeconfig ("), message


def test_413_names_reports_only_on_the_report_route(cli_server: CliServer) -> None:
    """An operator's oversized request is told the limit, not how agents batch reports."""
    big = b'{"domains": [' + b" " * (wire.MAX_REPORT_BYTES + 10) + b"]}"
    reply = http_calls.put(
        f"{cli_server.url}{wire.API_PREFIX}/power/domains",
        content=big,
        headers={
            "Authorization": f"Bearer {cli_server.viewer_token}",
            "content-type": "application/json",
        },
        timeout=30,
    )
    assert reply.status_code == 413
    detail = reply.json()["detail"]
    assert str(wire.MAX_REPORT_BYTES) in detail and "report" not in detail
    assert "send smaller reports" in payload_too_large(10, reports=True).message
    assert "report" not in payload_too_large(10).message
