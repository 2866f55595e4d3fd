"""Errors the CLI turns into one line on stderr and an exit status.

Exit status says whose fault it was, so scripts can tell a typo from an outage::

    CliError (exit 1)                 something outside the user's input went wrong
    ├── Unreachable (exit 1)          no TCP connection / timeout to the controller
    ├── ServerError (exit 1)          the controller answered 5xx or an unexpected 4xx
    ├── Unauthorized (exit 1)         401/403: the token is missing, wrong or too weak
    ├── DemoFailed (exit 1)           the demo ran but the loop did not close
    └── BadInput (exit 2)             the user asked for something invalid
        └── NotFound (exit 2)         a named object (node, job, incident) does not exist

Click's own usage errors (unknown flag, bad choice) are also mapped to exit 2 by
:func:`trainguard.cli.app.run`.
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CliError(Exception):
    """Base of every error the CLI reports without a traceback."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unreachable(CliError):
    pass


class ServerError(CliError):
    pass


class Unauthorized(CliError):
    pass


class DemoFailed(CliError):
    pass


class BadInput(CliError):
    exit_code = EXIT_USAGE


class NotFound(BadInput):
    pass


__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "BadInput",
    "CliError",
    "DemoFailed",
    "NotFound",
    "ServerError",
    "Unauthorized",
    "Unreachable",
]
