"""Builds the ``trainguard`` command tree and runs it with one error policy.

Every failure ends as one line on stderr and an exit status (see
:mod:`trainguard.cli.errors`): 2 for what the user typed, 1 for what went wrong elsewhere.
``TRAINGUARD_DEBUG=1`` re-raises so the traceback shows. Invoked as ``kubectl-trainguard``
(kubectl's plugin mechanism), the program calls itself ``kubectl trainguard`` in help.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import typer

from trainguard import __version__
from trainguard.cli import (
    cmd_agent_token,
    cmd_get,
    cmd_plan,
    cmd_preflight,
    cmd_remediate,
    cmd_serve,
    leader_label,
)
from trainguard.cli.errors import EXIT_FAILURE, EXIT_USAGE, CliError
from trainguard.cli.kubeproxy import KubeFlags, hoist_kube_flags
from trainguard.cli.options import (
    Context,
    Kubeconfig,
    Namespace,
    Server,
    Service,
    Token,
    remember_connection,
)
from trainguard.cli.replies import without_escapes

#: Sub-apps other packages own; mounted only when importable, so the CLI works without them.
OPTIONAL_SUBAPPS: tuple[tuple[str, str], ...] = (
    ("checkpoint", "checkpoint.cli"),
    ("power", "power.cli"),
)

HELP = (
    "trainguard keeps GPU training jobs running: inspect nodes, GPUs, jobs and incidents, "
    "or run the controller, a node agent, or the local demo."
)


def program_name(argv0: str) -> str:
    """How the user invoked us: kubectl runs plugins as ``kubectl-<name>``."""
    base = Path(argv0).name
    if base.startswith("kubectl-"):
        return "kubectl " + base.removeprefix("kubectl-").replace("_", "-")
    if base in ("__main__.py", "main.py", ""):
        return "trainguard"
    return base


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"trainguard {__version__}")
        raise typer.Exit()


def build_app(argv: Sequence[str] = ()) -> typer.Typer:
    app = typer.Typer(
        name="trainguard",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _root(
        ctx: typer.Context,
        server: Server = None,
        token: Token = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        namespace: Namespace = None,
        service: Service = None,
        version: bool = typer.Option(
            False,
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ) -> None:
        """Root options."""
        kube = KubeFlags(
            kubeconfig=kubeconfig, context=context, namespace=namespace, service=service
        )
        remember_connection(ctx, server, token, kube)

    cmd_get.register(app)
    cmd_remediate.register(app)
    cmd_preflight.register(app)
    cmd_agent_token.register(app)
    cmd_serve.register(app)
    leader_label.register(app)
    from trainguard.cli import demo

    demo.register(app)
    if command_word(argv) not in own_commands(app):
        # Like the optional sub-apps: built only when the line does not name one of the
        # commands above, so ``trainguard nodes`` stays fast.
        cmd_plan.register(app)
    mount_optional_subapps(app, argv)
    return app


def own_commands(app: typer.Typer) -> set[str]:
    """Names of the commands and groups registered on ``app`` so far."""
    own = {
        info.name or (info.callback.__name__ if info.callback else "")
        for info in app.registered_commands
    }
    return own | {group.name or "" for group in app.registered_groups}


def mount_optional_subapps(app: typer.Typer, argv: Sequence[str]) -> list[str]:
    """Mount other packages' sub-apps that import cleanly; returns the names mounted.

    When the user named one of our own commands we skip the imports entirely, keeping
    ``trainguard nodes`` fast; help and unknown commands see the full tree.
    """
    first = command_word(argv)
    if first in own_commands(app):
        return []
    mounted = []
    for name, module_name in OPTIONAL_SUBAPPS:
        if first is not None and first != name and first in {n for n, _ in OPTIONAL_SUBAPPS}:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        sub = getattr(module, "app", None)
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=name, rich_help_panel="More")
            mounted.append(name)
    return mounted


#: Root options that take a value, so the value is not mistaken for the command.
_ROOT_VALUE_OPTIONS = frozenset(
    {"--server", "--token", "--kubeconfig", "--context", "-n", "--namespace", "--service"}
)


def _words(argv: Sequence[str]) -> Iterator[str]:
    """The line's words that are no option nor a root option's value, in order."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _ROOT_VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-"):
            yield arg


def command_word(argv: Sequence[str]) -> str | None:
    """The command the user named (``nodes`` in ``trainguard -s URL nodes -o json``)."""
    return next(_words(argv), None)


def _fail(message: str, code: int) -> int:
    # Messages may quote what the server or the user sent: no escape sequences.
    sys.stderr.write(f"error: {without_escapes(message)}\n")
    return code


def _usage_message(exc: typer.TyperException, prog: str) -> str:
    message = " ".join(exc.format_message().replace("Value error, ", "").split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or prog
    return f"{message[:1].lower()}{message[1:]} (see '{command} --help')"


def command_path(command: Any, argv: Sequence[str], prog: str) -> str:
    """``trainguard agent-token issue`` for ``agent-token issue -o``: the command the line
    names, for errors the parser raises without a context (an option missing its value),
    which would otherwise send the user to the root's help."""
    words = [prog]
    for word in _words(argv):
        sub = (getattr(command, "commands", None) or {}).get(word)
        if sub is None:
            break
        words.append(word)
        command = sub
    return " ".join(words)


def _click_error(exc: typer.TyperException, prog: str) -> int:
    """Typer's (vendored click) errors: usage errors carry exit code 2 and a context."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        typer.echo(ctx.get_help())
        return 0
    code = int(getattr(exc, "exit_code", EXIT_FAILURE))
    if code == EXIT_USAGE:
        return _fail(_usage_message(exc, prog), EXIT_USAGE)
    return _fail(" ".join(exc.format_message().split()), code or EXIT_FAILURE)


@functools.lru_cache(maxsize=64)
def _command_for(word: str | None) -> Any:  # typer's vendored click Command (private)
    """The click command tree for a line whose command word is ``word``, built once.

    What :func:`build_app` mounts depends only on that word. Turning the Typer app into
    click commands costs ~30 ms of CPU (it inspects every command's signature); a process
    that runs many command lines (the test suite, an embedding tool) pays it once per word.
    """
    return typer.main.get_command(build_app([] if word is None else [word]))


def run(argv: Sequence[str] | None = None, prog_name: str | None = None) -> int:
    """Run the CLI and return its exit status (the console script passes it to sys.exit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = prog_name or program_name(sys.argv[0] if sys.argv else "trainguard")
    debug = os.environ.get("TRAINGUARD_DEBUG", "") not in ("", "0", "false")
    command: Any = None
    try:
        # kubectl's global flags may stand anywhere (`nodes -n tg`); the root declares them.
        args = hoist_kube_flags(args)
        command = _command_for(command_word(args))
        result = command.main(args=args, prog_name=prog, standalone_mode=False)
    except typer.TyperException as exc:
        if getattr(exc, "ctx", None) is None and command is not None:
            prog = command_path(command, args, prog)
        return _click_error(exc, prog)
    except CliError as exc:
        if debug:
            raise
        return _fail(exc.message, exc.exit_code)
    except typer.Abort:
        return _fail("aborted", 130)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:
        if debug:
            raise
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return _fail(
            f"{type(exc).__name__}: {detail} (set TRAINGUARD_DEBUG=1 for a traceback)",
            EXIT_FAILURE,
        )
    return result if isinstance(result, int) else 0


__all__ = [
    "OPTIONAL_SUBAPPS",
    "build_app",
    "command_word",
    "mount_optional_subapps",
    "program_name",
    "run",
]
