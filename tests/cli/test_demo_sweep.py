"""``trainguard demo`` robustness around its building blocks, with stand-in children.

No full demo runs here: ``Drill`` is replaced by a stand-in whose "controller" is a small
Python process, so interrupting the demo at a chosen moment costs a few seconds.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.cli.cli_testkit import gone
from trainguard.cli.procs import wait_until

#: A stand-in controller: on SIGTERM it takes ~1.5 s to stop (as the real one does while it
#: stops its ranks) and keeps writing into the demo's work directory meanwhile.
SLOW_TO_STOP = """
import signal, sys, time
from pathlib import Path
work = Path(sys.argv[1])
def bye(*_):
    for i in range(15):
        (work / "ckpt").mkdir(parents=True, exist_ok=True)
        (work / "ckpt" / f"step{i}").write_text("x")
        time.sleep(0.1)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("up", flush=True)
while True:
    time.sleep(1)
"""

#: ``trainguard demo`` with ``Drill`` replaced: launch() starts the stand-in, prints its pid
#: and the work directory, and the wait for the job never ends.
FAKE_DEMO = textwrap.dedent(
    """
    import sys, time
    import trainguard.cli.demo as demo_mod
    from trainguard.cli.app import run

    class FakeDrill:
        def __init__(self, config, workdir, procs, say):
            self.workdir, self.procs = workdir, procs
            self.server, self.operator_token = "http://127.0.0.1:9", "t"

        def launch(self):
            child = self.procs.start(
                "controller", [sys.executable, "-c", CHILD, str(self.workdir)]
            )
            while "up" not in child.log_path.read_text():
                time.sleep(0.05)
            print("READY", child.pid, self.workdir, flush=True)

        def wait_for_job(self):
            time.sleep(600)

    demo_mod.Drill = FakeDrill
    sys.exit(run(["demo", *sys.argv[1:]]))
    """
)


def _start_fake_demo() -> tuple[subprocess.Popen[str], int, Path]:
    code = f"CHILD = {SLOW_TO_STOP!r}\n{FAKE_DEMO}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--scenario", "xid"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY"):
            _, pid, workdir = line.split()
            return proc, int(pid), Path(workdir)
    proc.kill()
    pytest.fail(f"the stand-in demo did not start: {proc.communicate()[1]}")


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM, None])
def test_a_second_signal_does_not_cut_the_cleanup_short(second: signal.Signals | None) -> None:
    """Ctrl-C, then (impatient) Ctrl-C again or a supervisor's SIGTERM while the children
    stop: the demo still waits for them and removes its directory, then exits 130. Before,
    the second signal aborted the cleanup: the demo said "stopped, temp files removed" with
    the controller still running and its work directory recreated behind it."""
    proc, child_pid, workdir = _start_fake_demo()
    try:
        proc.send_signal(signal.SIGINT)
        if second is not None:
            time.sleep(0.3)  # the stand-in is now stopping (it takes ~1.5 s)
            proc.send_signal(second)
            time.sleep(0.2)
            proc.send_signal(second)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1].startswith("demo interrupted: controller, agents"), err
        assert gone(child_pid), "a child outlived the demo"
        assert not workdir.exists(), sorted(workdir.rglob("*"))
        if second is not None:
            assert "demo: still stopping" in err
    finally:
        if not gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        wait_until(lambda: gone(child_pid), timeout_s=5)
        shutil.rmtree(workdir, ignore_errors=True)  # what a failed run left behind


def test_a_job_that_never_steps_times_out_with_what_its_ranks_said(tmp_path: Path) -> None:
    """Ranks that exit at start (here: a batch DP cannot split) are the controller's
    children: the demo sees only steps that never come. Its timeout used to say just that,
    and the rank logs went with the work directory; now it quotes their last lines."""
    from trainguard.cli.drill import JOB, Drill, DrillConfig
    from trainguard.cli.errors import DemoFailed
    from trainguard.cli.procs import ProcessSet

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    bad = "demojob: bad environment: TG_GLOBAL_BATCH=7 is not divisible by the data-parallel size 2"
    (ranks / f"{JOB}.g0.rank0.log").write_text("old generation\n")
    for rank in range(4):
        (ranks / f"{JOB}.g1.rank{rank}.log").write_text(f"starting\n{bad}\n\n")
    (ranks / f"{JOB}.g1.rank3.log").write_text("starting\nTraceback ...\nImportError: torch\n")
    drill = Drill(DrillConfig(), tmp_path, ProcessSet(tmp_path / "logs"))
    with pytest.raises(DemoFailed) as failed:
        drill.wait("the job's first steps", lambda: False, 0.05)
    assert str(failed.value) == (
        "timed out after 0 s waiting for the job's first steps\n"
        f"{JOB} generation 1 rank 0, rank 1, rank 2 said last:\nstarting\n{bad}\n"
        f"{JOB} generation 1 rank 3 said last:\nstarting\nTraceback ...\nImportError: torch"
    )


def test_a_deep_tmpdir_still_leaves_room_for_the_agents_sockets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a TMPDIR of 70 characters every agent refused its socket path (over the 107
    bytes of a Unix socket's) and the demo could not start; it now falls back to /tmp."""
    import socket
    import tempfile

    import trainguard.cli.demo as demo_mod
    from trainguard.cli.drill import Drill, DrillConfig
    from trainguard.cli.errors import DemoFailed

    deep = tmp_path / ("d" * max(1, 70 - len(str(tmp_path)) - 1))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    seen: list[Path] = []

    class BindsTheSockets(Drill):
        def launch(self) -> None:
            seen.append(self.workdir)
            for node in ("demo-node-0", "demo-node-2"):
                (self.workdir / node).mkdir()
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.bind(self._socket(node))  # what each agent does first
            raise DemoFailed("stand-in: launched")

    monkeypatch.setattr(demo_mod, "Drill", BindsTheSockets)
    demo = demo_mod.Demo(DrillConfig(), Console(file=io.StringIO()), ("xid",))
    with pytest.raises(DemoFailed, match="stand-in: launched"):
        demo.run()
    assert seen and not seen[0].exists()


