"""Power oversubscription, POLCA-style: domains, policy, models, trace simulator.

The face of the package is small; the controller needs :class:`PowerPolicy` and its
inputs, operators the CLI (:mod:`power.cli`), and the benchmark the simulator. Nothing
here imports torch or the controller. Errors: see :mod:`power.errors`.
"""

from power.config import Knob, Level, PolicyConfig, Priority, WorkloadKind
from power.domains import Domain, DomainKind, DomainTree, Reading, load_domains, parse_domains
from power.errors import ConfigError, PowerError, TraceError
from power.policy import (
    ActuationEffect,
    Decision,
    DomainStatus,
    GpuStatus,
    PolicyIncident,
    PowerPolicy,
    TickResult,
)
from power.reports import (
    apply_job_priorities,
    gpu_statuses,
    priority_from_labels,
    readings_from_sample,
)

__all__ = [
    "ActuationEffect",
    "ConfigError",
    "Decision",
    "Domain",
    "DomainKind",
    "DomainStatus",
    "DomainTree",
    "GpuStatus",
    "Knob",
    "Level",
    "PolicyConfig",
    "PolicyIncident",
    "PowerError",
    "PowerPolicy",
    "Priority",
    "Reading",
    "TickResult",
    "TraceError",
    "WorkloadKind",
    "apply_job_priorities",
    "gpu_statuses",
    "load_domains",
    "parse_domains",
    "priority_from_labels",
    "readings_from_sample",
]
