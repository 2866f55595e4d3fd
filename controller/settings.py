"""The controller's one settings class (``TRAINGUARD_`` env prefix, optional YAML file).

Sources, highest priority first: keyword arguments (what the CLI passes), environment
variables, the YAML file named by ``TRAINGUARD_CONFIG_FILE``, defaults. Tokens may also come
from ``tokens_file`` (a YAML list of the same ``{name, role, token | sha256}`` entries).

The validators refuse configurations that would expose the API: outside ``dev_mode`` there
must be at least one token and every plaintext token must be at least 16 characters, since a
short shared secret on a cluster network is guessable.
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

import platformdirs
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from trainguard.textfile import (
    MAX_SECRET_BYTES,
    Unparsable,
    Unreadable,
    load_yaml,
    read_bytes,
    read_text,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

Role = Literal["agent", "viewer", "operator"]

#: Shortest plaintext token accepted outside dev mode (characters).
MIN_TOKEN_LENGTH = 16

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

#: A Kubernetes namespace name (RFC 1123 label; the length is checked on its own).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def check_token_name(name: str) -> str:
    """``name`` when every character is printable (no control, format, separator or
    unassigned code point; ASCII space allowed inside) and it has no space at either end."""
    for i, char in enumerate(name):
        if not char.isprintable():
            raise ValueError(
                f"token name: character U+{ord(char):04X} at position {i} is not printable "
                "(control, bidi or zero-width characters are refused); use letters, digits, "
                "'-', '_' or '.'"
            )
    if name != name.strip():
        raise ValueError("token name: must not start or end with a space")
    return name


def default_database_url() -> str:
    """SQLite file in the user's data dir: the embedded default needs no server."""
    return f"sqlite:///{Path(platformdirs.user_data_dir('trainguard')) / 'trainguard.db'}"


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenConfig(BaseModel):
    """One API credential. Give ``sha256`` (hex digest) to keep plaintext out of config."""

    model_config = ConfigDict(extra="forbid")

    #: Shown in logs, audit rows (an action's ``trigger``) and the CLI: printable only.
    name: str = Field(min_length=1, max_length=64)
    role: Role
    # Printable ASCII without spaces: the token travels in an ``Authorization`` header,
    # which cannot carry a newline or a control character and whose credential the server
    # strips (controller.auth); a token with a trailing newline or a space (a YAML block
    # scalar ``|``, a quoted paste) was accepted and then could never be presented.
    token: str | None = Field(default=None, min_length=1, repr=False, pattern=r"^[!-~]+$")
    sha256: str | None = Field(default=None, repr=False)

    @field_validator("name")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        """Refuse names a log line, an audit row or a terminal would show wrongly: a newline
        forges a log line, a U+202E (right-to-left override) or a zero-width character makes
        ``ops`` and another name look alike. The message gives the code point, not the name,
        so a secret pasted into the wrong field is not echoed."""
        return check_token_name(value)

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256_RE.fullmatch(value.lower()):
            raise ValueError("sha256 must be 64 hex characters (sha256sum of the token)")
        return None if value is None else value.lower()

    @model_validator(mode="after")
    def _exactly_one_secret(self) -> Self:
        if (self.token is None) == (self.sha256 is None):
            raise ValueError(f"token {self.name!r}: give exactly one of 'token' or 'sha256'")
        return self

    def digest(self) -> str:
        """The sha256 hex digest the controller compares presented tokens against."""
        if self.sha256 is not None:
            return self.sha256
        assert self.token is not None
        return sha256_hex(self.token)


