"""Connection and output options, declared once so their names and env vars never drift.

``--server`` and ``--token`` work both before the command (``trainguard --server U nodes``,
like kubectl's global flags) and after it (``trainguard nodes --server U``). Precedence:
the flag after the command, the flag before it, the environment, the default.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from trainguard.cli.client import DEFAULT_SERVER, ApiClient
from trainguard.cli.output import OutputFormat

CLIENT_PANEL = "Connection"
SERVER_ENV = "TRAINGUARD_SERVER"
TOKEN_ENV = "TRAINGUARD_TOKEN"

Server = Annotated[
    str | None,
    typer.Option(
        "--server",
        "-s",
        help=f"Controller base URL [env: {SERVER_ENV}; default: {DEFAULT_SERVER}].",
        show_default=False,
        rich_help_panel=CLIENT_PANEL,
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        help=f"Bearer token, viewer role or above [env: {TOKEN_ENV}].",
        show_default=False,
        rich_help_panel=CLIENT_PANEL,
    ),
]
Output = Annotated[
    OutputFormat,
    typer.Option(
        "--output",
        "-o",
        case_sensitive=False,
        help="Output format.",
    ),
]

DEFAULT_OUTPUT = OutputFormat.TABLE


def remember_connection(ctx: typer.Context, server: str | None, token: str | None) -> None:
    """Root callback: keep the global ``--server``/``--token`` for the command to use."""
    ctx.obj = {"server": server, "token": token}


def connect(ctx: typer.Context, server: str | None, token: str | None) -> ApiClient:
    """An API client from the command's flags, the global flags, the environment, defaults."""
    root = ctx.find_root().obj
    given = root if isinstance(root, dict) else {}
    url = server or given.get("server") or os.environ.get(SERVER_ENV) or DEFAULT_SERVER
    secret = token or given.get("token") or os.environ.get(TOKEN_ENV) or None
    return ApiClient(url, secret)


__all__ = [
    "DEFAULT_OUTPUT",
    "Output",
    "Server",
    "Token",
    "connect",
    "remember_connection",
]
