"""Child-process handling the demo relies on to never leave processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.cli.cli_testkit import gone
from trainguard.cli.procs import ProcessSet, wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True);"
    " time.sleep(60)",
]


def test_stop_escalates_to_sigkill_and_wakes_stopped_children(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        stubborn = procs.start("stubborn", STUBBORN)
        assert wait_until(lambda: "up" in stubborn.log_path.read_text(), timeout_s=10)
        frozen = procs.start("frozen", SLEEPER)
        procs.kill("frozen", signal.SIGSTOP)
        assert procs.stop("frozen", timeout_s=5) == -signal.SIGTERM
        assert procs.stop("stubborn", timeout_s=0.5) == -signal.SIGKILL
    assert not stubborn.alive() and not frozen.alive()


def test_leaving_the_block_stops_every_child(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        children = [procs.start(f"c{i}", SLEEPER) for i in range(3)]
    assert all(not c.alive() for c in children)


def test_children_die_when_the_orchestrator_is_killed(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: even SIGKILL of the parent leaves no orphan running."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from trainguard.cli.procs import ProcessSet\n"
        f"procs = ProcessSet(Path({str(tmp_path)!r}))\n"
        f"child = procs.start('sleeper', {SLEEPER!r})\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    assert not gone(child_pid)
    parent.kill()
    parent.wait()
    assert wait_until(lambda: gone(child_pid), timeout_s=10)
    if not gone(child_pid):  # pragma: no cover - leave nothing behind on failure
        os.kill(child_pid, signal.SIGKILL)


def test_a_dead_child_name_can_be_restarted(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        first = procs.start("agent", SLEEPER)
        procs.kill("agent")
        assert procs.dead() == [first]
        second = procs.start("agent", SLEEPER)
        assert second.pid != first.pid and second.alive()
        assert procs.dead() == []
