"""Service commands: ``controller``, ``agent`` and ``db upgrade``.

They only translate flags into the services' own pydantic-settings classes, so a flag,
its environment variable (``TRAINGUARD_*`` / ``TRAINGUARD_AGENT_*``) and the config file
all land in one validated place. The service packages are imported inside each command:
``trainguard nodes`` never pays for FastAPI, SQLAlchemy or the agent's samplers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from trainguard.cli.errors import BadInput, CliError
from trainguard.urls import shown_url

if TYPE_CHECKING:
    from controller.settings import ControllerSettings

SERVE_PANEL = "Run"


def settings_error(what: str, exc: ValidationError) -> BadInput:
    """A pydantic validation failure as one line naming each offending setting."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return BadInput(f"invalid {what} settings: " + "; ".join(parts))


def service_error(exc: Exception, exit_code: int) -> CliError:
    """A service's own deliberate error (one line that says what to do) for the CLI."""
    error = CliError(" ".join(str(exc).split()) or type(exc).__name__)
    error.exit_code = exit_code
    return error


def controller_settings(**given: Any) -> ControllerSettings:
    """``ControllerSettings`` from ``given``, the environment and the config file; whatever
    the operator set wrong is one line and exit 2."""
    from pydantic_settings import SettingsError

    from controller.settings import ConfigFileError, ControllerSettings

    try:
        return ControllerSettings(**given)
    except ValidationError as exc:
        raise settings_error("controller", exc) from exc
    except ConfigFileError as exc:
        raise BadInput(str(exc)) from exc
    except SettingsError as exc:  # an environment value that is not the JSON it must be
        raise BadInput(f"invalid controller settings: {_source_problem(exc)}") from exc


def _source_problem(exc: Exception) -> str:
    """``tokens: TRAINGUARD_TOKENS is not valid JSON (Expecting value: ...)`` for
    pydantic-settings' 'error parsing value for field "tokens" from source ...'."""
    match = re.search(r'field "([^"]+)"', str(exc))
    if match is None:
        return " ".join(str(exc).split())
    field, cause = match.group(1), exc.__cause__
    if isinstance(cause, json.JSONDecodeError):
        where = f"{cause.msg} at line {cause.lineno}, column {cause.colno}"
        return f"{field}: TRAINGUARD_{field.upper()} is not valid JSON ({where})"
    return f"{field}: " + (" ".join(str(cause).split()) if cause else "cannot be parsed")


def _given(**values: Any) -> dict[str, Any]:
    """Only the flags the user gave, so environment and config file still apply to the rest."""
    return {key: value for key, value in values.items() if value is not None}


