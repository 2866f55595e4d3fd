"""What each resource looks like on the command line: its columns, its name, its detail view.

The CLI commands and ``trainguard demo`` both render through these functions, so the demo
shows exactly what an operator would see typing ``trainguard incidents``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.cli.output import (
    EMPTY,
    Column,
    OutputFormat,
    age,
    age_of,
    align,
    binary_size,
    cell,
    dump_json,
    dump_yaml,
    field,
    human_age,
    table_of,
    unit,
)
from trainguard.cli.replies import printable

JsonObject = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResourceView:
    kind: str
    plural: str
    columns: tuple[Column, ...]
    key: str = "name"

    def name_of(self, item: JsonObject) -> str:
        # One line per object, without escape sequences: ``-o name`` lands on terminals
        # and in ``xargs`` as much as tables do.
        return f"{self.kind}/{printable(str(item.get(self.key)), None)}"


def _ratio(num_key: str, den_key: str) -> Callable[[JsonObject, float], str]:
    return lambda item, _now: f"{cell(item.get(num_key))}/{cell(item.get(den_key))}"


def _watts(key: str) -> Callable[[JsonObject, float], str]:
    return lambda item, _now: unit(item.get(key), "W")


def _gpu_count(item: JsonObject, _now: float) -> str:
    """GPU count, marked ``(sim)`` when the agent simulates them: never mistaken for real."""
    count = cell(item.get("gpu_count"))
    return f"{count} (sim)" if item.get("backend") == "sim" else count


NODES = ResourceView(
    kind="node",
    plural="nodes",
    columns=(
        Column("NAME", field("name")),
        Column("HEALTH", field("health")),
        Column("GPUS", _gpu_count),
        Column("UNHEALTHY-GPUS", field("gpus_unhealthy")),
        Column("INCIDENTS", field("open_incidents")),
        Column("LAST-REPORT", age_of("last_report_unix_s")),
        Column("AGE", age_of("first_seen_unix_s")),
        Column("POWER", _watts("power_w"), wide=True),
        Column("BACKEND", field("backend"), wide=True),
        Column("AGENT", field("agent_version"), wide=True),
        Column("HOSTNAME", field("hostname"), wide=True),
        Column("REASON", field("health_reason"), wide=True),
    ),
)

JOBS = ResourceView(
    kind="job",
    plural="jobs",
    columns=(
        Column("NAME", field("name")),
        Column("STATE", field("state")),
        Column("RANKS", _ratio("ranks_reporting", "world_size")),
        Column("LAST-STEP", field("last_step")),
        Column("INCIDENTS", field("open_incidents")),
        Column("AGE", age_of("first_seen_unix_s")),
        Column("LAST-SEEN", age_of("last_seen_unix_s"), wide=True),
        Column("NODES", field("nodes"), wide=True),
    ),
)

#: ``jobs --history``: every stored job. SOURCE says where each row comes from (``live``:
#: the controller's memory; ``history``: the database, for a job that left memory after
#: ``job_retention_s``, STATE ``ended``), and LAST-SEEN when it was last heard from.
JOBS_HISTORY = ResourceView(
    kind="job",
    plural="jobs",
    columns=(
        Column("NAME", field("name")),
        Column("STATE", field("state")),
        Column("SOURCE", field("source")),
        Column("RANKS", _ratio("ranks_reporting", "world_size")),
        Column("LAST-STEP", field("last_step")),
        Column("INCIDENTS", field("open_incidents")),
        Column("AGE", age_of("first_seen_unix_s")),
        Column("LAST-SEEN", age_of("last_seen_unix_s")),
        Column("NODES", field("nodes"), wide=True),
    ),
)

RANKS = ResourceView(
    kind="rank",
    plural="ranks",
    key="rank",
    columns=(
        Column("RANK", field("rank")),
        Column("NODE", field("node")),
        Column("GPU", field("gpu_index")),
        Column("STATE", field("state")),
        Column("LAST-STEP", field("last_step")),
        Column("LAST-SEEN", age_of("last_seen_unix_s")),
        Column("PID", field("pid"), wide=True),
    ),
)

INCIDENTS = ResourceView(
    kind="incident",
    plural="incidents",
    key="id",
    columns=(
        Column("ID", field("id")),
        Column("KIND", field("kind")),
        Column("SEVERITY", field("severity")),
        Column("STATE", field("state")),
        Column("NODE", field("node")),
        Column("GPU", field("gpu_index")),
        Column("JOB", field("job")),
        Column("AGE", age_of("opened_unix_s")),
        Column("RANKS", field("ranks"), wide=True),
        Column("RESOLVED", age_of("resolved_unix_s"), wide=True),
        Column("EVIDENCE", lambda item, _now: incident_evidence_cell(item), wide=True),
        Column("SUMMARY", field("summary")),
    ),
)

ACTIONS = ResourceView(
    kind="action",
    plural="actions",
    key="id",
    columns=(
        Column("ID", field("id")),
        Column("KIND", field("kind")),
        Column("TARGET", field("target")),
        Column("TRIGGER", field("trigger")),
        Column("STATUS", field("status")),
        Column("AGE", age_of("created_unix_s")),
        Column("DURATION", lambda item, _now: _duration(item.get("duration_s"))),
        Column("FINISHED", age_of("finished_unix_s"), wide=True),
        Column("PARAMS", lambda item, _now: action_params_cell(item), wide=True),
        Column("OUTCOME", field("outcome"), wide=True),
    ),
)

#: Shown in their own columns (TRIGGER) or implied by TARGET: left out of PARAMS.
_TRIGGER_FIELDS = frozenset({"incident", "incident_kind", "remediation", "job"})


def action_params_cell(item: JsonObject) -> str:
    """An action's own parameters, read through the controller's model of its kind (the
    one the API schema publishes): what it did, without what triggered it. Parameters that
    do not fit the model (another release's) are shown as they came."""
    from pydantic import ValidationError

    from controller.logic.remediation.params import ActionParams, parse_params

    raw = item.get("params")
    try:
        typed = parse_params(str(item.get("kind", "")), raw)
    except ValidationError:
        return cell(raw)
    if not isinstance(typed, ActionParams):
        return cell(typed)
    own = {k: v for k, v in typed.to_params().items() if k not in _TRIGGER_FIELDS}
    return cell(own)


def incident_evidence_cell(item: JsonObject) -> str:
    """An incident's telling evidence fields, read through the controller's model of its
    kind (the one the API schema publishes; ``BRIEF`` names the fields). Evidence the API
    flagged (``evidence_error``) or of a kind without a model is shown as it came."""
    from controller.logic.detection.evidence_kinds import typed_evidence

    raw = item.get("evidence")
    typed = None if item.get("evidence_error") else typed_evidence(str(item.get("kind")), raw)
    if typed is None:
        return cell(raw)
    return ",".join(f"{k}={cell(v)}" for k, v in typed.brief().items()) or EMPTY


def _duration(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, int | float) else cell(value)


def _latest(key: str, fmt: Callable[[Any], str]) -> Callable[[JsonObject, float], str]:
    def get(item: JsonObject, _now: float) -> str:
        latest = item.get("latest") or {}
        return fmt(latest.get(key))

    return get


GPUS = ResourceView(
    kind="gpu",
    plural="gpus",
    key="index",
    columns=(
        Column("GPU", field("index")),
        Column("HEALTH", field("health")),
        Column("POWER", _latest("power_w", lambda v: unit(v, "W"))),
        Column("TEMP", _latest("temperature_c", lambda v: unit(v, "C"))),
        Column("SM-CLOCK", _latest("sm_clock_mhz", lambda v: unit(v, "MHz"))),
        Column("UTIL", _latest("utilization_gpu_pct", lambda v: unit(v, "%"))),
        Column("MEM-USED", _latest("memory_used_bytes", binary_size)),
        Column("ECC-UNCORR", _latest("ecc_uncorrected_total", cell), wide=True),
        Column("ECC-CORR", _latest("ecc_corrected_total", cell), wide=True),
        Column("THROTTLE", _latest("throttle_reasons", cell), wide=True),
        Column("UUID", field("uuid"), wide=True),
        Column("MODEL", field("name"), wide=True),
        Column("REASON", field("health_reason")),
    ),
)


def render_list(
    view: ResourceView,
    items: Sequence[JsonObject],
    fmt: OutputFormat,
    *,
    now_unix_s: float | None = None,
) -> str | None:
    """The text for a list in ``fmt``; ``None`` means "nothing to show" for table formats."""
    if fmt is OutputFormat.JSON:
        return dump_json(list(items))
    if fmt is OutputFormat.YAML:
        return dump_yaml(list(items))
    if not items:
        return None
    if fmt is OutputFormat.NAME:
        return "\n".join(view.name_of(item) for item in items)
    now = time.time() if now_unix_s is None else now_unix_s
    return table_of(items, view.columns, wide=fmt is OutputFormat.WIDE, now_unix_s=now)


def _describe(pairs: Sequence[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in pairs) + 2
    return "\n".join(f"{(label + ':').ljust(width)}{value}" for label, value in pairs)


def _render_detail(
    detail: JsonObject,
    fmt: OutputFormat,
    view: ResourceView,
    header: Callable[[float], list[tuple[str, str]]],
    rows: tuple[str, ResourceView, str],
    now_unix_s: float | None,
) -> str:
    """A describe-style header (``header(now)``), then one row per item of
    ``detail[rows[0]]`` in ``rows[1]``'s columns (``rows[2]`` when there is none); the
    machine formats print ``detail`` itself, as ``view`` names it."""
    if fmt is OutputFormat.JSON:
        return dump_json(detail)
    if fmt is OutputFormat.YAML:
        return dump_yaml(detail)
    if fmt is OutputFormat.NAME:
        return view.name_of(detail)
    now = time.time() if now_unix_s is None else now_unix_s
    body = _describe(header(now))
    key, row_view, none = rows
    items = detail.get(key) or []
    if not items:
        return body + "\n\n" + none
    wide = fmt is OutputFormat.WIDE
    return body + "\n\n" + table_of(items, row_view.columns, wide=wide, now_unix_s=now)


def render_node(detail: JsonObject, fmt: OutputFormat, *, now_unix_s: float | None = None) -> str:
    """``trainguard node NAME``: a describe-style header, then one row per GPU."""

    def header(now: float) -> list[tuple[str, str]]:
        reason = detail.get("health_reason")
        health = cell(detail.get("health")) + (f" ({cell(reason)})" if reason else "")
        gpus = f"{cell(detail.get('gpu_count'))} ({cell(detail.get('gpus_unhealthy'))} unhealthy)"
        pairs = [
            ("Name", cell(detail.get("name"))),
            ("Health", health),
            ("Hostname", cell(detail.get("hostname"))),
            ("Backend", _backend(detail.get("backend"))),
            ("Agent version", cell(detail.get("agent_version"))),
            ("GPUs", gpus),
            ("Power", unit(detail.get("power_w"), " W")),
            ("Open incidents", cell(detail.get("open_incidents"))),
            ("Last report", _ago(detail.get("last_report_unix_s"), now)),
            ("First seen", _ago(detail.get("first_seen_unix_s"), now)),
            ("Labels", cell(detail.get("labels"))),
        ]
        if fmt is OutputFormat.WIDE:
            pairs.append(("History points", str(len(detail.get("history") or []))))
        return pairs

    return _render_detail(
        detail, fmt, NODES, header, ("gpus", GPUS, "No GPUs reported."), now_unix_s
    )


#: The State line of a job the controller answered from its database.
ENDED_NOTE = (
    "ended (left the controller's memory after job_retention_s; "
    "shown as the database last stored it, nothing reports for it)"
)


def render_job(detail: JsonObject, fmt: OutputFormat, *, now_unix_s: float | None = None) -> str:
    """``trainguard job NAME``: a describe-style header, then one row per rank. A job that
    left memory says so on its State line: its ranks are as last written, not live."""

    def header(now: float) -> list[tuple[str, str]]:
        history = detail.get("source") == "history"
        return [
            ("Name", cell(detail.get("name"))),
            ("State", ENDED_NOTE if history else cell(detail.get("state"))),
            ("Source", cell(detail.get("source"))),
            ("Ranks", _ratio("ranks_reporting", "world_size")(detail, now) + " reporting"),
            ("Last step", cell(detail.get("last_step"))),
            ("Nodes", cell(detail.get("nodes"))),
            ("Open incidents", cell(detail.get("open_incidents"))),
            ("Last seen", _ago(detail.get("last_seen_unix_s"), now)),
            ("First seen", _ago(detail.get("first_seen_unix_s"), now)),
        ]

    return _render_detail(
        detail, fmt, JOBS, header, ("ranks", RANKS, "No ranks reported."), now_unix_s
    )


def _backend(value: Any) -> str:
    if value == "sim":
        return "sim (simulated GPUs, not real hardware)"
    return "nvml (real GPUs)" if value == "nvml" else cell(value)


def _ago(unix_s: Any, now: float) -> str:
    text = age(unix_s, now)
    return text if text == EMPTY else f"{text} ago"


def render_status(status: JsonObject, server: str, fmt: OutputFormat) -> str:
    """``trainguard status``: one line per fact, counts broken down the way they are asked."""
    if fmt is OutputFormat.JSON:
        return dump_json(status)
    if fmt is OutputFormat.YAML:
        return dump_yaml(status)
    by_health = status.get("nodes_by_health") or {}
    by_kind = status.get("incidents_open_by_kind") or {}
    pairs = [
        ("CONTROLLER", server),
        ("VERSION", cell(status.get("version"))),
        ("DATABASE", cell(status.get("database"))),
        ("NODES", _breakdown(status.get("nodes_total"), by_health)),
        (
            "GPUS",
            f"{cell(status.get('gpus_total'))} ({cell(status.get('gpus_unhealthy'))} unhealthy)",
        ),
        ("JOBS", cell(status.get("jobs_total"))),
        ("INCIDENTS", _breakdown(status.get("incidents_open"), by_kind, "open")),
        ("REPORTS", cell(status.get("reports_total"))),
        ("UPTIME", human_age(status.get("uptime_s"))),
    ]
    return align(pairs)


def _breakdown(total: Any, parts: dict[str, Any], label: str = "") -> str:
    head = cell(total) + (f" {label}" if label else "")
    inner = ", ".join(f"{cell(k)} {cell(v)}" for k, v in sorted(parts.items()) if v)
    return f"{head} ({inner})" if inner else head


__all__ = [
    "ACTIONS",
    "GPUS",
    "INCIDENTS",
    "JOBS",
    "JOBS_HISTORY",
    "NODES",
    "RANKS",
    "ResourceView",
    "render_job",
    "render_list",
    "render_node",
    "render_status",
]
