"""Build the remediation engine from settings: its policy, its actuator, its local jobs.

Called by the composition root (``controller.runtime``) with exactly the collaborators the
engine uses; the choice of actuator (and the Kubernetes client it needs) is made here, in
one place, and the local jobs file is validated at start with an error that names the field.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from controller.actuators.base import Actuator, ActuatorError, Placement
from controller.actuators.local import LocalJobSpec, LocalProcessActuator
from controller.actuators.local_launch import field_problem
from controller.logic.remediation.rules import (
    Policy,
    PolicyError,
    first_error,
    load_policy,
    read_document,
)
from controller.services.actions import ActionService
from controller.services.commands import CommandService
from controller.services.incidents import IncidentService
from controller.services.lease_lock import kube_api_client
from controller.services.nodes import NodeRecords
from controller.services.remediation.engine import RemediationEngine
from controller.services.remediation.partition import partition_settings
from controller.services.webhook import Webhook
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store
from trainguard.wire import NAME_PATTERN

if TYPE_CHECKING:
    from controller.actuators.k8s.lease import LeaseElector

_NAME_RE = re.compile(NAME_PATTERN)


class LocalJob(BaseModel):
    """One entry of ``local_jobs_file``: a job the local actuator runs and restarts."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    #: The rank command; ``python`` as its first word means this controller's interpreter.
    argv: list[str] = Field(min_length=1)
    #: Simulated nodes the job may use, spares last.
    pool: list[str] = Field(min_length=1)
    #: Nodes of the first launch (default: as many of ``pool`` as ``nodes_count`` says).
    nodes: list[str] | None = None
    nodes_count: int | None = Field(default=None, ge=1)
    ranks_per_node: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    env: dict[str, str] = Field(default_factory=dict)
    node_env: dict[str, dict[str, str]] = Field(default_factory=dict)
    log_dir: Path = Path(".")
    cwd: Path | None = None
    min_dp: int = Field(default=1, ge=1)
    #: The global batch: every data-parallel size a restart picks must divide it.
    global_batch: int | None = Field(default=None, ge=1)

    @field_validator("name", "argv", "pool", "nodes", "env", "node_env", "log_dir", "cwd")
    @classmethod
    def _launchable(cls, value: object, info: ValidationInfo) -> object:
        # A rank's command, environment and directories reach execve as C strings: what it
        # cannot take is refused at load, naming the field (local_launch holds the rule).
        problem = field_problem(info.field_name or "", value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("name", "pool", "nodes")
    @classmethod
    def _kubernetes_names(cls, value: object) -> object:
        # The job and its nodes are named on the wire as Kubernetes objects are (RFC 1123,
        # ``trainguard.wire.Name``): ranks report ``TRAINGUARD_JOB`` and ``TRAINGUARD_NODE``,
        # and the rank log is ``<log_dir>/<job>.g<N>.rank<R>.log``. A name such as ``My Job``
        # or ``a/b`` was accepted here, then every report of the job was refused (422) and
        # its launch failed, long after the start.
        if value is None:
            return value
        names = value if isinstance(value, list) else [value]
        bad = [n for n in names if not (isinstance(n, str) and _NAME_RE.fullmatch(n))]
        if bad:
            raise ValueError(
                "not a Kubernetes name (lower-case a-z, 0-9, '-', '.'; at most 253 "
                f"characters): {str(bad[0])[:80]!r}"
            )
        return value

    @model_validator(mode="after")
    def _initial_nodes(self) -> LocalJob:
        nodes = self.first_nodes()
        if not nodes or any(n not in self.pool for n in nodes):
            raise ValueError(f"job {self.name!r}: nodes must be a non-empty subset of pool")
        # The spec's own rules (tp divides ranks_per_node, node_env within the pool) fail
        # here, naming the file, rather than when the actuator is built from it.
        self.spec()
        return self

    def first_nodes(self) -> list[str]:
        if self.nodes is not None:
            return self.nodes
        return self.pool[: self.nodes_count or len(self.pool)]

    def spec(self) -> LocalJobSpec:
        argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(self.argv)]
        return LocalJobSpec(
            name=self.name,
            argv=argv,
            pool=self.pool,
            ranks_per_node=self.ranks_per_node,
            tp=self.tp,
            env=self.env,
            node_env=self.node_env,
            log_dir=self.log_dir,
            min_dp=self.min_dp,
            dp_must_divide=self.global_batch,
            cwd=self.cwd,
        )

    def placement(self) -> Placement:
        return Placement(
            job=self.name,
            nodes=tuple(self.first_nodes()),
            ranks_per_node=self.ranks_per_node,
            tp=self.tp,
        )


