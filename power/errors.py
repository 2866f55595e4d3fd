"""Errors raised by the ``power`` package.

One tree, so callers can catch the whole package with one clause and still tell a bad
operator input (fix the file and retry) from anything else::

    PowerError
    ├── ConfigError        a domain tree / policy / clock table input is invalid (permanent)
    └── TraceError         a power trace file is missing, malformed or inconsistent (permanent)

Every message is one line and names the offending path (``domains.children[0].budget_w``
or ``trace.csv:17``), because the CLI prints it verbatim and exits with status 2.
"""

from __future__ import annotations


class PowerError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(PowerError, ValueError):
    """A domain tree, policy override or clock table entry is invalid; fix the input."""


class TraceError(PowerError, ValueError):
    """A power trace cannot be read or does not match the trace schema; fix the file."""
