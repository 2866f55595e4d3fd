"""Every incident kind the controller opens, in one place.

Why one registry: a remediation rule matches incidents by kind, and a rule whose kind no
detector ever opens (``gpu_fualt``) would simply never match: the operator believes a
fault is handled while it only ever gets the catch-all rule. Policies are checked against
this list (:func:`unknown_kind_error`), and every producer builds its incident with an
:class:`IncidentKind`, so a new kind is added here or mypy and the tests refuse it.

The values are stable: they are stored in incident rows, shown in the API, the CLI and
the dashboard, and written in operators' policy files.
"""

from __future__ import annotations

import difflib
from enum import StrEnum


class IncidentKind(StrEnum):
    # Node and GPU health (controller.services.detection.health, degraded).
    #: A fatal XID, a lost or fallen-off GPU: the GPU cannot be trusted with work.
    GPU_FAULT = "gpu_fault"
    #: The agent could not watch a GPU's events (the XID stream failed).
    GPU_WATCH_FAILED = "gpu_watch_failed"
    #: No NVML read of a GPU answers, sample after sample (NVML_ERROR_UNKNOWN on every
    #: call: fallen off the bus or a wedged driver); resolves when it reads again.
    GPU_UNREACHABLE = "gpu_unreachable"
    #: The node's agent stopped reporting.
    NODE_LOST = "node_lost"
    #: An XID the application causes (e.g. 13, 31, 43): recorded, never acted on by default.
    APPLICATION_XID = "application_xid"
    #: An XID in neither the fatal nor the application table.
    GPU_XID = "gpu_xid"
    #: A hardware health rule's "degrade" level on a GPU or a NIC.
    HW_DEGRADED = "hw_degraded"
    #: NIC error counters rising.
    NIC_ERRORS = "nic_errors"
    #: Correctable ECC errors rising or hardware throttling: the GPU may fail soon.
    GPU_DEGRADED = "gpu_degraded"
    # Jobs, C4D-style: what each means is with the detectors' own list,
    # controller.logic.detection.c4d.findings.FindingKind.
    HANG = "hang"
    COMM_HANG = "comm_hang"
    STRAGGLER = "straggler"
    COMM_SLOW = "comm_slow"
    SLOW_LINK = "slow_link"
    RANK_CRASH = "rank_crash"
    COMM_FAILURE = "comm_failure"
    NONFINITE = "nonfinite"
    # Power (controller.services.power.loop, from the POLCA policy's own incidents).
    POWER_BRAKE = "power_brake"
    POWER_TELEMETRY_STALE = "power_telemetry_stale"
    POWER_CLOCK_COMMAND_FAILED = "power_clock_command_failed"
    POWER_LIMIT_COMMAND_FAILED = "power_limit_command_failed"
    POWER_GPU_UNCAPPABLE = "power_gpu_uncappable"
    # Remediation's own guard rails.
    #: An isolation budget held an isolation back (the quarantine budget,
    #: ``quarantine_budget_share``, or the policy's circuit breaker,
    #: ``guards.max_isolated_fraction``; ``evidence.budget`` says which): a faulty node
    #: stays in service until a human decides.
    QUARANTINE_BUDGET = "quarantine_budget"
    #: A restart the policy asked for was refused (the restart rate limit, the actuator,
    #: no placement): the job is left as the fault left it until a human acts.
    RESTART_REFUSED = "restart_refused"


#: What a rule's ``kind`` may say besides a kind: every incident.
ANY_KIND = "*"

KNOWN_KINDS: frozenset[str] = frozenset(k.value for k in IncidentKind)


def unknown_kind_error(kind: str) -> str | None:
    """Why ``kind`` cannot be a rule's kind, in one line (``None``: it can). Names the
    closest kinds, since the usual cause is a typo."""
    if kind == ANY_KIND or kind in KNOWN_KINDS:
        return None
    known = [k.value for k in IncidentKind]
    close = difflib.get_close_matches(kind, known, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"unknown incident kind {kind!r}: a rule for it would never match; {hint}"
        f"known kinds: {', '.join(known)} (or '*' for any)"
    )
