"""The suite's own machinery: the zygote's children and refusals, and the order in which
modules go to the xdist workers (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import host_speed, module_costs
from tests.conftest import _group_of, _races_timers, _schedule_order
from tests.zygote import Zygote


@pytest.fixture
def plain_zygote(tmp_path: Path) -> Zygote:
    """A zygote that preloads nothing heavy (``json``): its children are cheap."""
    zygote = Zygote(tmp_path / "zygote", preload=("json",))
    yield zygote  # type: ignore[misc]
    zygote.close()


def _script(tmp_path: Path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(code)
    return str(path)


def test_run_gives_what_subprocess_run_would(plain_zygote: Zygote, tmp_path: Path) -> None:
    code = "import os, sys\nprint(os.environ['X'], os.getcwd())\nsys.exit('bad ' + sys.argv[1])\n"
    script = _script(tmp_path, "child.py", code)
    done = plain_zygote.run([script, "arg"], env={"X": "y"}, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (1, f"y {tmp_path}\n", "bad arg\n")


def test_run_kills_a_child_past_its_timeout(plain_zygote: Zygote, tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", "import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        plain_zygote.run([script], timeout=0.5)


def test_a_preload_that_starts_a_thread_is_refused(tmp_path: Path) -> None:
    """Forking copies only the calling thread: a zygote whose preload started one would
    hand its children a half-copied process, so it refuses to serve."""
    _script(
        tmp_path,
        "threaded_preload.py",
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    zygote = Zygote(tmp_path / "zygote", env, preload=("threaded_preload",))
    try:
        with pytest.raises(AssertionError, match="preloading started threads"):
            zygote.spawn([_script(tmp_path, "x.py", "")], env=env, stdout=tmp_path / "out")
    finally:
        zygote.close()


@dataclass
class _Item:
    """What the ordering reads of a pytest item: its path and whether it is slow."""

    where: str
    slow: bool = False
    fixturenames: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> object:
        return self.slow if name == "slow" and self.slow else None


def test_slow_tests_and_live_controller_tests_get_a_rerun_and_no_others() -> None:
    live = _Item("tests/x.py", fixturenames=("tmp_path", "controller_factory", "fleet_factory"))
    assert _races_timers(live)  # type: ignore[arg-type]
    assert _races_timers(_Item("tests/x.py", slow=True))  # type: ignore[arg-type]
    assert not _races_timers(_Item("tests/x.py", fixturenames=("tmp_path",)))  # type: ignore[arg-type]


def test_cluster_chains_go_first_then_modules_longest_expected_first() -> None:
    items = [
        _Item("tests/a.py"), _Item("tests/a.py"),  # 2 quick tests
        _Item("tests/b.py", slow=True),  # one slow test outweighs them
        _Item("tests/e2e/test_demo.py", slow=True),
        _Item("tests/c.py"), _Item("tests/c.py", slow=True), _Item("tests/c.py"),
        _Item("tests/e2e/test_recovery_e2e.py", slow=True),
    ]  # fmt: skip
    key = _schedule_order(items, lambda item: item.where)  # type: ignore[arg-type, attr-defined]
    ordered = sorted(items, key=key)  # type: ignore[arg-type]
    assert [i.where for i in ordered] == [
        "tests/e2e/test_demo.py", "tests/e2e/test_recovery_e2e.py",  # collection order
        "tests/c.py", "tests/c.py", "tests/c.py", "tests/b.py", "tests/a.py", "tests/a.py",
    ]  # fmt: skip


def test_measured_module_seconds_outrank_the_marks_estimate() -> None:
    """A module that waits on timers (few tests, none slow) but measured long goes before
    one whose slow marks only look long; a module the table lacks keeps its estimate."""
    items = [
        _Item("tests/waits.py"),  # estimated 0.28 s, measured 20 s
        _Item("tests/marks.py", slow=True), _Item("tests/marks.py", slow=True),  # 7.6 s
        _Item("tests/new.py", slow=True),  # not in the table: 3.8 s
        _Item("tests/quick.py"),  # measured 0.1 s
    ]  # fmt: skip
    measured = {"tests/waits.py": 20.0, "tests/marks.py": 2.0, "tests/quick.py": 0.1,
                "tests/gone.py": 99.0}  # fmt: skip
    key = _schedule_order(items, lambda item: item.where, measured)  # type: ignore[arg-type, attr-defined]
    ordered = [i.where for i in sorted(items, key=key)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/waits.py", "tests/new.py", "tests/marks.py", "tests/marks.py", "tests/quick.py",
    ]  # fmt: skip


def test_the_module_cost_table_is_rebuilt_from_cpu_logs_and_a_damaged_one_is_ignored(
    tmp_path: Path,
) -> None:
    log = tmp_path / "cpu.tsv.gw0"
    log.write_text(
        "tests/a.py::t1\t1.25\t0.1\t0\ntests/a.py::t2[x]\t2.0\t1\t0\ntests/b.py::t\t0.5\t0\t0\n"
    )
    assert module_costs.from_cpu_logs([log]) == {"tests/a.py": 3.2, "tests/b.py": 0.5}
    table = tmp_path / "costs.json"
    for damaged in (
        "{not json",
        "[1, 2]",
        '{"tests/a.py": "x", "tests/b.py": -1, "tests/c.py": true}',
    ):
        table.write_text(damaged)
        assert module_costs.load(table) == {}
    assert module_costs.load(tmp_path / "missing.json") == {}
    # The checked-in table is readable and keyed as the scheduler looks modules up.
    checked_in = module_costs.load()
    assert checked_in and all(k.startswith("tests/") and k.endswith(".py") for k in checked_in)


def test_the_runs_cpu_counts_the_children_it_waited_for() -> None:
    """The summary's CPU is the whole run's: a worker's (a child's) CPU is in it once reaped."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\n"
    before = host_speed.run_cpu_s()
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert host_speed.run_cpu_s() - before >= 0.2
    assert host_speed.reference_s(repeats=1) > 0
    line = host_speed.summary(0.0421, 1234.4)
    assert line.startswith("host speed: reference workload 42 ms of CPU")
    assert "this run used 1234 s of CPU" in line


def test_the_two_heavy_dashboard_modules_share_one_worker_and_others_their_own() -> None:
    """Side by side they starved each other's controllers on a slow host (conftest)."""
    heavy = {
        _group_of("tests/web/test_dashboard.py"),
        _group_of("tests/web/test_dashboard_sweep.py"),
    }
    assert len(heavy) == 1
    assert _group_of("tests/web/test_job_steps_incremental.py") not in heavy
    assert _group_of("tests/a.py") == "tests/a.py"
