"""API shapes of the power endpoints (kept here, beside the loop they describe)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class PowerPolicyPublic(BaseModel):
    t1_frac: float
    t2_frac: float
    brake_frac: float
    hysteresis_frac: float
    min_hold_s: float
    knob: str


class PowerDomainPublic(BaseModel):
    name: str
    kind: str
    parent: str | None
    depth: int
    budget_w: float
    power_w: float | None = Field(description="Latest aggregated power; null before any reading")
    utilization_pct: float | None = Field(description="power_w as a percentage of budget_w")
    level: str = Field(description="NONE, T1, T2_LP, T2_HP or BRAKE")
    level_since_unix_s: float | None
    stale: bool = Field(description="A reading under this domain is missing or old")
    capped_gpus: list[str] = Field(description="node:gpuN whose latest sample shows a cap")
    policy: PowerPolicyPublic


class ActuationLatencyPublic(BaseModel):
    samples: int
    p50_s: float | None
    p99_s: float | None


class PowerDomainsPublic(BaseModel):
    enabled: bool
    source: Literal["file", "api", "none"]
    last_tick_unix_s: float | None
    actuation_latency: ActuationLatencyPublic = Field(
        description="Command issue to agent acknowledgement, successful commands"
    )
    tree: dict[str, Any] | None = Field(description="The tree as configured (PUT accepts it)")
    released: dict[str, str] = Field(
        default_factory=dict,
        description="node:gpuN in no domain of the tree whose caps trainguard set under an "
        "earlier tree: 'releasing' (unlock/reset sent) or 'released'",
    )
    data: list[PowerDomainPublic]
    count: int


class PriorityBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority: Literal["high", "low"] | None = Field(
        description="Priority class; null removes the override (the node label applies again)"
    )


class PriorityPublic(BaseModel):
    node: str
    priority: Literal["high", "low"]
    source: Literal["api", "label"]


class JobPriorityBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    priority: Literal["high", "low"] | None = Field(
        description="The job's priority class; null removes it (its GPUs keep their node's)"
    )


class JobPriorityPublic(BaseModel):
    job: str
    priority: Literal["high", "low"] | None = Field(
        description="The job's class; null: none set (its GPUs keep their node's class)"
    )
    applies_to: list[str] = Field(
        description="node:gpuN (or node, for a rank that did not say its GPU) of the job's "
        "running ranks, where this class overrides the node's"
    )


__all__ = [
    "ActuationLatencyPublic",
    "JobPriorityBody",
    "JobPriorityPublic",
    "PowerDomainPublic",
    "PowerDomainsPublic",
    "PowerPolicyPublic",
    "PriorityBody",
    "PriorityPublic",
]
