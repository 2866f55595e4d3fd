"""Every command that names a node checks the name by one rule (``client.node_name``, the
wire's NAME_PATTERN) before any request: one line, exit 2. Only ``agent-token`` did; the
others sent ``Node-A`` or ``../x`` and answered "not found" (or, for ``incidents --node``,
an empty list)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.cli.cli_testkit import CliResult
from trainguard.ports import free_port

Cli = Callable[..., CliResult]

COMMANDS = [
    ["node", "{}"],
    ["isolate", "{}", "--reason", "drill"],
    ["release", "{}"],
    ["preflight", "node-a", "{}"],
    ["incidents", "--node", "{}"],
    ["agent-token", "issue", "{}"],
    ["agent-token", "revoke", "{}"],
]


@pytest.mark.parametrize("name", ["Node-A", "../x", "a/b", "..", "a-", "node_a", "a" * 254])
@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: " ".join(args[:2]))
def test_a_bad_node_name_is_refused_before_any_request(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, args: list[str], name: str
) -> None:
    # Nothing listens here: a request would be exit 1 (unreachable), not this usage error.
    monkeypatch.setenv("TRAINGUARD_SERVER", f"http://127.0.0.1:{free_port()}")
    result = cli(*[a.format(name) for a in args])
    assert result.code == 2 and result.out == "", (result.out, result.err)
    assert result.err.count("\n") == 1 and "Traceback" not in result.err, result.err
    assert result.err.startswith("error: invalid node name "), result.err
    assert "lowercase DNS name" in result.err
