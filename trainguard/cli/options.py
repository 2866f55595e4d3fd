"""Connection and output options, declared once so their names and env vars never drift.

``--server`` and ``--token`` work both before the command (``trainguard --server U nodes``,
like kubectl's global flags) and after it (``trainguard nodes --server U``). Precedence:
the flag after the command, the flag before it, the environment, the default.

Where the controller is (first match wins):

1. ``--server URL`` (a flag): that controller, directly.
2. ``--kubeconfig``, ``--context``, ``-n/--namespace`` or ``--service`` (flags, anywhere on
   the line like kubectl's): through the API server's service proxy
   (:mod:`trainguard.cli.kubeproxy`). Giving both 1 and 2 is a usage error.
3. ``TRAINGUARD_SERVER``: that controller, directly.
4. Run as ``kubectl trainguard``: the service proxy of the current kubeconfig context.
5. ``http://127.0.0.1:8470`` (the local demo, or a port-forward).

Help texts carry ``[env: ...; default: ...]``; the brackets are escaped because the help
is rendered as rich markup, which would otherwise swallow them as tags.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.markup import escape

from trainguard.cli import kubeproxy
from trainguard.cli.client import DEFAULT_SERVER, ApiClient
from trainguard.cli.errors import BadInput
from trainguard.cli.output import OutputFormat

CLIENT_PANEL = "Connection"
SERVER_ENV = "TRAINGUARD_SERVER"
TOKEN_ENV = "TRAINGUARD_TOKEN"

Server = Annotated[
    str | None,
    typer.Option(
        "--server",
        help=escape(
            f"Controller base URL, reached directly (not kubectl's API-server --server) "
            f"[env: {SERVER_ENV}; default: your kubeconfig when run as kubectl trainguard, "
            f"else {DEFAULT_SERVER}]."
        ),
        show_default=False,
        rich_help_panel=CLIENT_PANEL,
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token",
        help=escape(f"Controller token, viewer role or above [env: {TOKEN_ENV}]."),
        show_default=False,
        rich_help_panel=CLIENT_PANEL,
    ),
]
KUBE_PANEL = "Kubernetes (reach the controller through the API server)"
Kubeconfig = Annotated[
    str | None,
    typer.Option(
        "--kubeconfig",
        help=escape("Path to the kubeconfig file [env: KUBECONFIG; default: ~/.kube/config]."),
        show_default=False,
        rich_help_panel=KUBE_PANEL,
    ),
]
Context = Annotated[
    str | None,
    typer.Option(
        "--context",
        help=escape("kubeconfig context to use [default: the current context]."),
        show_default=False,
        rich_help_panel=KUBE_PANEL,
    ),
]
Namespace = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        "-n",
        help=escape(
            "Namespace of the trainguard release (not of your jobs) "
            f"[env: {kubeproxy.NAMESPACE_ENV}; default: {kubeproxy.DEFAULT_NAMESPACE}]."
        ),
        show_default=False,
        rich_help_panel=KUBE_PANEL,
    ),
]
Service = Annotated[
    str | None,
    typer.Option(
        "--service",
        help=escape(
            "The controller's Service, port http "
            f"[env: {kubeproxy.SERVICE_ENV}; default: {kubeproxy.DEFAULT_SERVICE}]."
        ),
        show_default=False,
        rich_help_panel=KUBE_PANEL,
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


def remember_connection(
    ctx: typer.Context,
    server: str | None,
    token: str | None,
    kube: kubeproxy.KubeFlags | None = None,
) -> None:
    """Root callback: keep the global connection flags for the command to use."""
    ctx.obj = {"server": server, "token": token, "kube": kube or kubeproxy.KubeFlags()}


def connect(ctx: typer.Context, server: str | None, token: str | None) -> ApiClient:
    """An API client from the command's flags, the global flags, the environment, defaults."""
    root = ctx.find_root()
    given = root.obj if isinstance(root.obj, dict) else {}
    kube = given.get("kube")
    kube = kube if isinstance(kube, kubeproxy.KubeFlags) else kubeproxy.KubeFlags()
    flag_server = server or given.get("server")
    secret = token or given.get("token") or os.environ.get(TOKEN_ENV) or None
    if flag_server and kube.given:
        raise BadInput(
            "--server reaches a controller directly; --kubeconfig, --context, -n and "
            "--service go through the API server: give one or the other"
        )
    if flag_server:
        return ApiClient(flag_server, secret)
    env_server = os.environ.get(SERVER_ENV)
    if kube.given or (not env_server and kubeproxy.is_kubectl_plugin(root.info_name)):
        return ApiClient.through(kubeproxy.resolve(kube), secret)
    return ApiClient(env_server or DEFAULT_SERVER, secret)


__all__ = [
    "DEFAULT_OUTPUT",
    "Context",
    "Kubeconfig",
    "Namespace",
    "Output",
    "Server",
    "Service",
    "Token",
    "connect",
    "remember_connection",
]
