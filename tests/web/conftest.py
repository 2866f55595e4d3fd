"""Dashboard fixtures: agent reports to feed a live controller, and a headless Chromium.

The browser is the system's ``/usr/bin/chromium`` (``make browser`` installs it; override
with ``TRAINGUARD_TEST_CHROMIUM``), driven by Playwright; ``playwright install`` is never
needed. Without the browser or the Playwright package the browser tests are skipped with
the reason, except under ``CI=true`` where they fail (as ``db_url`` treats PostgreSQL).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls

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
    r = http_calls.post(
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


#: How long a page or an ``expect`` waits for what it looks for: the pages poll every 2 s,
#: and a loaded two-core machine running the whole suite answers in a few seconds on a fast
#: host; on a slow one (28 Nov: `import torch` 3.2 s of CPU) a fault took over 15 s to reach
#: the fleet page. Only a failing wait lasts this long.
BROWSER_TIMEOUT_MS = 45_000


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
    expect.set_options(timeout=BROWSER_TIMEOUT_MS)
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
    page.set_default_timeout(BROWSER_TIMEOUT_MS)
    try:
        yield page
    finally:
        context.close()


# ----------------------------------------------------------------------------- live cluster

#: Text a hostile client could put in a free-text field; it must show up verbatim.
HOSTILE = '<img src=x onerror="window.__pwned=1"><b>bold</b>'


class Cluster:
    """One controller, three in-process node agents on the simulated GPU backend, and a
    4-rank job whose ranks (threads here) hand step summaries to those agents' sockets as
    the collectives wrapper would. Shared by every browser test of a module (time budget)."""

    def __init__(self, live: Any, root: Path) -> None:
        self.live = live
        self.root = root
        self.agents: list[Any] = []
        self.fault_files: dict[str, Path] = {}
        self.sockets: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: rank -> extra seconds added to its step (a straggler the test turns on).
        self.slow: dict[int, float] = {}
        self.step = 0

    def start_agent(self, name: str, labels: dict[str, str] | None = None) -> None:
        from agents.daemon import Agent
        from agents.settings import load_settings

        spool = self.root / name
        sock = tempfile.mkdtemp(prefix="tgw-") + "/agent.sock"
        faults = spool / "faults.txt"
        spool.mkdir(parents=True)
        faults.touch()
        agent = Agent(
            load_settings(
                controller_url=self.live.url,
                token=self.live.agent_token,
                node_name=name,
                gpus="sim:4",
                sample_interval_s=0.25,
                report_interval_s=0.5,
                spool_dir=spool / "spool",
                socket_path=sock,
                metrics_port=0,
                backoff_max_s=0.5,
                powercap_dir=spool / "no-powercap",
                sysfs_root=spool / "no-sys",
                dev_dir=spool / "no-dev",
                sim_fault_file=faults,
                labels=labels or {},
            )
        )
        stop = threading.Event()
        agent.start()
        thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
        thread.start()
        self.agents.append((agent, stop, thread))
        self.fault_files[name] = faults
        self.sockets[name] = sock

    def inject(self, node: str, spec: str) -> None:
        with self.fault_files[node].open("a") as f:
            f.write(spec + "\n")

    def start_job(self, job: str, placement: dict[int, str], step_s: float = 0.2) -> None:
        from tests.agents.agents_testkit import LocalClient
        from trainguard.wire import CheckpointEvent, JobRecords, StepSummary

        world = len(placement)
        clients = {}
        for rank, node in placement.items():
            client = LocalClient(self.sockets[node])
            client.hello(job, rank, world_size=world, pid=1000 + rank)
            clients[rank] = client

        def run() -> None:
            while not self._stop.is_set():
                self.step += 1
                now = time.time()
                for rank, client in clients.items():
                    t = step_s + self.slow.get(rank, 0.0)
                    steps = [
                        StepSummary(
                            job=job,
                            rank=rank,
                            world_size=world,
                            step=self.step,
                            step_time_s=t,
                            compute_time_s=t * 0.7,
                            collective_wait_s=max(0.0, step_s - t * 0.7),
                            gpu_index=rank % 4,
                            end_unix_s=now,
                            role="dp",
                            dp_rank=rank,
                            group_ranks=list(range(world)),
                        )
                    ]
                    checkpoints = []
                    if self.step % 25 == 0:
                        checkpoints = [
                            CheckpointEvent(
                                job=job,
                                rank=rank,
                                step=self.step,
                                kind="committed",
                                blocking_s=0.05,
                                duration_s=0.4,
                                size_bytes=64 << 20,
                                path=f"/ckpt/{job}/step-{self.step}",
                                time_unix_s=now,
                            )
                        ]
                    try:
                        client.records(JobRecords(steps=steps, checkpoints=checkpoints))
                    except OSError:
                        return
                self._stop.wait(step_s)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for agent, stop, thread in self.agents:
            stop.set()
            thread.join(timeout=10)
            agent.stop()


def sqlite_controller(root: Path, **settings: Any) -> Any:
    """A ``LiveController`` (not started) on a SQLite file under ``root``, with a fresh
    token per role and one agent token for every simulated node; ``settings`` add to or
    override those ``ControllerSettings``."""
    import secrets

    from controller.settings import ControllerSettings
    from tests.conftest import LiveController

    tokens = {role: f"{role}-{secrets.token_hex(16)}" for role in ("agent", "viewer", "operator")}
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{root / 'trainguard.db'}",
        "host": "127.0.0.1",
        "port": 0,
        "tokens": [
            {"name": f"test-{role}", "role": role, "token": token} for role, token in tokens.items()
        ],
        "log_level": "warning",
        "allow_shared_agent_tokens": True,
        **settings,
    }
    return LiveController(
        settings=ControllerSettings(**values),
        agent_token=tokens["agent"],
        viewer_token=tokens["viewer"],
        operator_token=tokens["operator"],
    )


def open_page(
    context: Any,
    live: Any,
    token: str,
    route: str = "#/fleet",
    *,
    timeout_ms: int = BROWSER_TIMEOUT_MS,
) -> Any:
    """A page signed in with ``token`` at ``route``; ``page.errors`` collects uncaught
    exceptions and console errors. The browser logs every non-2xx answer ("Failed to load
    resource"); the pages expect some (401 before sign-in, 404 goodput of a new job or a
    dead link, 409 no topology), so those are left out."""
    page = context.new_page()
    page.set_default_timeout(timeout_ms)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.errors = errors  # type: ignore[attr-defined]
    page.goto(f"{live.url}/ui/{route}")
    page.fill("#token", token)
    page.click("#login button[type=submit]")
    return page


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A live controller (SQLite) with three simulated agents and a running 4-rank job."""
    root = tmp_path_factory.mktemp("dash")
    # The fabric from the agents' labels (two NICs each), for the network page.
    live = sqlite_controller(root, topology_labels={"spines": 2, "port_speed_gbps": 200.0})
    live.start()
    cluster = Cluster(live, root)
    try:

        def nics(leaf: str) -> dict[str, str]:
            return {f"topology.trainguard.io/nic{k}": f"{leaf}-{k}" for k in range(2)}

        cluster.start_agent("sim-a", {"rack": "r1", **nics("leaf-a")})
        cluster.start_agent("sim-b", {"rack": "r1", **nics("leaf-b")})
        cluster.start_agent("sim-c", {"rack": "r2", "team": HOSTILE, **nics("leaf-a")})
        # Power domains for the power page, with room to spare (no capping in these tests).
        servers = [
            {"name": n, "kind": "server", "budget_w": 4000} for n in ("sim-a", "sim-b", "sim-c")
        ]
        tree = {
            "name": "dc",
            "kind": "datacenter",
            "budget_w": 20000,
            # row-1 is oversubscribed: three 4 kW servers on 11 kW (one beyond their peak),
            # drawing ~70% of it (under T1: no capping in these tests).
            "children": [{"name": "row-1", "kind": "row", "budget_w": 11000, "children": servers}],
        }
        r = http_calls.put(
            f"{live.url}/api/v1/power/domains", json=tree, headers=live.headers(), timeout=10
        )
        assert r.status_code == 200, r.text
        cluster.start_job("llm-pretrain", {0: "sim-a", 1: "sim-a", 2: "sim-b", 3: "sim-b"})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            nodes = http_calls.get(
                f"{live.url}/api/v1/nodes", headers=live.headers("viewer"), timeout=5
            ).json()
            jobs = http_calls.get(
                f"{live.url}/api/v1/jobs", headers=live.headers("viewer"), timeout=5
            ).json()
            job = jobs["data"][0] if jobs["count"] == 1 else {}
            # Every rank, not only the first: the plan below needs the whole placement.
            if nodes["count"] == 3 and job.get("last_step") and job["ranks_reporting"] == 4:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"cluster did not come up: {nodes} {jobs}")
        r = http_calls.post(
            f"{live.url}/api/v1/plans",
            json={"job": "llm-pretrain", "layout": {"tp": 1, "grad_bytes": 1 << 28}},
            headers=live.headers(),
            timeout=30,
        )
        assert r.status_code == 201, r.text
        yield cluster
    finally:
        cluster.close()
        live.stop()


@pytest.fixture(scope="module")
def dash_browser(chromium: Any) -> Iterator[Any]:
    """One browser context for the module's page tests (1280 x 900)."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    try:
        yield context
    finally:
        context.close()
