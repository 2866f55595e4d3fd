"""Architecture rules that CI enforces: import layers (import-linter) and lint (ruff).

ARCHITECTURE.md keeps torch out of the controller, the agent, power and web, and keeps the
agent and job-side code from importing the controller. A rule nobody checks erodes, so the
suite runs the same checks `make lint` does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; run `make venv`")
    return found


def test_import_contracts_hold() -> None:
    proc = subprocess.run(
        [_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_is_clean() -> None:
    proc = subprocess.run(
        [_tool("ruff"), "check", "--quiet", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