class ControllerSettings(BaseSettings):
    """Settings of one controller process."""

    # Every float must be finite: an "inf" timeout or retention is never what was meant.
    model_config = SettingsConfigDict(env_prefix="TRAINGUARD_", extra="ignore", allow_inf_nan=False)

    database_url: str = Field(default_factory=default_database_url)
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=0, le=65535)
    dev_mode: bool = False
    tokens: list[TokenConfig] = Field(default_factory=list)
    tokens_file: Path | None = None
    allow_anonymous_read: bool = False
    #: Let agent tokens from ``tokens`` (not bound to a node) report as any node. Risky: one
    #: compromised node holding it can report fatal faults for every other node and have the
    #: policy isolate them (docs/security.md). Off (the default): only per-node tokens
    #: (``trainguard agent-token issue NODE``) and, with ``kube_token_review``,
    #: service-account tokens bound to the reporting node.
    allow_shared_agent_tokens: bool = False
    #: After a per-node token is rotated, the node's older tokens keep working this long.
    agent_token_grace_s: float = Field(default=3600.0, ge=0, le=30 * 86_400)
    #: Accept Kubernetes service-account tokens from agents, verified by TokenReview; the
    #: node is the one the API server bound the (projected) token to.
    kube_token_review: bool = False
    #: Audience the agents' projected tokens are requested for (the chart's DaemonSet).
    kube_token_audience: str = Field(default="trainguard", min_length=1, max_length=253)
    #: Service accounts whose tokens are agent credentials
    #: (``system:serviceaccount:<namespace>:<name>``).
    kube_agent_service_accounts: list[str] = Field(
        default_factory=lambda: ["system:serviceaccount:trainguard:trainguard-agent"]
    )
    #: API server for TokenReview, the Kubernetes actuator and the leader Lease; empty:
    #: in-cluster config, else the kubeconfig.
    kube_api_url: str = ""
    node_lost_after_s: float = Field(default=30.0, gt=0)
    #: A GPU is degrading (``gpu_degraded``, docs/detection.md) when its correctable ECC
    #: errors rise by this many within ``degraded_ecc_window_s`` …
    degraded_ecc_rise: int = Field(default=100, ge=1)
    degraded_ecc_window_s: float = Field(default=600.0, gt=0, le=86_400)
    #: … or when most of its samples over this many seconds show thermal, power-brake or
    #: hardware-slowdown throttling (never ``sw_power_cap``: that is our own power loop).
    degraded_throttle_s: float = Field(default=30.0, gt=0, le=3_600)
    #: An open ``gpu_degraded`` incident is written at most this often while a storm keeps
    #: bumping it; bumps in between are held and written together (at a later report or
    #: tick).
    degraded_bump_interval_s: float = Field(default=2.0, gt=0, le=600)
    #: Seconds between two ticks of the degraded-GPU detector: how soon a held-back bump is
    #: written and a recovered GPU's incident resolved when no report arrives to do it.
    degraded_tick_interval_s: float = Field(default=1.0, gt=0, le=60)
    #: Seconds between two ticks of the job detector (C4D trackers, probe rounds). A job
    #: finding whose incident write failed is tried again after one tick, then after twice
    #: as long each time (at most 30 s).
    job_tick_interval_s: float = Field(default=1.0, gt=0, le=60)
    #: Seconds on the controller's clock a slow-communication condition must persist,
    #: besides its steps, before it opens or clears (``C4DConfig.confirm_min_s``).
    c4d_confirm_min_s: float = Field(default=5.0, ge=0, le=600)
    history_retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    #: Seconds a job must go unheard from (its ranks exited, or silent) before the
    #: controller forgets it from memory (``controller.services.job_retention``): its rows
    #: stay in the database, but ``GET /api/v1/jobs`` no longer lists it. A day keeps
    #: yesterday's jobs in view while months of short jobs cannot pile up. Keep it well
    #: above the agents' report interval: a job forgotten between two of its reports
    #: comes back as a new one (fresh detector windows). A remediation in flight holds its
    #: job whatever this says.
    job_retention_s: float = Field(default=86_400.0, ge=1, le=365 * 86_400)
    #: Prometheus (its base URL, ``http://prometheus:9090``) that scrapes the agents: the
    #: dashboard's GPU history charts query it (``query_range``) instead of ``gpu_history``;
    #: when it does not answer, they fall back to ``gpu_history`` and say so.
    prometheus_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://\S+$")
    prometheus_timeout_s: float = Field(default=5.0, gt=0, le=60)
    #: Every report waits up to this long for its commit. Bounded well inside the agents'
    #: ``report_timeout_s`` (10 s by default): an interval of minutes (or ``1e308``) held
    #: each report until ``ingest_flush_max_rows`` rows queued, and the agents' requests
    #: timed out and were resent for ever.
    ingest_flush_interval_s: float = Field(default=0.02, ge=0, le=5)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    #: A command an agent has not acknowledged this long after it was queued is marked
    #: ``expired`` (the agent was down or the reply was lost); the operator re-issues it.
    command_expire_after_s: float = Field(default=300.0, gt=0)
    #: Flush the group-commit queue before the interval ends once this many rows wait.
    ingest_flush_max_rows: int = Field(default=20_000, ge=1)
    #: PostgreSQL cancels any one statement of the controller's own transactions (the group
    #: commit, operator writes, reads; not migrations, not the leader lock) that runs this
    #: long, and the call answers 503 "retry later"; 0: no limit. A COMMIT waiting for a
    #: lost synchronous replica, or an upsert waiting for a row another session locked,
    #: otherwise held the group commit, and every report with it, for ever.
    database_statement_timeout_s: float = Field(default=30.0, ge=0, le=3600)
    #: ``/readyz`` answers 503 while one database write (a group commit, an operator's
    #: write) has been in flight this long: past the agents' 10-s report timeout every
    #: report waiting on it has failed, and a replica stuck on a hung server should say so.
    database_write_stalled_after_s: float = Field(default=10.0, gt=0, le=3600)
    #: Fabric for the traffic planner (YAML/JSON, ``docs/traffic.md``); none disables planning.
    topology_file: Path | None = None
    #: Or build the fabric from reporting nodes' ``topology.trainguard.io/nic<k>`` labels:
    #: ``{spines, oversubscription, port_speed_gbps}`` for what no node can know.
    topology_labels: dict[str, Any] | None = None
    #: Power-domain tree (YAML/JSON, see docs/power.md); validated at start. When unset,
    #: the tree last put through ``PUT /api/v1/power/domains`` is used, if any.
    power_domains_file: Path | None = None
    #: Run the power policy (send caps). Default: on whenever a domain tree is configured.
    power_enabled: bool | None = None
    #: Seconds between two power-policy ticks when no report arrives (stale detection).
    power_tick_interval_s: float = Field(default=1.0, gt=0, le=60)
    #: Seconds of training ahead at which a link-probe round is scheduled (docs/detection.md):
    #: the command rides an agent's report reply, then the ranks' next poll, so it must
    #: exceed a report interval with margin. Tests with 0.5 s reports use a few seconds.
    probe_lead_s: float = Field(default=15.0, gt=0, le=600)
    #: Remediation policy (YAML/JSON, docs/remediation.md); unset: the built-in defaults.
    policy_file: Path | None = None
    #: Record what the policy would do without doing it (overrides the policy's own flag).
    policy_dry_run: bool | None = None
    #: How actions reach the world: ``local`` (processes on this machine, the embedded
    #: default's jobs from ``local_jobs_file``), ``kubernetes`` (cordon, evict, restart
    #: workloads in ``kube_namespace``) or ``none`` (decide and record only).
    actuator: Literal["none", "local", "kubernetes"] = "none"
    # A Kubernetes namespace is an RFC 1123 label: refused at start rather than by the API
    # server at the first cordon or restart, in the middle of a remediation.
    kube_namespace: str = Field(
        default="default", min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN
    )
    #: Jobs the local actuator launches when this replica becomes leader (YAML list of
    #: job specs, docs/remediation.md). Read from a file, never from the API: a job spec is
    #: a command line, and the API must not be a way to run commands on the controller.
    local_jobs_file: Path | None = None
    #: Seconds between two ticks of the remediation engine: how soon it decides on a new
    #: incident and notices a step's answer (policy windows are in seconds of their own).
    remediation_tick_interval_s: float = Field(default=1.0, gt=0, le=60)
    #: With the policy's ``restarts.grow`` on, the leader looks this often (at its next
    #: tick) for jobs running below their first size to grow back.
    remediation_grow_check_interval_s: float = Field(default=5.0, gt=0, le=3_600)
    #: Elect one acting replica per database (docs/controller.md, "High availability"):
    #: a PostgreSQL advisory lock, or a ``<database file>.leader`` flock on SQLite. Turn it
    #: off only where a single replica is guaranteed by other means.
    leader_election: bool = True
    #: Replicas with the same name on the same database compete for one lock; a different
    #: name lets an unrelated controller (e.g. a staging one) share the database server.
    leader_election_name: str = Field(
        default="trainguard", min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$"
    )
    #: Seconds between a standby's attempts to take the lock: bounds failover time.
    leader_retry_interval_s: float = Field(default=1.0, gt=0, le=30)
    #: Seconds between the leader's checks that it still holds the lock (PostgreSQL: one
    #: query on the lock connection): bounds how long a cut-off leader keeps acting.
    leader_check_interval_s: float = Field(default=1.0, gt=0, le=30)
    #: Campaign for the lock only once a readiness probe (``/readyz``) has been answered
    #: 200, i.e. once the orchestrator routes to this replica; until then ``/readyz``
    #: answers as a standby's would. The chart turns it on: a pod whose first probe came
    #: before it listened is not Ready for a whole probe period (5 s), and as the leader
    #: in that time it would leave the API unanswered. Off (local runs, where nothing
    #: probes): the first try comes as soon as the server listens.
    leader_campaign_after_ready: bool = False
    #: Which lock elects the acting replica: ``lease``, a ``coordination.k8s.io/v1`` Lease
    #: (``leader_lease_namespace``) whose generation also fences every write the Kubernetes
    #: actuator makes; ``database``, the lock above; ``auto``, the Lease when running in a
    #: pod, the database otherwise (the local mode). The leader renews the Lease every
    #: ``leader_check_interval_s``.
    leader_election_backend: Literal["auto", "database", "lease"] = "auto"
    #: Namespace of the Lease; empty: the pod's own namespace, else ``kube_namespace``.
    leader_lease_namespace: str = Field(
        default="", max_length=63, pattern=f"^$|{DNS_LABEL_PATTERN}"
    )
    #: This replica's holder identity in the Lease; empty: ``$POD_NAME`` (else the host
    #: name) and a random suffix, so a restarted pod is a new candidate.
    leader_identity: str = Field(default="", max_length=128)
    #: A standby takes the Lease over once it has seen it unrenewed this long …
    leader_lease_duration_s: float = Field(default=15.0, gt=0, le=300)
    #: … and a leader that could not renew for this long stops acting (and writing) first.
    leader_lease_renew_deadline_s: float = Field(default=10.0, gt=0, le=300)

    #: Partitions (docs/kubernetes.md, "Partitions and mass failures"): a node whose agent
    #: is silent (``node_lost_after_s``) while the platform says it is fine is *unreachable*
    #: and left alone until a second signal agrees (its Node not Ready, its pods gone, its
    #: job's ranks failing). When at least this share of the known nodes …
    partition_mass_silence_share: float = Field(default=0.3, gt=0, le=1)
    #: … and at least this many are silent at once, the fault is taken to be the
    #: controller's own (network, DNS, ingress): no node is acted on.
    partition_mass_silence_min_nodes: int = Field(default=3, ge=1)
    #: At most this share of the known nodes (at least one) is quarantined per
    #: ``quarantine_budget_window_s``; the next quarantine is refused and a critical
    #: ``quarantine_budget`` incident asks a human. Unlike the policy's circuit breaker it
    #: cannot be changed through the API.
    quarantine_budget_share: float = Field(default=0.1, gt=0, le=1)
    quarantine_budget_window_s: float = Field(default=3600.0, gt=0, le=7 * 86_400)
    #: The ``webhook`` remediation step POSTs each remediation here (docs/remediation.md,
    #: "Webhook step"), signed with HMAC-SHA256 under ``remediation_webhook_secret`` (or the
    #: secret in ``remediation_webhook_secret_file``); empty: the step records that it has
    #: nowhere to send.
    remediation_webhook_url: str = Field(default="", max_length=2048, pattern=r"^(https?://\S+)?$")
    remediation_webhook_secret: SecretStr | None = None
    remediation_webhook_secret_file: Path | None = None
    #: Seconds one attempt may take; failed attempts (connection errors, timeouts, 429,
    #: 5xx) are retried this many times with exponential backoff.
    remediation_webhook_timeout_s: float = Field(default=5.0, gt=0, le=120)
    remediation_webhook_retries: int = Field(default=3, ge=0, le=10)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("TRAINGUARD_CONFIG_FILE")
        if config_file:
            sources.append(_ConfigFile(settings_cls, yaml_file=config_file))
        return tuple(sources)

    @field_validator("database_url")
    @classmethod
    def _usable_database_url(cls, value: str) -> str:
        return check_database_url(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _load_tokens_and_refuse_unsafe(self) -> Self:
        if self.tokens_file is not None:
            self.tokens = [*self.tokens, *load_tokens_file(self.tokens_file)]
        names = [t.name for t in self.tokens]
        if len(names) != len(set(names)):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"token names must be unique ({', '.join(map(repr, twice))} twice)")
        if self.dev_mode:
            return self
        if not self.tokens:
            raise ValueError(
                "no API tokens configured: set TRAINGUARD_TOKENS or tokens_file "
                "(or dev_mode for a local demo)"
            )
        for entry in self.tokens:
            if entry.token is not None and len(entry.token) < MIN_TOKEN_LENGTH:
                raise ValueError(
                    f"token {entry.name!r} is shorter than {MIN_TOKEN_LENGTH} characters; "
                    "use a longer random token (e.g. `openssl rand -hex 24`)"
                )
        return self

    @model_validator(mode="after")
    def _webhook_secret(self) -> Self:
        if self.remediation_webhook_url and not self.webhook_secret():
            raise ValueError(
                "remediation_webhook_url needs remediation_webhook_secret or "
                "remediation_webhook_secret_file (receivers verify the HMAC signature)"
            )
        return self

    def webhook_secret(self) -> bytes:
        """The webhook's shared secret (the file's content, stripped, wins). A leading
        UTF-8 byte-order mark is an editor's (Notepad, PowerShell), not the secret's: kept,
        it signed every delivery with a key the receiver does not hold."""
        if self.remediation_webhook_secret_file is not None:
            path = self.remediation_webhook_secret_file
            try:  # never a wait on a FIFO nor an endless device (trainguard.textfile)
                data = read_bytes(path, max_bytes=MAX_SECRET_BYTES)
                return data.removeprefix(codecs.BOM_UTF8).strip()
            except Unreadable as exc:
                raise ValueError(f"remediation_webhook_secret_file {path}: {exc.reason}") from None
        if self.remediation_webhook_secret is not None:
            return self.remediation_webhook_secret.get_secret_value().encode()
        return b""

    @model_validator(mode="after")
    def _lease_timings(self) -> Self:
        if self.leader_election_backend == "lease" and not (
            self.leader_check_interval_s
            < self.leader_lease_renew_deadline_s
            < self.leader_lease_duration_s
        ):
            raise ValueError(
                "leader election needs leader_check_interval_s < leader_lease_renew_deadline_s"
                f" < leader_lease_duration_s (got {self.leader_check_interval_s}, "
                f"{self.leader_lease_renew_deadline_s}, {self.leader_lease_duration_s}): a "
                "leader must stop acting before its Lease can expire for the others"
            )
        return self

    @field_validator("power_domains_file")
    @classmethod
    def _valid_power_domains(cls, value: Path | None) -> Path | None:
        if value is not None:
            from power import ConfigError, parse_domains
            from power.domains import read_domains_document

            # The error is reported under the field's name already (cmd_serve.settings_error);
            # it names the file here, which a problem in the tree's content did not.
            try:
                document = read_domains_document(value)  # names the file itself
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            try:
                parse_domains(document)
            except ConfigError as exc:
                raise ValueError(f"{value}: {exc}") from None
        return value

    def database_kind(self) -> Literal["sqlite", "postgresql"]:
        return "sqlite" if self.database_url.startswith("sqlite") else "postgresql"