def test_an_interrupted_stop_all_still_kills_every_child(tmp_path: Path) -> None:
    """A Ctrl-C while ``ProcessSet.stop_all`` waits out its grace period used to leave the
    children it had not reaped yet: one ignoring SIGTERM never got SIGKILL (nor would the
    SIGTERM of PR_SET_PDEATHSIG end it). Now it gets SIGKILL and the interrupt goes on."""
    from trainguard.cli.procs import ProcessSet

    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('up', flush=True); time.sleep(60)",
    ]

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    procs = ProcessSet(tmp_path)
    children = [procs.start(f"c{i}", stubborn) for i in range(2)]
    try:
        logs = [c.log_path for c in children]
        assert wait_until(lambda: all("up" in log.read_text() for log in logs), timeout_s=10)
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                procs.stop_all(timeout_s=20)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert time.monotonic() - started < 10
        assert [c.popen.returncode for c in children] == [-signal.SIGKILL] * 2
    finally:
        for child in children:
            child.send(signal.SIGKILL)
            child.popen.wait()


def test_ctrl_c_right_after_the_fork_does_not_lose_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing inside ``Popen`` (the fork done, the exec not yet confirmed) raised
    there, before ``ProcessSet.start`` had recorded the child: leaving the block then
    stopped every child but that one. Now the interrupt waits until it is recorded."""
    import trainguard.cli.procs as procs_mod

    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen_then_ctrl_c(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # delivered before Popen returns
        for _ in range(1000):  # bytecode for the handler to run on
            pass
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt), procs_mod.ProcessSet(tmp_path) as procs:
            procs.start("agent", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert [p.returncode for p in started] == [-signal.SIGTERM]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
