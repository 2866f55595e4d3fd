"""The controller's exception tree; ``controller.api.handlers`` maps it to HTTP in one place.

::

    ControllerError                       500  (a bug; never raised on purpose for clients)
    ├── ClientError                       4xx  the request is wrong; retrying it won't help
    │   ├── InvalidInput                  422  names the offending field
    │   │   └── MalformedBody             400  not JSON at all
    │   ├── PayloadTooLarge               413
    │   ├── Unauthenticated               401  missing / unknown bearer token
    │   ├── Forbidden                     403  token valid, role not allowed
    │   ├── NotFound                      404
    │   └── Conflict                      409
    ├── TemporaryError                    503  retry later (the agent's spool will)
    │   └── StoreUnavailable                   the database did not commit
    └── StartupError                           refuse to start (not an HTTP error)
        ├── BadConfig                          a setting or file the operator wrote
        └── NotMigrated                        PostgreSQL schema missing or behind

Messages are one line and say what to do next.
"""

from __future__ import annotations

from typing import Any


class ControllerError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(ControllerError):
    status_code = 400


class InvalidInput(ClientError):
    status_code = 422

    def __init__(self, message: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        #: Structured detail (``loc``, ``msg``, ``type`` per error) for clients that want it.
        self.errors = errors or []


class MalformedBody(InvalidInput):
    status_code = 400


class PayloadTooLarge(ClientError):
    status_code = 413


class Unauthenticated(ClientError):
    status_code = 401


class Forbidden(ClientError):
    status_code = 403


class NotFound(ClientError):
    status_code = 404


class Conflict(ClientError):
    status_code = 409


class TemporaryError(ControllerError):
    """Safe to retry after ``retry_after_s``."""

    status_code = 503

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailable(TemporaryError):
    pass


class StartupError(ControllerError):
    pass


class BadConfig(StartupError):
    """A setting or a file it names is wrong (``trainguard controller`` exits 2 for it)."""


class NotMigrated(StartupError):
    pass
