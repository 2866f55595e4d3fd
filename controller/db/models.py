"""Database rows. Public API shapes live in ``controller.schemas``; these are storage only.

Times are POSIX seconds as doubles (``*_unix_s``). The hot tables are ``gpu_history``
(one row per GPU per report window, downsampled by the ingest path) and ``agent_cursors``
(the dedupe high-water mark per agent instance); both are written with Core bulk statements,
never per-row ORM objects.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainguard.limits import (
    KEY_LEN,
    KIND_LEN,
    LABEL_LEN,
    NAME_LEN,
    STATE_LEN,
    TOKEN_LEN,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Column limits come from the one declaration the door's validation also uses
# (``trainguard.limits``, issue 14): the wire format refuses what these columns cannot hold.
# Changing one is a migration. Integers: ``Integer`` holds -2**31 .. 2**31-1, ``BigInteger``
# -2**63 .. 2**63-1 on PostgreSQL (SQLite holds 64 bits in both).


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, float: Double}


class Node(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(NAME_LEN), default="")
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    backend: Mapped[str] = mapped_column(String(STATE_LEN), default="")
    agent_version: Mapped[str] = mapped_column(String(TOKEN_LEN), default="")
    driver_version: Mapped[str] = mapped_column(String(TOKEN_LEN), default="")
    health: Mapped[str] = mapped_column(String(STATE_LEN), default="unknown")
    health_reason: Mapped[str] = mapped_column(Text, default="")
    gpu_count: Mapped[int] = mapped_column(Integer, default=0)
    power_w: Mapped[float | None]
    spool_dropped_total: Mapped[int] = mapped_column(BigInteger, default=0)
    first_seen_unix_s: Mapped[float]
    last_report_unix_s: Mapped[float | None]
    #: Set while the remediation engine keeps work off the node (``None``: not isolated).
    isolated_reason: Mapped[str | None] = mapped_column(Text)
    isolated_unix_s: Mapped[float | None]


class Gpu(Base):
    __tablename__ = "gpus"

    node_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    uuid: Mapped[str] = mapped_column(String(LABEL_LEN), default="")
    name: Mapped[str] = mapped_column(String(LABEL_LEN), default="")
    pci_bus_id: Mapped[str] = mapped_column(String(TOKEN_LEN), default="")
    memory_total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    health: Mapped[str] = mapped_column(String(STATE_LEN), default="healthy")
    health_reason: Mapped[str] = mapped_column(Text, default="")
    #: Last uncorrectable-ECC count seen: the baseline growth is measured against, kept
    #: across controller restarts so errors during an outage are not missed.
    ecc_uncorrected_total: Mapped[int | None] = mapped_column(BigInteger)


class AgentCursor(Base):
    """Highest report ``seq`` stored per agent instance: the dedupe high-water mark."""

    __tablename__ = "agent_cursors"

    node_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True
    )
    agent_instance: Mapped[str] = mapped_column(String(TOKEN_LEN), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    updated_unix_s: Mapped[float]


class GpuHistory(Base):
    __tablename__ = "gpu_history"
    __table_args__ = (
        Index(None, "node_name", "end_unix_s"),
        Index(None, "end_unix_s"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    node_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("nodes.name", ondelete="CASCADE")
    )
    gpu_index: Mapped[int] = mapped_column(Integer)
    start_unix_s: Mapped[float]
    end_unix_s: Mapped[float]
    samples: Mapped[int] = mapped_column(Integer)
    power_w_avg: Mapped[float | None]
    power_w_max: Mapped[float | None]
    temperature_c_max: Mapped[float | None]
    sm_clock_mhz_avg: Mapped[float | None]
    utilization_gpu_pct_avg: Mapped[float | None]
    memory_used_bytes_max: Mapped[int | None] = mapped_column(BigInteger)
    ecc_corrected_total: Mapped[int | None] = mapped_column(BigInteger)
    ecc_uncorrected_total: Mapped[int | None] = mapped_column(BigInteger)
    throttle_reasons_mask: Mapped[int] = mapped_column(BigInteger, default=0)


class Job(Base):
    __tablename__ = "jobs"
    #: A new leader reads back only the jobs heard from within ``job_retention_s``
    #: (``controller.loader``): without it that read scanned every job ever stored.
    __table_args__ = (Index(None, "last_seen_unix_s"),)

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    first_seen_unix_s: Mapped[float]
    last_seen_unix_s: Mapped[float]


class Rank(Base):
    __tablename__ = "ranks"

    job_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("jobs.name", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    node_name: Mapped[str] = mapped_column(String(NAME_LEN))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    local_rank: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(STATE_LEN), default="running")
    exit_code: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    last_seen_unix_s: Mapped[float]


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index(None, "job_name", "step"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    job_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("jobs.name", ondelete="CASCADE")
    )
    rank: Mapped[int] = mapped_column(Integer)
    node_name: Mapped[str] = mapped_column(String(NAME_LEN))
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(STATE_LEN))
    #: Which copy of the step the event is about (``CheckpointEvent.tier``): ``local`` (the
    #: rank's disk: started ... committed) or ``object_store`` (upload_pending ... uploaded).
    #: The server default fills rows written by a controller that does not know the column.
    tier: Mapped[str] = mapped_column(String(STATE_LEN), default="local", server_default="local")
    blocking_s: Mapped[float | None]
    duration_s: Mapped[float | None]
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str] = mapped_column(Text, default="")
    time_unix_s: Mapped[float]


class Incident(Base):
    __tablename__ = "incidents"
    __table_args__ = (Index(None, "state", "kind"), Index(None, "opened_unix_s"))

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    kind: Mapped[str] = mapped_column(String(KIND_LEN))
    severity: Mapped[str] = mapped_column(String(STATE_LEN))
    state: Mapped[str] = mapped_column(String(STATE_LEN), default="open")
    summary: Mapped[str] = mapped_column(Text)
    node_name: Mapped[str | None] = mapped_column(String(NAME_LEN))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    job_name: Mapped[str | None] = mapped_column(String(NAME_LEN))
    ranks: Mapped[list[Any]] = mapped_column(default=list)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    #: Open incidents with the same key are one incident (an XID storm is one record).
    dedupe_key: Mapped[str] = mapped_column(String(KEY_LEN))
    count: Mapped[int] = mapped_column(BigInteger, default=1)
    opened_unix_s: Mapped[float]
    updated_unix_s: Mapped[float]
    resolved_unix_s: Mapped[float | None]


class Action(Base):
    __tablename__ = "actions"
    #: ``trigger``: the remediation engine looks up the actions of open incidents.
    __table_args__ = (Index(None, "created_unix_s"), Index(None, "trigger"))

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    kind: Mapped[str] = mapped_column(String(TOKEN_LEN))
    target: Mapped[str] = mapped_column(String(KEY_LEN))
    trigger: Mapped[str] = mapped_column(String(LABEL_LEN))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(STATE_LEN), default="pending")
    outcome: Mapped[str] = mapped_column(Text, default="")
    created_unix_s: Mapped[float]
    finished_unix_s: Mapped[float | None]


class Command(Base):
    __tablename__ = "commands"
    __table_args__ = (Index(None, "node_name", "status"),)

    id: Mapped[str] = mapped_column(String(TOKEN_LEN), primary_key=True)
    node_name: Mapped[str] = mapped_column(
        String(NAME_LEN), ForeignKey("nodes.name", ondelete="CASCADE")
    )
    kind: Mapped[str] = mapped_column(String(KIND_LEN))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(STATE_LEN), default="pending")
    reason: Mapped[str] = mapped_column(Text, default="")
    created_unix_s: Mapped[float]
    sent_unix_s: Mapped[float | None]
    finished_unix_s: Mapped[float | None]


class PowerDomain(Base):
    """A node in the power hierarchy (datacenter > row > rack > server > GPU)."""

    __tablename__ = "power_domains"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    kind: Mapped[str] = mapped_column(String(STATE_LEN))
    parent: Mapped[str | None] = mapped_column(
        String(NAME_LEN), ForeignKey("power_domains.name", ondelete="CASCADE")
    )
    provisioned_power_w: Mapped[float | None]
    node_name: Mapped[str | None] = mapped_column(String(NAME_LEN))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)


class TrafficPlanVersion(Base):
    """One version of a job's traffic plan (``controller.services.traffic.service``).

    Every version is kept, so the history an operator sees survives restarts; ``document``
    holds the summary and, for restoring the newest version, each flow's path and port.
    """

    __tablename__ = "traffic_plans"
    __table_args__ = (Index(None, "job_name"),)

    plan_id: Mapped[str] = mapped_column(String(KIND_LEN), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_name: Mapped[str] = mapped_column(String(NAME_LEN))
    created_unix_s: Mapped[float]
    document: Mapped[dict[str, Any]] = mapped_column(default=dict)


class TrafficLinkState(Base):
    """A fabric link an operator or a slow-link incident marked down or slow (not healthy)."""

    __tablename__ = "traffic_links"

    link: Mapped[str] = mapped_column(String(KEY_LEN), primary_key=True)
    capacity_factor: Mapped[float]
    reason: Mapped[str] = mapped_column(Text, default="")
    updated_unix_s: Mapped[float]


class AgentCredential(Base):
    """A per-node agent token (issue 14): only its sha256 is kept. Rotation issues a new one
    and gives the old ones an ``expires_unix_s`` (a grace period), so the agent can switch."""

    __tablename__ = "agent_credentials"
    __table_args__ = (Index(None, "node_name"),)

    digest: Mapped[str] = mapped_column(String(TOKEN_LEN), primary_key=True)
    node_name: Mapped[str] = mapped_column(String(NAME_LEN))
    created_unix_s: Mapped[float]
    expires_unix_s: Mapped[float | None]
    created_by: Mapped[str] = mapped_column(String(LABEL_LEN), default="")
