"""``trainguard agent-token issue NODE``: a new agent token bound to one node;
``trainguard agent-token revoke NODE``: end all of a node's tokens now.

The controller keeps only the token's sha256 and prints it once; the node's older tokens
keep working for the controller's ``agent_token_grace_s`` so the new one can be rolled out
(this is how tokens are rotated). The agent then sends it as ``TRAINGUARD_TOKEN`` and may
report only as that node (docs/security.md). Revoking (a node suspected compromised, or
taken out of the cluster) has no grace: the node's next report is refused with 401, until
a new token is issued for it.
"""

from __future__ import annotations

from typing import Annotated

import typer

from trainguard.cli.options import DEFAULT_OUTPUT, Output, Server, Token, connect
from trainguard.cli.output import OutputFormat, dump_json, dump_yaml, emit
from trainguard.cli.replies import printable

group = typer.Typer(
    help="Per-node agent credentials (issue, rotate, revoke).", no_args_is_help=True
)


@group.command("issue")
def issue(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Node the token may report for.")],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Issue (or rotate) NODE's agent token; prints the token once."""
    result = connect(ctx, server, token).agent_credentials(node)
    _emit(result, output, printable(str(result["token"]), None))


@group.command("revoke")
def revoke(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Node whose agent tokens end now.")],
    server: Server = None,
    token: Token = None,
    output: Output = DEFAULT_OUTPUT,
) -> None:
    """Revoke every agent token of NODE at once (its next report is 401); audited."""
    result = connect(ctx, server, token).agent_credentials(node, revoke=True)
    text = f"{result['revoked']} agent token(s) of node {result['node']} revoked"
    _emit(result, output, printable(text, None))


def _emit(result: dict[str, object], output: OutputFormat, text: str) -> None:
    """JSON or YAML as asked, else the one line ``text``."""
    if output is OutputFormat.JSON:
        emit(dump_json(result))
    elif output is OutputFormat.YAML:
        emit(dump_yaml(result))
    else:
        emit(text)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="agent-token", rich_help_panel="Operate")


__all__ = ["register"]
