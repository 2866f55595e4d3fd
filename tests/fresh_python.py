"""Run a snippet in a fresh interpreter.

For the tests of what importing or calling something leaves loaded (or costs): the pytest
process imported everything long ago, so only a new interpreter can tell. The snippet gets
this process's environment without trainguard's settings, and one OpenMP thread, as every
rank launcher here gives.
"""

from __future__ import annotations

import subprocess
import sys

from tests.environ import clean_env


def run(code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``python -c code``; its output comes back as text."""
    env = clean_env()
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env | {"OMP_NUM_THREADS": "1"},
    )
