"""The trainguard node agent: watches GPUs and job-side clients, reports to the controller.

Public face: :class:`agents.settings.AgentSettings` (+ :func:`~agents.settings.load_settings`)
and :func:`agents.daemon.run`. Errors: :mod:`agents.errors` (every one has a one-line message
and an ``exit_code``). Design and guarantees: ``docs/agent.md``.
"""

from agents.errors import AgentConfigError, AgentError

__all__ = ["AgentConfigError", "AgentError"]