def load_local_jobs(path: Path) -> list[LocalJob]:
    document = read_document(path, "local_jobs_file")
    if not isinstance(document, list):
        raise PolicyError(f"local_jobs_file {path}: expected a YAML list of jobs")
    jobs = []
    for i, entry in enumerate(document):
        try:
            jobs.append(LocalJob.model_validate(entry))
        except ValidationError as exc:
            raise PolicyError(f"local_jobs_file {path}: {first_error(exc, f'[{i}].')}") from None
        except ValueError as exc:
            raise PolicyError(f"local_jobs_file {path}: [{i}]: {exc}") from None
    return jobs


def build_actuator(
    settings: ControllerSettings,
    local_jobs: Sequence[LocalJob] = (),
    *,
    lease: LeaseElector | None = None,
) -> Actuator | None:
    """The actuator the settings name; the local one gets the jobs it launches at start.

    ``lease``: the replica's leader Lease (cluster mode, ``lease_lock.build_leader_lock``).
    The Kubernetes actuator fences every write with it, so a deposed leader stops writing
    at its renew deadline, before the Lease can expire for the next one.
    """
    if local_jobs and settings.actuator != "local":
        raise PolicyError("local_jobs_file is set but the actuator is not 'local'")
    if settings.actuator == "local":
        return LocalProcessActuator(jobs=[(job.spec(), job.placement()) for job in local_jobs])
    if settings.actuator == "kubernetes":
        from controller.actuators.kubernetes import KubernetesActuator

        try:
            api = kube_api_client(settings.kube_api_url)
        except ValueError as exc:
            raise ActuatorError(str(exc)) from exc
        actuator = KubernetesActuator(api, settings.kube_namespace)
        if lease is not None:
            actuator.fence_with(lease)
        return actuator
    return None


def load_remediation_policy(settings: ControllerSettings) -> Policy:
    """The policy file, with ``policy_dry_run`` (if set) overriding its ``dry_run``."""
    policy = load_policy(settings.policy_file)
    if settings.policy_dry_run is not None:
        policy = policy.model_copy(update={"dry_run": settings.policy_dry_run})
    return policy


def build_remediation(
    settings: ControllerSettings,
    *,
    state: ClusterState,
    store: Store,
    incidents: IncidentService,
    commands: CommandService,
    actions: ActionService,
    nodes: NodeRecords,
    is_leader: Callable[[], bool],
    lease: LeaseElector | None = None,
) -> RemediationEngine:
    """The engine with its policy and actuator, both chosen by the settings (the actuator
    fenced by ``lease`` in cluster mode)."""
    policy = load_remediation_policy(settings)
    local_jobs = load_local_jobs(settings.local_jobs_file) if settings.local_jobs_file else []
    return RemediationEngine(
        state,
        store,
        incidents,
        commands,
        actions,
        nodes,
        build_actuator(settings, local_jobs, lease=lease),
        policy,
        is_leader=is_leader,
        tick_interval_s=settings.remediation_tick_interval_s,
        grow_check_interval_s=settings.remediation_grow_check_interval_s,
        webhook=build_webhook(settings),
        partition=partition_settings(settings),
        job_retention_s=settings.job_retention_s,
    )


def build_webhook(settings: ControllerSettings) -> Webhook | None:
    """The ``webhook`` step's client, when ``remediation_webhook_url`` is set."""
    if not settings.remediation_webhook_url:
        return None
    return Webhook(
        settings.remediation_webhook_url,
        settings.webhook_secret(),
        timeout_s=settings.remediation_webhook_timeout_s,
        retries=settings.remediation_webhook_retries,
    )
