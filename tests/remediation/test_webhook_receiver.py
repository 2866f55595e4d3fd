"""The documented example receiver (examples/webhook_receiver.py), run as its own process,
against trainguard's webhook client: a signed delivery opens a ticket, a wrong secret is
refused (and not retried), a bad command line is a one-line exit 2."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.services.webhook import Webhook

ROOT = Path(__file__).resolve().parents[2]
RECEIVER = ROOT / "examples" / "webhook_receiver.py"
SECRET = "example-secret-4f1d9c2e"


@pytest.fixture
def receiver() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = subprocess.Popen(
        [sys.executable, str(RECEIVER), "--port", "0"],
        env={**os.environ, "TRAINGUARD_WEBHOOK_SECRET": SECRET},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("listening on "), line
    try:
        yield line.removeprefix("listening on ") + "/trainguard", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_example_receiver_verifies_and_opens_one_ticket(
    receiver: tuple[str, subprocess.Popen[str]],
) -> None:
    url, proc = receiver
    payload = {
        "incident": {"id": 7, "kind": "gpu_fault", "node": "gpu-3", "summary": "XID 79"},
        "remediation": {"id": "r1", "job": "llm", "steps": ["webhook", "isolate"]},
    }

    async def deliveries() -> tuple[object, object]:
        good = await Webhook(url, SECRET.encode(), retries=0).send("remediation", payload)
        bad = await Webhook(url, b"wrong-secret", retries=2).send("remediation", payload)
        return good, bad

    good, bad = asyncio.run(deliveries())
    assert good.ok and good.status == 200 and good.response == {"ticket": "OPS-1"}  # type: ignore[attr-defined]
    assert not bad.ok and bad.status == 401 and bad.attempts == 1  # type: ignore[attr-defined]
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    assert "OPS-1: gpu_fault on gpu-3 (job llm): XID 79" in out


def test_example_receiver_needs_its_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_WEBHOOK_SECRET"}
    done = subprocess.run(
        [sys.executable, str(RECEIVER)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "set TRAINGUARD_WEBHOOK_SECRET to the controller's webhook secret"
