"""The agent's settings: one pydantic-settings class, env prefix ``TRAINGUARD_AGENT_``.

Values come from keyword arguments (the CLI), then ``TRAINGUARD_AGENT_*`` environment
variables, then defaults. :func:`load_settings` turns pydantic's multi-line validation
report into one :class:`~agents.errors.AgentConfigError` line naming each bad field, which
is what the CLI prints before exiting with status 2. The dict and list settings (``labels``,
``preflight_load_command``) are decoded from the environment by validators of their own, so
a value that is not JSON is such a line too, naming the format expected, whichever CLI
(``python -m agents`` or ``trainguard agent``) reads it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import warnings
from pathlib import Path
from typing import Annotated, Any

import platformdirs
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from agents.batch import wire_cap
from agents.errors import AgentConfigError
from agents.gpu.backend import parse_gpus_setting
from agents.gpu.faults import parse_fault_spec, split_fault_specs
from agents.reporter import InvalidTokenError, check_token
from agents.tcp_endpoint import TcpListen, parse_listen
from trainguard import limits
from trainguard.wire import NAME_PATTERN, NodeIdentity

_NAME_RE = re.compile(NAME_PATTERN)
#: sun_path is 108 bytes on Linux including the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107


def default_node_name() -> str:
    """The hostname, lower-cased and squeezed into an RFC 1123 name."""
    name = re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.")
    return name[:253] or "node"


def default_socket_path() -> str:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to /tmp/runtime-<uid>,
        # which is a fine place for the socket.
        warnings.simplefilter("ignore")
        runtime = platformdirs.user_runtime_dir("trainguard")
    return str(Path(runtime) / "trainguard-agent.sock")


class AgentSettings(BaseSettings):
    """Everything the node agent daemon needs; see docs/agent.md for the why of each default."""

    model_config = SettingsConfigDict(
        env_prefix="TRAINGUARD_AGENT_",
        extra="forbid",
        validate_default=True,
        # Every float setting is finite: ``inf`` passes ``ge=0`` (node_base_power_w=inf
        # made every node sample fail validation) and ``nan`` passes no bound at all.
        allow_inf_nan=False,
    )

    controller_url: str | None = Field(
        default=None, description="Base URL of the controller, e.g. http://ctl:8470"
    )
    token: SecretStr | None = Field(default=None, description="Bearer token with the agent role")
    #: A token read from this file before every request, instead of ``token``: the projected
    #: service-account token the kubelet writes and rotates (the chart's DaemonSet), which
    #: the controller verifies with TokenReview and binds to this node (docs/security.md).
    token_file: Path | None = None
    node_name: str = Field(default_factory=default_node_name)
    gpus: str = Field(default="auto", description="auto | nvml | sim:N")
    dev_dir: Path = Field(
        default=Path("/dev"), description="Where NVIDIA device files (nvidia0, nvidiactl) live"
    )
    foreground: bool | None = Field(
        default=None,
        description=(
            "Started by hand: exit non-zero when NVML fails on a GPU node (after reporting it). "
            "false (a DaemonSet): keep running and report the node unhealthy. "
            "Unset: true when stdin is a terminal"
        ),
    )
    nvml_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Longest wait for one GPU's NVML reads per tick; past it the GPU is unknown",
    )
    xid_wait_failing_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "XID event waits failing without a break for this long make the node report "
            "gpu_error (XIDs unseen) until a wait works again"
        ),
    )
    gpu_unreachable_after: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description=(
            "Samples in a row in which every NVML read of a GPU failed (an error other than "
            "NOT_SUPPORTED) before the GPU is reported unreachable"
        ),
    )
    sysfs_root: Path = Field(
        default=Path("/sys"), description="Root of sysfs (RDMA ports, bonds, PCIe topology)"
    )
    preflight_load: bool = Field(
        default=True,
        description=(
            "A preflight loads each GPU (clocks_load check) where it can: a CUDA load "
            "generator needs torch and access to the GPUs' device files"
        ),
    )
    preflight_load_s: float = Field(
        default=10.0, gt=0, le=300, description="How long the preflight loads each GPU"
    )
    preflight_load_grace_s: float = Field(
        default=60.0,
        gt=0,
        le=600,
        description="Start-up allowed on top of preflight_load_s (python, torch, a CUDA "
        "context) before the load command is killed",
    )
    preflight_load_command: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Load command template ({gpu}, {uuid}, {index}, {seconds}); empty: "
            "collectives/gpu_load.py with this python (sim GPUs: the simulated stand-in)"
        ),
    )
    sim_faults: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Fault specs for sim GPUs"
    )
    sim_seed: int = Field(default=0, description="Seed of the simulated GPUs' load and noise")
    sim_no_permission: bool = Field(
        default=False, description="Simulated nvmlDeviceSet* calls fail with NO_PERMISSION"
    )
    sim_fault_file: Path | None = Field(
        default=None,
        description="Text file followed while running: each appended line is a sim fault spec",
    )
    sample_interval_s: float = Field(default=1.0, gt=0, le=60)
    report_interval_s: float = Field(default=5.0, gt=0, le=300)
    job_flush_steps: int = Field(
        default=8,
        ge=0,
        le=10_000,
        description=(
            "Report early once a local rank has this many new step summaries (0: only on "
            "the report timer); see agents.cadence"
        ),
    )
    job_flush_min_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=300,
        description="The early report for step summaries comes at least this long after the "
        "previous report",
    )
    report_timeout_s: float = Field(default=10.0, gt=0, le=120)
    backoff_max_s: float = Field(default=30.0, gt=0, le=600)
    spool_dir: Path | None = None
    spool_max_bytes: int = Field(default=256 * 1024 * 1024, ge=64 * 1024)
    socket_path: str = Field(default_factory=default_socket_path)
    job_listen: str = Field(
        default="",
        description=(
            "HOST:PORT of the authenticated TCP endpoint for ranks (e.g. 0.0.0.0:9471, "
            "published as a hostPort); empty: Unix socket only"
        ),
    )
    job_token_file: Path | None = Field(
        default=None,
        description="File of accepted job tokens, one per line (a mounted Secret); required "
        "with job_listen",
    )
    client_idle_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Close a rank's connection after this long without a frame",
    )
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9470, ge=-1, le=65535)
    node_base_power_w: float = Field(default=0.0, ge=0)
    powercap_dir: Path = Path("/sys/class/powercap")
    #: Typed as the wire's NodeIdentity.labels: a label the report could not carry (a value
    #: over 253 characters, a NUL) is a one-line error at start, not a traceback in Agent().
    labels: Annotated[dict[limits.KeyText, limits.NameText], NoDecode] = Field(
        default_factory=dict,
        max_length=wire_cap(NodeIdentity, "labels"),
        description='Node labels; from the environment a JSON object, e.g. {"rack": "r12"}',
    )
    log_level: str = "info"

    @field_validator("controller_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        """Surrounding whitespace dropped (a value from a ConfigMap or file ends in a newline);
        inside, the whole URL must be printable with no space: a ``\\n`` or a space passed a
        prefix check and then failed in httpx when the agent started (``InvalidURL``)."""
        if value is None or not value.strip():
            return None
        value = value.strip()
        if not value.isprintable() or not re.fullmatch(r"https?://[^/\s]+(?:/\S*)?", value):
            raise ValueError(
                "must be http:// or https:// followed by a host (no spaces or control characters)"
            )
        return value.rstrip("/")

    @field_validator("token")
    @classmethod
    def _check_token(cls, value: SecretStr | None) -> SecretStr | None:
        """Surrounding whitespace dropped (a token from a Secret ends in a newline); what is
        left must fit an HTTP header, or the first report would fail quoting it."""
        if value is None:
            return None
        token = value.get_secret_value().strip()
        if not token:
            return None
        try:
            check_token(token, "token")
        except InvalidTokenError:
            raise ValueError(
                "invalid token: it may hold only visible ASCII characters, no spaces or line "
                "breaks inside it"
            ) from None
        return SecretStr(token)

    @field_validator("spool_dir")
    @classmethod
    def _check_spool_dir(cls, value: Path | None) -> Path | None:
        """Created at start when missing; anything else there than a directory is refused
        here, in one line, rather than found by the spool's ``mkdir``."""
        if value is None:
            return None
        try:
            mode = os.stat(value).st_mode
        except FileNotFoundError:
            if os.path.islink(value):
                raise ValueError(
                    f"{value}: a dangling symbolic link (its target does not exist)"
                ) from None
            return value
        except (OSError, ValueError):
            return value  # the spool says why it cannot use it
        if not stat.S_ISDIR(mode):
            kind = "a regular file" if stat.S_ISREG(mode) else "a special file"
            raise ValueError(f"{value}: not a directory ({kind})")
        return value

    @field_validator("labels", "preflight_load_command", mode="before")
    @classmethod
    def _decode_json(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):  # from the environment: the CLIs pass a dict or a list
            kind, expected = _JSON_SETTINGS[info.field_name or ""]
            return _json_setting(value, kind, expected, _env_name(info.field_name or ""))
        return value

    @field_validator("node_name")
    @classmethod
    def _check_node_name(cls, value: str) -> str:
        if not _NAME_RE.fullmatch(value):
            raise ValueError(
                "must be a lower-case RFC 1123 name (a-z, 0-9, '-', '.'; start and end "
                "alphanumeric)"
            )
        return value

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str) -> str:
        try:
            parse_gpus_setting(value)
        except AgentConfigError as exc:
            raise ValueError(str(exc)) from None
        return value.strip().lower()

    @field_validator("sim_faults", mode="before")
    @classmethod
    def _split_faults(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of fault specs ({exc.msg})") from None
        if isinstance(value, str | list | tuple):
            return split_fault_specs(value)
        return value

    @field_validator("sim_faults")
    @classmethod
    def _check_faults(cls, value: list[str]) -> list[str]:
        for spec in value:
            try:
                parse_fault_spec(spec)
            except AgentConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("socket_path")
    @classmethod
    def _check_socket(cls, value: str) -> str:
        if value and len(value.encode()) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"longer than {_MAX_SOCKET_PATH_BYTES} bytes (Unix socket limit)")
        return value

    @field_validator("job_listen")
    @classmethod
    def _check_job_listen(cls, value: str) -> str:
        if value:
            parse_listen(value)
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("must be one of debug, info, warning, error")
        return value.lower()

    @model_validator(mode="after")
    def _derive(self) -> AgentSettings:
        if self.report_interval_s < self.sample_interval_s:
            raise ValueError(
                f"report_interval_s ({self.report_interval_s}) must be >= sample_interval_s "
                f"({self.sample_interval_s})"
            )
        if self.job_listen and self.job_token_file is None:
            raise ValueError(
                "job_listen needs job_token_file: the TCP endpoint never accepts ranks "
                "without a token"
            )
        if self.spool_dir is None:
            state = Path(platformdirs.user_state_dir("trainguard"))
            self.spool_dir = state / f"agent-{self.node_name}" / "spool"
        return self

    def job_tcp(self) -> TcpListen | None:
        """The TCP endpoint's listen settings, or None when ranks use the Unix socket only."""
        if not self.job_listen:
            return None
        assert self.job_token_file is not None  # checked by _derive
        host, port = parse_listen(self.job_listen)
        return TcpListen(host=host, port=port, token_file=self.job_token_file)

    @property
    def resolved_spool_dir(self) -> Path:
        assert self.spool_dir is not None  # set by _derive
        return self.spool_dir


