"""The agent's exception tree.

Every error the agent raises on purpose derives from :class:`AgentError`, and its message is
one line that says what to do next, so the CLI can print ``str(exc)`` and exit with
``exc.exit_code``::

    AgentError                      anything the agent refuses or cannot do
    ├── AgentConfigError            bad settings or fault spec (exit 2): fix the flag/env var
    ├── BackendUnavailableError     gpus=nvml but NVML cannot load (exit 2)
    ├── GpuWatchError               NVML fails on a node with NVIDIA devices, agent started in
    │                               the foreground (exit 3, after reporting the node unhealthy)
    ├── ListenError                 the local socket or metrics port cannot be used (exit 2):
    │                               a live agent owns it, it is not a socket, the port is taken
    └── SpoolError                  the spool directory is unusable (exit 1)

Reporting failures are not exceptions that escape: the reporter classifies each HTTP outcome
(retry later vs. report rejected) itself and keeps going.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every deliberate agent error; ``exit_code`` is what a CLI should exit with."""

    exit_code: int = 1


class AgentConfigError(AgentError):
    """A setting or fault spec is invalid; the message names the offending part."""

    exit_code = 2


class BackendUnavailableError(AgentError):
    """The requested GPU backend cannot be used on this machine."""

    exit_code = 2


class GpuWatchError(AgentError):
    """NVML failed where NVIDIA devices exist; the node was reported unhealthy first."""

    exit_code = 3


class ListenError(AgentError):
    """The agent cannot listen where it was told to (socket path or metrics port)."""

    exit_code = 2


class SpoolError(AgentError):
    """The spool directory cannot be created or written."""

    exit_code = 1


__all__ = [
    "AgentConfigError",
    "AgentError",
    "BackendUnavailableError",
    "GpuWatchError",
    "ListenError",
    "SpoolError",
]
