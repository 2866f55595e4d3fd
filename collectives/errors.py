"""The exception tree of job-side instrumentation.

Instrumentation must never take training down, so very little raises at all: only the
calls a training script makes on purpose (``instrument``, fault specs, probes) do, and
their messages are one line that says what to fix::

    CollectivesError               anything this package refuses
    ├── CollectivesConfigError     bad job name, socket path, knob or env var: fix the setting
    │   └── FaultSpecError         TRAINGUARD_FAULTS (or a runtime fault) is malformed
    └── NotInstrumentedError       a call that needs ``instrument()`` came before it

Transport failures (no agent, agent died, garbage reply) are never raised: the client logs
once and keeps retrying in the background.
"""

from __future__ import annotations


class CollectivesError(Exception):
    """Base of every deliberate error raised by :mod:`collectives`."""


class CollectivesConfigError(CollectivesError, ValueError):
    """A setting is invalid; the message names the setting and the accepted values."""


class FaultSpecError(CollectivesConfigError):
    """A fault specification is invalid; the message names the fault and the field."""


class NotInstrumentedError(CollectivesError, RuntimeError):
    """The call needs an active session: call ``collectives.instrument()`` first."""


__all__ = [
    "CollectivesConfigError",
    "CollectivesError",
    "FaultSpecError",
    "NotInstrumentedError",
]