def controller(
    host: Annotated[str | None, typer.Option("--host", help="Address to bind.")] = None,
    port: Annotated[
        int | None, typer.Option("--port", min=0, max=65535, help="Port to bind (default 8470).")
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option("--database-url", help="SQLAlchemy URL (sqlite:///… or postgresql://…)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="YAML settings file (TRAINGUARD_CONFIG_FILE)."),
    ] = None,
    dev: Annotated[
        bool, typer.Option("--dev", help="Dev mode: random tokens when none are configured.")
    ] = False,
) -> None:
    """Run the controller (API, ingest, detectors) until SIGINT/SIGTERM."""
    if config is not None:
        if not config.is_file():
            raise BadInput(f'config file "{config}" does not exist')
        os.environ["TRAINGUARD_CONFIG_FILE"] = str(config)
    settings = controller_settings(
        **_given(host=host, port=port, database_url=database_url, dev_mode=True if dev else None)
    )
    # The app (FastAPI, every route and service: ~2 s of CPU) only once the settings hold:
    # a setting the operator got wrong is refused at once, and cheaply.
    from controller.errors import BadConfig, StartupError
    from controller.logic.remediation.rules import PolicyError
    from controller.server import serve

    try:
        serve(settings)
    except (PolicyError, BadConfig) as exc:  # a file or setting the operator wrote
        raise BadInput(" ".join(str(exc).split())) from exc
    except StartupError as exc:
        raise service_error(exc, 1) from exc
    except OSError as exc:  # e.g. the port is taken
        raise service_error(exc, 1) from exc


def agent(
    controller_url: Annotated[
        str | None, typer.Option("--controller", help="Controller base URL.")
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="Agent-role token.", show_default=False)
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="Read the token from this file before each request (a rotating projected "
            "service-account token or per-node token; docs/security.md).",
        ),
    ] = None,
    node_name: Annotated[
        str | None, typer.Option("--node-name", help="Node name (default: hostname).")
    ] = None,
    gpus: Annotated[
        str | None, typer.Option("--gpus", help="GPU backend: auto, nvml or sim:N.")
    ] = None,
    sim_fault: Annotated[
        list[str] | None,
        typer.Option(
            "--sim-fault", help="Scripted fault for sim GPUs, e.g. kind=xid,code=79,gpu=3,at=15."
        ),
    ] = None,
    sim_fault_file: Annotated[
        Path | None,
        typer.Option(
            "--sim-fault-file", help="File followed while running; each new line is a sim fault."
        ),
    ] = None,
    spool_dir: Annotated[
        Path | None, typer.Option("--spool-dir", help="Where unacknowledged reports wait.")
    ] = None,
    socket_path: Annotated[
        str | None, typer.Option("--socket-path", help="Local job socket ('' disables).")
    ] = None,
    job_listen: Annotated[
        str | None,
        typer.Option(
            "--job-listen",
            help="HOST:PORT of the authenticated TCP endpoint for ranks (needs --job-token-file).",
        ),
    ] = None,
    job_token_file: Annotated[
        Path | None,
        typer.Option("--job-token-file", help="File of accepted job tokens, one per line."),
    ] = None,
    client_idle_timeout: Annotated[
        float | None,
        typer.Option(
            "--client-idle-timeout", help="Close a rank's connection idle this long, seconds."
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", min=-1, max=65535, help="0 = ephemeral, -1 = off."),
    ] = None,
    sample_interval: Annotated[
        float | None, typer.Option("--sample-interval", min=0.01, help="Seconds between samples.")
    ] = None,
    report_interval: Annotated[
        float | None, typer.Option("--report-interval", min=0.01, help="Seconds between reports.")
    ] = None,
    report_timeout: Annotated[
        float | None, typer.Option("--report-timeout", help="HTTP timeout per report, seconds.")
    ] = None,
    backoff_max: Annotated[
        float | None, typer.Option("--backoff-max", help="Cap of the retry backoff, seconds.")
    ] = None,
    spool_max_bytes: Annotated[
        int | None,
        typer.Option("--spool-max-bytes", help="Spool bound; the oldest reports go past it."),
    ] = None,
    metrics_host: Annotated[
        str | None, typer.Option("--metrics-host", help="Address of the Prometheus endpoint.")
    ] = None,
    node_base_power_w: Annotated[
        float | None,
        typer.Option("--node-base-power-w", help="Watts added to the GPU sum without RAPL."),
    ] = None,
    powercap_dir: Annotated[
        Path | None, typer.Option("--powercap-dir", help="Where RAPL counters are read.")
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option("--label", help="Node label key=value (repeatable; replaces the env's)."),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option("--log-level", help="debug, info, warning or error.")
    ] = None,
    sim_seed: Annotated[
        int | None, typer.Option("--sim-seed", help="Seed of the sim GPUs' load and noise.")
    ] = None,
    sim_no_permission: Annotated[
        bool,
        typer.Option("--sim-no-permission", help="Sim GPUs refuse power/clock changes."),
    ] = False,
    dev_dir: Annotated[
        Path | None, typer.Option("--dev-dir", help="Where NVIDIA device files are looked for.")
    ] = None,
    foreground: Annotated[
        bool | None,
        typer.Option(
            "--foreground/--no-foreground",
            help="Exit 3 when NVML fails on a GPU node (default: when stdin is a terminal).",
            show_default=False,
        ),
    ] = None,
    nvml_timeout: Annotated[
        float | None,
        typer.Option("--nvml-timeout", help="Seconds to wait for a GPU's NVML reads per tick."),
    ] = None,
    sysfs_root: Annotated[
        Path | None, typer.Option("--sysfs-root", help="Root of sysfs (RDMA ports, bonds).")
    ] = None,
    preflight_load: Annotated[
        bool | None,
        typer.Option(
            "--preflight-load/--no-preflight-load",
            help="A preflight loads the GPUs (clocks_load) where it can (default: on).",
            show_default=False,
        ),
    ] = None,
    preflight_load_s: Annotated[
        float | None,
        typer.Option("--preflight-load-s", help="Seconds a preflight loads each GPU."),
    ] = None,
    preflight_load_grace: Annotated[
        float | None,
        typer.Option(
            "--preflight-load-grace", help="Start-up allowed on top of the load, seconds."
        ),
    ] = None,
    preflight_load_command: Annotated[
        str | None,
        typer.Option(
            "--preflight-load-command",
            help="Load command template, split like a shell line ({gpu} {uuid} {index} "
            "{seconds}); default collectives/gpu_load.py.",
        ),
    ] = None,
    job_flush_steps: Annotated[
        int | None,
        typer.Option(
            "--job-flush-steps", help="Report early after this many new step summaries (0: off)."
        ),
    ] = None,
    job_flush_min_interval: Annotated[
        float | None,
        typer.Option(
            "--job-flush-min-interval", help="Seconds between an early report and the last one."
        ),
    ] = None,
    gpu_unreachable_after: Annotated[
        int | None,
        typer.Option(
            "--gpu-unreachable-after",
            help="Samples in a row with every NVML read of a GPU failing before it is "
            "reported unreachable.",
        ),
    ] = None,
    xid_wait_failing: Annotated[
        float | None,
        typer.Option(
            "--xid-wait-failing",
            help="Seconds of XID event waits failing before the node reports gpu_error.",
        ),
    ] = None,
) -> None:
    """Run the node agent (GPU sampler, spool, reporter) until SIGINT/SIGTERM."""
    from agents.daemon import run
    from agents.errors import AgentError
    from agents.settings import AgentSettings

    values = _given(
        controller_url=controller_url,
        token=token,
        token_file=token_file,
        node_name=node_name,
        gpus=gpus,
        sim_faults=sim_fault or None,
        sim_fault_file=sim_fault_file,
        spool_dir=spool_dir,
        socket_path=socket_path,
        job_listen=job_listen,
        job_token_file=job_token_file,
        client_idle_timeout_s=client_idle_timeout,
        metrics_port=metrics_port,
        sample_interval_s=sample_interval,
        report_interval_s=report_interval,
        report_timeout_s=report_timeout,
        backoff_max_s=backoff_max,
        spool_max_bytes=spool_max_bytes,
        metrics_host=metrics_host,
        node_base_power_w=node_base_power_w,
        powercap_dir=powercap_dir,
        labels=parse_labels(label) if label else None,
        log_level=log_level,
        sim_seed=sim_seed,
        sim_no_permission=True if sim_no_permission else None,
        dev_dir=dev_dir,
        foreground=foreground,
        nvml_timeout_s=nvml_timeout,
        sysfs_root=sysfs_root,
        preflight_load=preflight_load,
        preflight_load_s=preflight_load_s,
        preflight_load_grace_s=preflight_load_grace,
        preflight_load_command=_split_command(preflight_load_command),
        job_flush_steps=job_flush_steps,
        job_flush_min_interval_s=job_flush_min_interval,
        gpu_unreachable_after=gpu_unreachable_after,
        xid_wait_failing_s=xid_wait_failing,
    )
    try:
        settings = AgentSettings(**values)
    except ValidationError as exc:
        raise settings_error("agent", exc) from exc
    try:
        run(settings)
    except AgentError as exc:
        raise service_error(exc, getattr(exc, "exit_code", 1)) from exc


