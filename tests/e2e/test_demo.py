"""``trainguard demo`` end to end: a real job survives a straggler, a hang and a fatal XID.

The full story runs once (about a minute and a half on two cores): each fault detected and
localized, the job resumed from a checkpoint with at most one checkpoint interval of steps
run again and its loss curve going on, the last restart on fewer ranks. The other tests
cover what an operator relies on around it: Ctrl-C and a dying child clean everything up,
and the checks can fail.
"""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import http_calls
from trainguard.cli.drill import FaultOutcome

pytestmark = pytest.mark.slow


def _demo_workdir(stdout: str) -> Path:
    match = re.search(r"^  logs\s+(\S+)/logs$", stdout, re.MULTILINE)
    assert match, stdout[:2000]
    return Path(match.group(1))


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text`` (the demo's temp dir): leftover children."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found


def _log_tails(printed: str, lines: int = 15) -> str:
    """The last lines of every log of a demo that is still running (its work directory is
    removed when it stops): what a stalled demo's controller, agents and ranks last said."""
    match = re.search(r"^  logs\s+(\S+)$", printed, re.MULTILINE)
    if match is None:
        return ""
    out = []
    logs = Path(match.group(1))  # the controller's and agents'; the ranks' are in ../ranks
    for log in [*sorted(logs.glob("*.log")), *sorted((logs.parent / "ranks").glob("*.log"))]:
        said = log.read_text(errors="replace").splitlines()
        tail = [line for line in said if "httpx: HTTP Request" not in line][-lines:]
        out.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n" + "\n".join(out)


def _demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard.cli", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


def test_demo_recovers_from_three_faults_then_keeps_running_until_ctrl_c(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--keep-running")
    try:
        _check_demo_keeps_running(proc)
    finally:
        if proc.poll() is None:  # a failed check must not leave the cluster running
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


#: Seconds the demo may take to reach its keep-running prompt (it takes ~130 s here).
DEMO_READY_S = 240


def _check_demo_keeps_running(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    stdout = proc.stdout
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in stdout:
            lines.append(line)
            if line.startswith("running until Ctrl-C"):
                break  # a failed demo ends stdout instead, and the next assertion shows why
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    # A deadline of its own, under pytest's 300 s: a slow or stuck demo fails with what it
    # printed so far, not with a bare timeout inside the read.
    if not ready.wait(DEMO_READY_S):
        printed = "".join(lines)
        pytest.fail(
            f"no 'running until Ctrl-C' after {DEMO_READY_S} s:\n{printed}{_log_tails(printed)}"
        )
    out = "".join(lines)
    assert proc.poll() is None, out + proc.stderr.read()  # type: ignore[union-attr]
    workdir = _demo_workdir(out)
    assert _processes_mentioning(str(workdir)), "the cluster stays up with --keep-running"
    rows = {m.group(1): m for m in re.finditer(
        r"^(straggler|hang|xid)\s+(demo-node-\d)(?: rank (\d))?\s+(\w+)\s+([\d.]+)\s+([\d.]+)"
        r"(?: \(> target\))?\s+(\d+)\s+(\d) -> (\d)\s+(\d+)$",
        out, re.MULTILINE,
    )}  # fmt: skip
    assert set(rows) == {"straggler", "hang", "xid"}, out
    assert rows["straggler"].group(4) == "straggler" and rows["hang"].group(4) == "hang"
    assert rows["xid"].group(4) == "gpu_fault"
    assert all(int(m.group(7)) <= 5 for m in rows.values())  # steps run again
    assert [m.group(8, 9) for m in rows.values()] == [("4", "4"), ("4", "4"), ("4", "2")]
    assert re.search(r"^GOODPUT\s+\d+\.\d%$", out, re.MULTILINE)
    assert "FAIL" not in out and out.count("  ok  ") == 10
    # The dashboard URL the demo printed serves the page while the cluster keeps running.
    dashboard = re.search(r"^  dashboard  (http://\S+/ui/) ", out, re.MULTILINE)
    assert dashboard, out
    assert re.search(r"^    the job    http://\S+/ui/#/job/gpt-demo$", out, re.MULTILINE), out
    page = http_calls.get(dashboard.group(1), follow_redirects=True, timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower(), page.text[:200]
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "demo passed" in rest
    assert not workdir.exists() and _processes_mentioning(str(workdir)) == []


def test_demo_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--scenario", "xid")
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "job gpt-demo: TP=2 x DP=2" in line:
            break  # controller and agents up; the controller is launching the job
    workdir = _demo_workdir("".join(lines))
    assert _processes_mentioning(str(workdir)), "expected running agents"
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("demo interrupted: controller, agents and job stopped"), err
    assert not workdir.exists()
    assert _processes_mentioning(str(workdir)) == []


def test_demo_reports_a_dying_agent_and_cleans_up() -> None:
    """An agent that exits (here: refused settings, sim:0) fails the demo with its log."""
    from rich.console import Console

    from trainguard.cli.demo import Demo
    from trainguard.cli.drill import DrillConfig
    from trainguard.cli.errors import DemoFailed

    console = Console(file=io.StringIO(), width=200)
    with pytest.raises(DemoFailed, match=r"demo-node-\d exited with status 2 while waiting") as e:
        Demo(DrillConfig(ranks_per_node=0, tp=1), console, ("xid",)).run()
    assert "gpus" in str(e.value)  # the agent's own one-line reason, from its log
    workdir = _demo_workdir(console.file.getvalue())  # type: ignore[attr-defined]
    assert not workdir.exists() and _processes_mentioning(str(workdir)) == []


def test_demo_checks_fail_on_a_wrong_culprit_lost_work_or_a_restart_from_scratch() -> None:
    from rich.console import Console

    from trainguard.cli.demo import Demo
    from trainguard.cli.drill import DrillConfig

    def outcome(
        kind: str, node: str, *, gen: int, lost: int, loss: float, world: int
    ) -> FaultOutcome:
        o = FaultOutcome(
            kind=kind, node="demo-node-1", rank=3 if kind != "xid" else None,
            injected_unix_s=0.0, generation_before=gen, world_before=4,
        )  # fmt: skip
        o.incident = {"node": node, "ranks": [3], "opened_unix_s": 1.0}
        o.resumed = {
            "loss": loss, "world_size": world, "time_unix_s": 9.0, "resumed_from": 10,
            "generation": gen + 1,
        }  # fmt: skip
        o.steps_lost = lost
        return o

    def log(*gens: list[float]) -> list[dict[str, object]]:
        """Generation g's losses from step 8 + g on; the job's very first loss is 4.0."""
        first = [{"generation": 0, "step": 0, "loss": 4.0}]
        return first + [
            {"generation": g, "step": 8 + g + i, "loss": loss}
            for g, losses in enumerate(gens)
            for i, loss in enumerate(losses)
        ]

    demo = Demo(DrillConfig(), Console(file=io.StringIO()), ("straggler", "hang", "xid"))
    good = [
        outcome("straggler", "demo-node-1", gen=0, lost=0, loss=1.0, world=4),
        outcome("hang", "demo-node-1", gen=1, lost=1, loss=1.0, world=4),
        outcome("xid", "demo-node-1", gen=2, lost=2, loss=1.0, world=2),
    ]
    # Each generation re-runs the last steps of the one before with the same losses.
    rows = log([1.2, 1.1], [1.1, 1.0], [1.0, 0.9], [0.9 + 5e-8, 0.8])
    assert all(c.ok for c in demo.verify(good, rows))
    bad = [
        outcome("straggler", "demo-node-0", gen=0, lost=0, loss=1.0, world=4),  # wrong node
        outcome("hang", "demo-node-1", gen=1, lost=9, loss=1.0, world=4),  # lost > interval
        outcome("xid", "demo-node-1", gen=2, lost=0, loss=4.5, world=4),  # started over, no shrink
    ]
    failed = [c.text for c in demo.verify(bad, rows) if not c.ok]
    assert failed == [
        "straggler: the incident names demo-node-1 rank 3",
        "hang: resumed with at most 5 steps run again (ran 9 again)",
        "xid: the loss went on from where it was (4.500 < first 4.000; re-run steps so far "
        "match within 5.0e-08)",
        "the last restart ran on fewer ranks (4 -> 4), resharding the checkpoint",
    ]
    # A step run again whose loss differs: resumed from the wrong state.
    drifted = log([1.2, 1.1], [1.1 + 0.01, 1.0], [1.0, 0.9], [0.9, 0.8])
    failed = [c.text for c in demo.verify(good, drifted) if not c.ok]
    assert failed == [
        "straggler: the loss went on from where it was (1.000 < first 4.000; re-run steps so "
        "far match within 1.0e-02)"
    ]
