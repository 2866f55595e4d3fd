"""The environment a test's child process starts with."""

from __future__ import annotations

import os
from collections.abc import Mapping


def clean_env(extra: Mapping[str, str] | None = None, **more: str) -> dict[str, str]:
    """This process's environment without its ``TRAINGUARD_*`` variables, plus ``extra``
    and ``more``: a controller, agent or CLI run started by a test is configured by what
    the test gives it, never by the shell that runs the suite (a developer's
    ``TRAINGUARD_DATABASE_URL`` or token must not reach it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return env | dict(extra or {}) | more