def _split_command(line: str | None) -> list[str] | None:
    """``--preflight-load-command`` as argv (shell quoting rules, no shell runs it)."""
    if line is None:
        return None
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise BadInput(f"--preflight-load-command: {exc}") from exc
    if not argv:
        raise BadInput("--preflight-load-command: empty command")
    return argv


def parse_labels(items: list[str]) -> dict[str, str]:
    """``--label key=value`` flags as the agent's ``labels`` mapping (a later key wins)."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--label {item!r}: expected key=value")
        labels[key] = value
    return labels


db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[
        str | None,
        typer.Option("--database-url", help="SQLAlchemy URL (default: the controller's)."),
    ] = None,
) -> None:
    """Apply every pending migration (needed once per PostgreSQL release upgrade)."""
    from controller.db.migrate import SchemaTooNew, upgrade
    from controller.errors import BadConfig, StartupError

    if database_url is None:
        database_url = controller_settings().database_url
    else:
        from controller.settings import check_database_url

        try:
            check_database_url(database_url)
        except ValueError as exc:
            raise BadInput(f"--database-url: {exc}") from exc
    try:
        revision = upgrade(database_url)
    # The operator's input, exit 2: a SQLite file that is read-only, not a database,
    # damaged or a directory; a database holding another application's tables; a schema a
    # newer release wrote (the wrong binary for this database). The controller still starts
    # against that last one (``controller.db.migrate.schema_at_or_past_head``): only
    # migrating it is refused.
    except (BadConfig, SchemaTooNew) as exc:
        raise BadInput(" ".join(str(exc).split())) from exc
    except StartupError as exc:
        raise service_error(exc, 1) from exc
    typer.echo(f"database at {shown_url(database_url)} is at revision {revision}")


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=SERVE_PANEL)(controller)
    app.command(rich_help_panel=SERVE_PANEL)(agent)
    app.add_typer(db_app, name="db", rich_help_panel=SERVE_PANEL)


__all__ = ["parse_labels", "register", "settings_error"]
