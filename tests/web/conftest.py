"""Dashboard fixtures: agent reports to feed a live controller, and a headless Chromium.

The browser is the system's ``/usr/bin/chromium`` (``make browser`` installs it; override
with ``TRAINGUARD_TEST_CHROMIUM``), driven by Playwright; ``playwright install`` is never
needed. Without the browser or the Playwright package the browser tests are skipped with
the reason, except under ``CI=true`` where they fail (as ``db_url`` treats PostgreSQL).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

CHROMIUM = Path(os.environ.get("TRAINGUARD_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """SQLite only: the page reads the API, whose database behaviour is tested elsewhere."""
    return f"sqlite:///{tmp_path / 'trainguard.db'}"


def agent_report(
    node: str,
    seq: int,
    *,
    gpus: int = 4,
    samples: int = 3,
    gpu_overrides: dict[int, dict[str, Any]] | None = None,
    steps: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A report as an agent sends it: ``samples`` ticks of ``gpus`` simulated GPUs."""
    t0 = time.time() - samples
    overrides = gpu_overrides or {}

    def sample(index: int) -> dict[str, Any]:
        base: dict[str, Any] = {
            "index": index,
            "uuid": f"GPU-{node}-{index}",
            "power_w": 300.0,
            "energy_j": 1000.0,
            "temperature_c": 60.0,
            "sm_clock_mhz": 1800,
            "utilization_gpu_pct": 90.0,
            "memory_used_bytes": 10 << 30,
            "ecc_corrected_total": 0,
            "ecc_uncorrected_total": 0,
        }
        base.update(overrides.get(index, {}))
        return base

    return {
        "node": {
            "name": node,
            "hostname": f"{node}.example",
            "backend": "sim",
            "agent_version": "0.1.0",
            "gpus": [
                {"index": i, "uuid": f"GPU-{node}-{i}", "name": "NVIDIA H100"} for i in range(gpus)
            ],
        },
        "agent_instance": "inst-1",
        "seq": seq,
        "sent_unix_s": time.time(),
        "samples": [
            {"time_unix_s": t0 + k, "gpus": [sample(i) for i in range(gpus)]}
            for k in range(samples)
        ],
        "job": {"steps": steps or []},
    }


def post_report(live: Any, body: dict[str, Any]) -> None:
    r = httpx.post(
        f"{live.url}/api/v1/reports", json=body, headers=live.headers("agent"), timeout=10
    )
    assert r.status_code == 200, r.text


@pytest.fixture
def web_report() -> Callable[..., dict[str, Any]]:
    return agent_report


@pytest.fixture
def web_post() -> Callable[[Any, dict[str, Any]], None]:
    return post_report


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright ``Browser``), one per test module."""
    if not CHROMIUM.exists():
        _unavailable(f"no Chromium at {CHROMIUM}; run `make browser` (apt-get install chromium)")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed; pip install -e '.[dev]'")
    # The page polls every 2 s; leave room for a loaded two-core machine running the suite.
    expect.set_options(timeout=15_000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def browser_page(chromium: Any) -> Iterator[Any]:
    """A fresh page in its own context (own sessionStorage), 1280 px wide."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    try:
        yield page
    finally:
        context.close()
