"""Fixtures shared by every test folder.

* ``db_url``: parametrized over an embedded SQLite file and a throwaway PostgreSQL database
  (``trainguard_test_<random>`` on ``TRAINGUARD_TEST_PG``, default 127.0.0.1:5432 as user
  ``postgres``), dropped afterwards. Without a reachable server the PostgreSQL case is
  skipped with the reason, except under ``CI=true`` where it fails.
* ``controller_factory`` / ``live_controller``: a real controller served by uvicorn on an
  ephemeral 127.0.0.1 port in a background thread, with known tokens.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from sqlalchemy.engine import make_url

from tests import host_speed, http_calls, module_costs
from tests.zygote import Zygote

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _pg_admin_url() -> str:
    raw = os.environ.get("TRAINGUARD_TEST_PG", PG_DEFAULT)
    url = make_url(raw).set(drivername="postgresql+psycopg")
    if not url.database:
        url = url.set(database="postgres")
    return url.render_as_string(hide_password=False)


def _psycopg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A database URL on an empty database; SQLite and PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'trainguard.db'}"
        return
    import psycopg

    admin = _pg_admin_url()
    try:
        conn = psycopg.connect(_psycopg_dsn(admin), autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        reason = f"PostgreSQL not reachable at {make_url(admin).host}: {exc}".splitlines()[0]
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    name = f"trainguard_test_{secrets.token_hex(6)}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(_psycopg_dsn(admin), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class SchemaTemplates:
    """One migrated database per kind and pytest process, copied for each test controller.

    Running the migrations takes 0.5-2 s (SQLite, PostgreSQL) and a few hundred tests start
    a controller on an empty database; copying a migrated one takes a few milliseconds
    (SQLite's backup API) or a quarter second (PostgreSQL's ``CREATE DATABASE ... TEMPLATE``).
    The copy is at the head revision exactly as :func:`controller.db.migrate.upgrade` leaves
    it; the tests of migrating itself (tests/controller/test_ctl_db.py, ``trainguard db
    upgrade``) use ``db_url`` directly and still start from nothing.
    """

    def __init__(self, workdir: Any) -> None:
        self._workdir = workdir
        self._sqlite: str | None = None
        self._postgres: str | None = None
        #: The next PostgreSQL copy, made in the background while a test runs: copying
        #: takes ~0.3 s of the server's I/O, most of a controller test's setup otherwise.
        self._spare: Future[str] | None = None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="schema-copy")

    def fill(self, db_url: str) -> bool:
        """Make the empty database at ``db_url`` a copy of the migrated one; False (and
        nothing done) when it is not empty: the caller migrates it the ordinary way."""
        if db_url.startswith("sqlite:///"):
            return self._fill_sqlite(make_url(db_url).database or "")
        if db_url.startswith("postgresql"):
            return self._fill_postgres(db_url)
        return False

    def _fill_sqlite(self, path: str) -> bool:
        import sqlite3

        if not path or os.path.exists(path):
            return False
        if self._sqlite is None:
            from controller.db.migrate import upgrade

            template = os.path.join(str(self._workdir), "template.db")
            upgrade(f"sqlite:///{template}")
            self._sqlite = template
        with sqlite3.connect(self._sqlite) as src, sqlite3.connect(path) as dst:
            src.backup(dst)
        src.close()
        dst.close()
        return True

    def _fill_postgres(self, db_url: str) -> bool:
        import psycopg

        name = make_url(db_url).database
        with psycopg.connect(_psycopg_dsn(db_url), autocommit=True) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN"
                " ('pg_catalog', 'information_schema')"
            ).fetchone()
        if tables is None or tables[0] != 0:
            return False
        admin = _pg_admin_url()
        with psycopg.connect(_psycopg_dsn(admin), autocommit=True) as conn:
            if self._postgres is None:
                from controller.db.migrate import upgrade

                template = f"trainguard_tmpl_{secrets.token_hex(6)}"
                conn.execute(f'CREATE DATABASE "{template}"')
                self._postgres = template
                upgrade(make_url(admin).set(database=template).render_as_string(False))
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            spare = self._take_spare()
            if spare is None:
                conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self._postgres}"')
            else:
                conn.execute(f'ALTER DATABASE "{spare}" RENAME TO "{name}"')
        self._spare = self._copier.submit(self._copy_postgres, admin, self._postgres)
        return True

    def _take_spare(self) -> str | None:
        """The copy made in the background, once it is done; None when none was made."""
        spare, self._spare = self._spare, None
        if spare is None or spare.exception() is not None:
            return None
        return spare.result()

    @staticmethod
    def _copy_postgres(admin: str, template: str) -> str:
        import psycopg

        spare = f"trainguard_spare_{secrets.token_hex(6)}"
        with psycopg.connect(_psycopg_dsn(admin), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{spare}" TEMPLATE "{template}"')
        return spare

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        if self._postgres is None:
            return
        import psycopg

        spare = self._take_spare()
        with psycopg.connect(_psycopg_dsn(_pg_admin_url()), autocommit=True) as conn:
            if spare is not None:
                conn.execute(f'DROP DATABASE IF EXISTS "{spare}" WITH (FORCE)')
            conn.execute(f'DROP DATABASE IF EXISTS "{self._postgres}" WITH (FORCE)')


@pytest.fixture(scope="session")
def schema_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchemaTemplates]:
    templates = SchemaTemplates(tmp_path_factory.mktemp("schema-templates"))
    yield templates
    templates.close()


@pytest.fixture(scope="session")
def torch_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """One torch-preloaded parent per pytest process that forks the multi-process tests'
    ranks (tests/zygote.py: each rank saves the ~3 s of CPU of importing torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TG_"))}
    zygote = Zygote(tmp_path_factory.mktemp("torch-zygote"), env)
    yield zygote
    zygote.close()


#: What the CLI zygote imports: the CLI and the controller (neither reads the environment
#: at import time), and what ``controller``/``db upgrade`` import when they start.
CLI_PRELOAD = (
    "trainguard.cli.app",
    "pydantic_settings",
    "sqlalchemy.engine",
    "controller.server",
    "controller.db.migrate",
)


@pytest.fixture(scope="session")
def cli_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """Forks ``python -m trainguard.cli ...`` runs from one parent per pytest process that
    imported the CLI and the controller once (the same machinery as ``torch_zygote``).

    For the tests of what a command refuses and how (exit status, the one stderr line, files
    left alone): each is a real process with its own argv, environment and output, and
    imports cost it nothing (~1.5 s of CPU each in a fresh interpreter). The tests of the
    entry points themselves (``-m trainguard.cli``, the console script) keep a fresh one,
    and so must a test that sets what these modules read at import (typer's
    ``TYPER_USE_RICH``, ``TERMINAL_WIDTH``, ``_TYPER_FORCE_DISABLE_TERMINAL``): the child
    would see the worker's. ``KUBECONFIG`` is fine: the Kubernetes client is not preloaded.
    """
    zygote = Zygote(tmp_path_factory.mktemp("cli-zygote"), preload=CLI_PRELOAD)
    yield zygote
    zygote.close()


#: ``tg(*args, env=None, timeout=60.0)``: see the ``tg`` fixture.
Tg = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def tg(cli_zygote: Zygote) -> Tg:
    """Runs ``python -m trainguard.cli *args`` as a process of its own, forked from the CLI
    zygote, and returns what ``subprocess.run(..., capture_output=True, text=True)`` would
    (``env``: this process's environment unless given)."""

    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return cli_zygote.run(["-m", "trainguard.cli", *args], env=env, timeout=timeout)

    return run


@dataclass
class LiveController:
    """A controller served by uvicorn in a thread. ``restart`` keeps the URL (same port)."""

    settings: Any
    agent_token: str
    viewer_token: str
    operator_token: str
    port: int = 0
    app: Any = None
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _errors: list[BaseException] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def controller(self) -> Any:
        """The in-process ``controller.runtime.Controller`` (for introspection in tests)."""
        return self.app.state.controller

    def wait_ticks(self, task: str, count: int = 1, timeout_s: float = 30.0) -> None:
        """Wait until the periodic ``task`` (its name in ``Controller.ticks``: a ticker's
        class name such as ``RemediationEngine``) has run ``count`` whole ticks begun after
        this call; fail if one of them raised.

        A test's "nothing more happened" holds only once the code that would have done it
        has run: a fixed sleep is longer than needed on an idle machine and no guarantee on
        a loaded one. Waiting for ticks says the task ran, whatever the load."""
        deadline = time.monotonic() + timeout_s
        while (ticks := self.controller.ticks.get(task)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no periodic task {task!r} was started")
            time.sleep(0.01)
        target, failed = ticks.started + count, ticks.failed
        while ticks.finished + ticks.failed < target:
            if time.monotonic() > deadline:
                raise AssertionError(f"{task} ran {ticks} of {target} ticks in {timeout_s} s")
            time.sleep(0.01)
        assert ticks.failed == failed, f"a tick of {task} raised (see the log): {ticks}"

    def headers(self, role: str = "operator") -> dict[str, str]:
        token = {"agent": self.agent_token, "viewer": self.viewer_token}.get(
            role, self.operator_token
        )
        return {"Authorization": f"Bearer {token}"}

    def read(self, path: str, **params: Any) -> Any:
        """``GET path`` as a viewer: the answer's JSON (a 200 is asserted)."""
        r = http_calls.get(
            f"{self.url}{path}", params=params, headers=self.headers("viewer"), timeout=10
        )
        assert r.status_code == 200, r.text
        return r.json()

    def report(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /api/v1/reports`` as the agent: the answer's JSON (a 200 is asserted)."""
        r = http_calls.post(
            f"{self.url}/api/v1/reports", json=body, headers=self.headers("agent"), timeout=10
        )
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def start(self) -> None:
        from controller.api.app import create_app
        from controller.server import Server, bind_socket, uvicorn_config

        sock = bind_socket("127.0.0.1", self.port)  # the server's own (Nagle off)
        self.port = sock.getsockname()[1]
        self.app = create_app(self.settings)
        server = Server(uvicorn_config(self.app, self.settings))  # the production one
        self._server = server

        def run() -> None:
            async def serve() -> None:
                self._loop = asyncio.get_running_loop()
                await server.serve(sockets=[sock])

            try:
                asyncio.run(serve())
            except BaseException as exc:  # surfaced by start()/stop()
                self._errors.append(exc)
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name="live-controller", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if self._errors or not self._thread.is_alive():
                raise RuntimeError(f"controller failed to start: {self._errors!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("controller did not start within 30 s")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise TimeoutError(f"controller did not stop within 30 s\n{self._stuck()}")
        self._server = None
        self._thread = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _stuck(self) -> str:
        """Where a controller that does not stop is waiting: every thread's stack (the
        server's, the store's writer, ``to_thread`` workers) and every task still pending on
        its event loop, each with the line it waits at."""
        import sys
        import traceback

        lines = []
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():  # every other thread: the writer's, to_thread's
                lines += [f"thread {names.get(ident, ident)}:", *traceback.format_stack(frame)]
        loop = self._loop
        if loop is not None:
            try:
                tasks = list(asyncio.all_tasks(loop))
            except RuntimeError:  # the set changed while we read it: one more try
                tasks = list(asyncio.all_tasks(loop))
            for task in tasks:
                lines.append(f"task {task.get_name()}:\n{_awaiting(task.get_coro())}")
        if self._server is not None:
            state = self._server.server_state
            lines.append(
                f"uvicorn: {len(state.connections)} connection(s), {len(state.tasks)} task(s)"
                f" open, started={self._server.started}"
            )
        return "\n".join(lines)


def _awaiting(coro: Any) -> str:
    """A suspended coroutine's whole await chain, outermost first (``Task.get_stack`` gives
    only the outermost frame): the line each coroutine waits at."""
    lines = []
    while coro is not None:
        frame = next(
            (f for a in ("cr_frame", "gi_frame", "ag_frame") if (f := getattr(coro, a, None))),
            None,
        )
        if frame is None:
            lines.append(f"  awaiting {coro!r}"[:200])
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        awaited = next(
            (x for a in ("cr_await", "gi_yieldfrom", "ag_await") if (x := getattr(coro, a, None))),
            None,
        )
        if awaited is not None and type(awaited).__name__ == "async_generator_asend":
            # An asynccontextmanager's __aexit__ (a lifespan's shutdown): go on in its
            # generator, which the asend wrapper does not expose.
            awaited = getattr(frame.f_locals.get("self"), "gen", awaited)
        coro = awaited
    return "\n".join(lines)


ControllerFactory = Callable[..., LiveController]


@pytest.fixture
def controller_factory(
    db_url: str, schema_templates: SchemaTemplates, controller_defaults: dict[str, Any]
) -> Iterator[ControllerFactory]:
    """Start controllers on ``db_url``; keyword arguments override ``ControllerSettings``
    (and ``controller_defaults``, settings a fixture gives every controller of its test).

    The first controller on a still empty database finds it migrated (a copy of
    ``schema_templates``), as ``trainguard db upgrade`` or its own start would leave it."""
    from controller.settings import ControllerSettings

    started: list[LiveController] = []

    def start(**overrides: Any) -> LiveController:
        tokens = {
            role: f"{role}-{secrets.token_hex(16)}" for role in ("agent", "viewer", "operator")
        }
        values: dict[str, Any] = {
            "database_url": db_url,
            "host": "127.0.0.1",
            "port": 0,
            "tokens": [
                {"name": f"test-{role}", "role": role, "token": token}
                for role, token in tokens.items()
            ],
            "log_level": "warning",
            # Tests post reports for many nodes with one agent token: opted in here; the
            # identity tests turn it off (the controller's default).
            "allow_shared_agent_tokens": True,
        }
        values.update(controller_defaults)
        values.update(overrides)
        if not schema_templates.fill(db_url) and db_url.startswith("postgresql"):
            from controller.db.migrate import upgrade

            upgrade(db_url)
        live = LiveController(
            settings=ControllerSettings(**values),
            agent_token=tokens["agent"],
            viewer_token=tokens["viewer"],
            operator_token=tokens["operator"],
        )
        live.start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def live_controller(controller_factory: ControllerFactory) -> LiveController:
    return controller_factory()


#: The remediation engine's tick in tests that use ``fast_remediation_engine``.
FAST_ENGINE_TICK_S = 0.2


@pytest.fixture
def controller_defaults() -> dict[str, Any]:
    """Settings every controller ``controller_factory`` starts in this test gets, unless the
    test's own keyword arguments say otherwise; fixtures such as ``fast_remediation_engine``
    add to it."""
    return {}


@pytest.fixture
def fast_remediation_engine(controller_defaults: dict[str, Any]) -> float:
    """Controllers this test starts tick their remediation engine every 0.2 s instead of 1 s
    (``remediation_tick_interval_s``). Policy windows are in seconds and hold as they are;
    only the waits for the engine's next look (after an incident opens, or before a
    "nothing more happened") get shorter. Returns the interval."""
    controller_defaults["remediation_tick_interval_s"] = FAST_ENGINE_TICK_S
    return FAST_ENGINE_TICK_S


# Tests that run a whole cluster (controller, agents, a multi-rank training job) and judge
# it by how fast faults are detected and recovered. Under ``pytest -n --dist loadgroup`` (as
# ``make test`` runs) they form chains of about equal length (one per worker: two or
# three, below) and go first: in one chain they would be the critical path (about 8
# minutes here), longer than the whole budget. Their margins are sized for a loaded
# 2-core machine. Every other test module stays whole on one worker so its module-scoped
# fixtures start once.
#
# The grouping is done by the scheduler below, from the node id's path, not by xdist_group
# marks: pytest 9 keeps node ids in ``Item._id``, and xdist 3.8 still appends the group to
# ``Item._nodeid``, so under loadgroup every test became its own unit and went to whichever
# worker was free (cluster tests ran two at a time; module fixtures started on both
# workers). The marks stay for anyone reading ``-m``/``--collect-only``.
_CLUSTER_TESTS = ("tests/e2e/",)
#: Times a failed test that races real timers (marked ``slow``, or a live controller's)
#: runs again (pytest-rerunfailures), see below.
SLOW_TEST_RERUNS = 1


# How the cluster tests chain up: with two workers (``make test`` before), two chains (a:
# the demo, recovery and the Kubernetes JobSet run; b: the detection scenarios, the walking
# skeleton and the PyTorchJob run), measured here at load 3-14 at 400 s and 448 s of wall;
# with three or more workers, three chains of about 300-370 s each (per file, at load ~8:
# demo 172 s, recovery 162, JobSet 140, walking skeleton 214, PyTorchJob 137, detection 159).
_CLUSTER_CHAINS = {
    2: (
        ("tests/e2e/test_demo.py", "tests/e2e/test_recovery_e2e.py", "tests/e2e/test_k8s_jobset"),
        ("tests/e2e/",),
    ),
    3: (
        ("tests/e2e/test_demo.py", "tests/e2e/test_k8s_jobset"),
        ("tests/e2e/test_recovery_e2e.py", "tests/e2e/test_k8s_pytorchjob"),
        ("tests/e2e/",),
    ),
}


def _chains(config: pytest.Config) -> int:
    """Cluster chains for this run: one per worker, two or three."""
    workers = getattr(config.option, "numprocesses", None)
    return 3 if isinstance(workers, int) and workers >= 3 else 2


#: Modules that run one after the other on one worker: the dashboard's two heavy ones (a
#: live cluster of agents, and 2,048 nodes ingested in process, each driving Chromium).
#: Side by side they starved each other's controllers on a slow host (28 Nov, `import
#: torch` 3.2 s of CPU, six workers): agents' reports timed out, pages missed their waits.
_SERIAL_GROUPS = {
    "tests/web/test_dashboard.py": "web-heavy",
    "tests/web/test_dashboard_sweep.py": "web-heavy",
}


def _group_of(path: str, chains: int = 2) -> str:
    if not path.startswith(_CLUSTER_TESTS):
        return _SERIAL_GROUPS.get(path, path)
    for name, prefixes in zip("abc", _CLUSTER_CHAINS[chains], strict=False):
        if path.startswith(prefixes):
            return f"cluster-{name}"
    raise AssertionError(f"no chain for {path}")  # the last chain's prefix is tests/e2e/


#: Estimated wall seconds of one test, by mark, measured here under ``make test`` (mean of
#: 153 slow tests: 3.8 s; of 2,267 others: 0.28 s). Only their ratio matters, below.
_EST_SLOW_S, _EST_OTHER_S = 3.8, 0.28


def _schedule_order(
    items: list[pytest.Item],
    path: Callable[[pytest.Item], str],
    measured: Mapping[str, float] | None = None,
) -> Callable[[pytest.Item], tuple[bool, float]]:
    """Sort key: the cluster chains first, then every other module, longest expected first.

    The scheduler hands out whole modules in this order to whichever worker is free, so the
    longest should go first (longest-processing-time-first): in path order the dashboard's
    46 s module came last and ran alone for ~40 s while the other workers had finished
    (simulated from measured module times: last worker done at 467 s, 436 s at best, 440 s
    with this estimate). A module's expected time is its measured wall (``measured``, from
    tests/module_costs.json) or else its tests counted by the slow mark.
    """
    cost: dict[str, float] = {}
    for item in items:
        where = path(item)
        if not where.startswith(_CLUSTER_TESTS):  # the chains keep their own order
            weight = _EST_SLOW_S if item.get_closest_marker("slow") else _EST_OTHER_S
            cost[where] = cost.get(where, 0.0) + weight
    for where, seconds in (measured or {}).items():
        if where in cost:
            cost[where] = seconds

    def key(item: pytest.Item) -> tuple[bool, float]:
        where = path(item)
        return (where in cost, -cost.get(where, 0.0))

    return key


def _races_timers(item: pytest.Item) -> bool:
    """A test marked ``slow`` (real processes) or one that runs a live controller."""
    fixtures = getattr(item, "fixturenames", ())
    return item.get_closest_marker("slow") is not None or "controller_factory" in fixtures


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath

    def path(item: pytest.Item) -> str:
        return item.path.relative_to(root).as_posix()

    order = _schedule_order(items, path, module_costs.load())
    items.sort(key=order)  # stable: a module's tests stay in order
    rerun = config.pluginmanager.hasplugin("rerunfailures")
    chains = _chains(config)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group_of(path(item), chains)))
        if rerun and _races_timers(item) and not item.get_closest_marker("flaky"):
            # Multi-process tests, and tests against a live controller (its engine ticks,
            # detectors and uvicorn threads on their own clocks), race real processes,
            # sockets and timers on a shared 2-core machine: one that fails runs once more,
            # and the summary lists it as a rerun ("R"). Every rerun seen is a race to
            # chase: most seen so far were real bugs, the rest races in the test itself
            # (README, "Development").
            item.add_marker(pytest.mark.flaky(reruns=SLOW_TEST_RERUNS))


@pytest.hookimpl(optionalhook=True)  # so ``-p no:xdist`` still runs
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadgroup``: one unit of work per group, in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid.split("::", 1)[0], _chains(config))

        def schedule(self) -> None:
            # Keep collection order (cluster first) rather than "most tests first".
            self.config.option.loadscopereorder = False
            super().schedule()

    return ByGroup(config, log)


#: The host's speed, read in the process that runs the session (not in xdist's workers)
#: before any worker starts: see tests/host_speed.py.
_HOST: dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or config.option.collectonly:
        return
    _HOST["reference"] = host_speed.reference_s()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "reference" in _HOST:
        line = host_speed.summary(_HOST["reference"], host_speed.run_cpu_s())
        terminalreporter.write_line(line)


# Opt-in CPU accounting: ``TRAINGUARD_TEST_CPU_LOG=/tmp/cpu.tsv pytest ...`` appends one line
# per test (setup + call + teardown) to ``/tmp/cpu.tsv.<worker>``: node id, wall seconds, CPU
# seconds of this process (all its threads, so an in-thread controller counts) and of its
# reaped children (a subprocess counts only once waited for; one still running at teardown,
# e.g. a module-scoped agent, is charged to the test that reaps it). CPU is what a 2-core
# machine under load cannot hide: the sum over tests / 2 is the floor of ``make test``'s wall.
_CPU_LOG = os.environ.get("TRAINGUARD_TEST_CPU_LOG")

if _CPU_LOG:
    import resource

    def _cpu() -> tuple[float, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        wall0, (self0, kids0) = time.monotonic(), _cpu()
        yield
        wall1, (self1, kids1) = time.monotonic(), _cpu()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_CPU_LOG}.{worker}", "a", encoding="utf-8") as out:
            out.write(
                f"{item.nodeid}\t{wall1 - wall0:.3f}\t{self1 - self0:.3f}\t{kids1 - kids0:.3f}\n"
            )