def check_database_url(value: str) -> str:
    """SQLite or PostgreSQL, with a driver this install has: a ``ValueError`` of one line
    here rather than SQLAlchemy's exception when the engine is made."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    usage = "use sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"
    try:
        url = make_url(value)
    except ArgumentError:
        raise ValueError(f"not a database URL; {usage}") from None
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(f"unsupported database {url.drivername!r}; {usage}")
    try:
        url.get_dialect().import_dbapi()
    except (NoSuchModuleError, ImportError):
        raise ValueError(f"no driver {url.drivername!r} in this install; {usage}") from None
    return value


class ConfigFileError(ValueError):
    """``TRAINGUARD_CONFIG_FILE`` cannot be used; the message is one line naming it."""


class _ConfigFile(YamlConfigSettingsSource):
    """The YAML settings file, with one-line errors for a file that is missing or cannot be
    read (pydantic-settings would skip it silently), is not YAML, holds something other
    than a mapping of settings, or names a setting that does not exist.

    Unknown keys are refused here although ``extra="ignore"`` lets unknown ``TRAINGUARD_*``
    environment variables pass (the agents share that prefix): a key in this file is meant
    for the controller, and a typo (``node_lost_afer_s: 5``) ignored would silently keep the
    default.
    """

    def __init__(self, settings_cls: type[BaseSettings], yaml_file: str) -> None:
        # Matched as pydantic-settings matches them (case-insensitively, by default).
        self._known = sorted(name.lower() for name in settings_cls.model_fields)
        super().__init__(settings_cls, yaml_file=yaml_file)

    def _read_files(self, files: Any, deep_merge: bool = False) -> dict[str, Any]:
        return self._read_file(Path(files).expanduser())

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        what = f"config file {file_path}"
        try:
            raw = load_yaml(read_text(str(file_path)))
        except Unreadable as exc:
            raise ConfigFileError(f"{what}: {exc.reason}") from None
        except Unparsable as exc:
            raise ConfigFileError(f"{what}: not valid YAML: {exc.reason}") from None
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise ConfigFileError(
                f"{what}: expected a mapping of settings (name: value), got a {type(raw).__name__}"
            )
        unknown = [key for key in raw if str(key).lower() not in self._known]
        if unknown:
            raise ConfigFileError(f"{what}: " + "; ".join(map(self._unknown, unknown)))
        # Settings match case-insensitively, so ``Port: 1`` and ``port: 2`` name one setting:
        # the loader's duplicate check (case-sensitive, as YAML is) let both through and one
        # value was dropped without a word.
        seen: dict[str, object] = {}
        for key in raw:
            folded = str(key).lower()
            if folded in seen:
                raise ConfigFileError(
                    f"{what}: setting {folded!r} given twice ({str(seen[folded])!r} and "
                    f"{str(key)!r}; names are case-insensitive)"
                )
            seen[folded] = key
        return raw

    def _unknown(self, key: object) -> str:
        close = difflib.get_close_matches(str(key).lower(), self._known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown setting {str(key)!r}{hint}"


def load_tokens_file(path: Path) -> list[TokenConfig]:
    try:
        raw = load_yaml(read_text(path))
    except Unreadable as exc:
        raise ValueError(f"tokens_file {path}: {exc.reason}") from None
    except Unparsable as exc:
        raise ValueError(f"tokens_file {path}: not valid YAML: {exc.reason}") from None
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"tokens_file {path}: expected a YAML list of tokens")
    tokens = []
    for i, item in enumerate(raw):
        # Validated here, one entry at a time, so the error names the file and the entry:
        # raised from the settings' validator, pydantic's own error lost both
        # ("rolee: Extra inputs are not permitted", or no field at all for a bare string).
        try:
            tokens.append(TokenConfig.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = "".join(f".{part}" for part in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise ValueError(f"tokens_file {path}: [{i}]{where}: {msg}") from None
    return tokens


def generate_dev_tokens(path: Path) -> list[TokenConfig]:
    """Random tokens for every role, written (mode 0600) to ``path`` so a human can use them.

    Only dev mode calls this; the values go to the file and never to the log.
    """
    tokens = [
        TokenConfig(name=f"dev-{role}", role=role, token=secrets.token_urlsafe(24))
        for role in ("agent", "viewer", "operator")
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode is not applied to a file left there before
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump([t.model_dump(exclude_none=True) for t in tokens], handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return tokens