#: The settings read from the environment as JSON: (type, the format in words).
_JSON_SETTINGS: dict[str, tuple[type, str]] = {
    "labels": (dict, 'a JSON object of strings, e.g. {"rack": "r12", "zone": "a"}'),
    "preflight_load_command": (list, 'a JSON list of strings, e.g. ["python", "load.py"]'),
}


def _env_name(field: str) -> str:
    return f"{AgentSettings.model_config.get('env_prefix', '')}{field}".upper()


def _json_setting(text: str, kind: type, expected: str, env: str) -> Any:
    """A dict or list setting given as text (its environment variable): JSON of ``kind``,
    else a ``ValueError`` that says so in one line (pydantic-settings' own decoding raised
    SettingsError "error parsing value", and ``trainguard agent`` exited 1 on it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        # Worded as before this validator existed (tests and scripts match it): "JSON" is
        # the format; the example comes with a value that is JSON of the wrong shape.
        raise ValueError(f"{env} is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError(f"{env} is nested too deeply; expected {expected}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{env} is a JSON {type(value).__name__}; expected {expected}")
    return value


def format_validation_error(exc: ValidationError) -> str:
    """One line: ``field: message; field: message``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "invalid agent settings: " + "; ".join(parts)


_SOURCE_FIELD_RE = re.compile(r'field "([^"]+)"')


def format_settings_error(exc: SettingsError) -> str:
    """One line for a value pydantic-settings could not even parse: a dict or list setting
    (``labels``, ``preflight_load_command``) whose environment variable is not JSON."""
    match = _SOURCE_FIELD_RE.search(str(exc))
    if match is None:
        return f"invalid agent settings: {exc}"
    name = match.group(1)
    env = f"{AgentSettings.model_config.get('env_prefix', '')}{name}".upper()
    cause = exc.__cause__
    why = cause.msg if isinstance(cause, json.JSONDecodeError) else str(cause or exc)
    return f"invalid agent settings: {name}: {env} is not valid JSON ({why})"


def load_settings(**overrides: Any) -> AgentSettings:
    """Build settings from overrides + environment, raising one-line AgentConfigError."""
    try:
        return AgentSettings(**overrides)
    except ValidationError as exc:
        raise AgentConfigError(format_validation_error(exc)) from None
    except SettingsError as exc:
        raise AgentConfigError(format_settings_error(exc)) from None


__all__ = [
    "AgentSettings",
    "format_settings_error",
    "format_validation_error",
    "load_settings",
]
