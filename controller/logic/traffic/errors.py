"""Errors of the traffic planner, one tree, each message one line that says what to fix::

    TrafficError                     base; never raised itself
    ├── TopologyError (ValueError)   a topology file, label set or builder spec is invalid
    ├── JobSpecError (ValueError)    a job's placement or parallel layout does not fit
    ├── PlanError                    no plan exists: a flow has no live path left
    └── EnforcementError             the modelled hash cannot steer a flow onto its path

None of these is worth retrying with the same input: they describe the input, not a
transient condition. ``PlanError`` after a link failure means the fabric lost the last path
between two NICs; the job must be rescheduled, not re-planned.
"""

from __future__ import annotations


class TrafficError(Exception):
    """Base of every error this package raises on purpose."""


class TopologyError(TrafficError, ValueError):
    """The network model is malformed; the message names the offending field."""


class JobSpecError(TrafficError, ValueError):
    """A job's placement or parallel layout is inconsistent with itself or the topology."""


class PlanError(TrafficError):
    """Planning is impossible, e.g. every candidate path of a flow crosses a down link."""


class EnforcementError(TrafficError):
    """No source port in the allowed range makes the modelled hash pick the planned path."""


__all__ = ["EnforcementError", "JobSpecError", "PlanError", "TopologyError", "TrafficError"]
