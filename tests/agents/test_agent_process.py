"""The agent as a real process: kill -9 mid-run loses no sample; bad settings exit 2."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.agents.agents_testkit import TOKEN, FakeController
from trainguard.wire import Report

ROOT = Path(__file__).resolve().parents[2]


def agent_cmd(url: str, spool: Path, sock: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "agents", "--controller", url, "--token", TOKEN,
        "--node-name", "n1", "--gpus", "sim:2", "--sample-interval", "0.05",
        "--report-interval", "0.4", "--spool-dir", str(spool), "--socket-path", str(sock),
        "--metrics-port", "-1", "--backoff-max", "0.3", "--powercap-dir", str(spool / "none"),
        *extra,
    ]  # fmt: skip


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("TRAINGUARD_AGENT_")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def durable_sample_times(spool: Path) -> set[float]:
    """Sample times on disk right now: in spooled reports and in the journal."""
    times: set[float] = set()
    for path in (spool / "reports").glob("*.json"):
        times |= {s.time_unix_s for s in Report.model_validate_json(path.read_bytes()).samples}
    for path in (spool / "journal").glob("pending-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # the line being written when the process died
            if entry["t"] == "sample":
                times.add(entry["v"]["time_unix_s"])
    return times


@pytest.mark.slow
def test_kill_9_mid_run_and_restart_loses_no_sample(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = tmp_path / "spool"
    log = tmp_path / "agent.log"
    with tempfile.TemporaryDirectory(prefix="tga-") as d:
        sock = Path(d) / "agent.sock"
        cmd = agent_cmd(agents_controller.url, spool, sock)
        proc = start(cmd, log)
        try:
            agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 2, 20)
            agents_controller.stop()  # controller outage: reports pile up in the spool
            time.sleep(1.2)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            on_disk = durable_sample_times(spool)
            assert list((spool / "reports").glob("*.json")), "the outage left nothing spooled"
            killed_at = time.time()
            assert sock.exists()  # a stale socket, as a crashed agent leaves it
            agents_controller.start()
            time.sleep(0.5)  # downtime
            proc = start(cmd, log)
            agents_controller.wait_for(
                lambda: max(all_times(agents_controller), default=0) > killed_at + 1.5, 30
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not sock.exists()  # removed on clean shutdown

    reports = agents_controller.state.ordered()
    assert len({r.agent_instance for r in reports}) == 1  # the restart kept the identity
    assert [r.seq for r in reports] == list(range(len(reports)))  # no seq gap, none twice
    times = [s.time_unix_s for r in reports for s in r.samples]
    assert len(times) == len(set(times)), "a sample was delivered twice"
    assert on_disk <= set(times), f"{len(on_disk - set(times))} durable samples never arrived"
    before = sorted(t for t in times if t <= killed_at)
    after = sorted(t for t in times if t > killed_at)
    assert before and after
    gaps = [b - a for a, b in itertools.pairwise(before)]
    # Sampled every 0.05 s: no hole before the kill (slack for a loaded 2-core machine).
    assert max(gaps) < 0.6, f"hole of {max(gaps):.2f} s before the kill"
    text = log.read_text()
    assert "replacing stale socket" in text and "recovered" in text


def all_times(controller: FakeController) -> list[float]:
    return [s.time_unix_s for r in controller.state.ordered() for s in r.samples]


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_bad_settings_exit_2_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    cases = [
        (["--gpus", "sim:x", "--controller", "http://127.0.0.1:1"], "gpus"),
        (["--gpus", "sim:2", "--controller", "http://127.0.0.1:1", "--sim-fault", "kind=xid,gpu=1"],
         "kind=xid needs code"),
        (["--gpus", "sim:2"], "controller_url is required"),
        (["--gpus", "nvml", "--controller", "http://127.0.0.1:1", "--spool-dir", str(tmp_path)],
         "gpus=nvml: NVML not available"),
    ]  # fmt: skip
    for args, expected in cases:
        result = subprocess.run(
            [sys.executable, "-m", "agents", "--metrics-port", "-1", "--socket-path", "", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if expected.startswith("gpus=nvml") and result.returncode == 0:
            pytest.skip("this machine has NVML")
        assert result.returncode == 2, (args, result.stderr)
        lines = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and expected in lines[0], result.stderr


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_broken_nvml_on_a_gpu_node_exits_3_in_the_foreground(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    (dev / "nvidiactl").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "agents", "--gpus", "auto", "--dev-dir", str(dev), "--foreground",
         "--controller", agents_controller.url, "--token", TOKEN, "--node-name", "broken-gpu",
         "--metrics-port", "-1", "--socket-path", "", "--spool-dir", str(tmp_path / "spool"),
         "--sysfs-root", str(tmp_path / "sys")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if result.returncode == 0 or "NVML failed" not in result.stderr:
        pytest.skip(f"this machine's NVML works (rc={result.returncode})")
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "NVML failed" in lines[0] and "/nvidia0" in lines[0]
    (report,) = agents_controller.state.ordered()
    assert report.node.name == "broken-gpu" and report.node.gpus == []
    assert report.node.gpu_error.startswith("NVML failed (NVML Shared Library Not Found)")


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
def test_bad_token_and_fault_files_exit_2_with_one_line_in_the_foreground(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    (tmp_path / "dir").mkdir()
    (tmp_path / "binary").write_bytes(b"\xff\xfe" * 12 + b"\n")
    (tmp_path / "empty").write_text("\n")
    base = ["--gpus", "sim:1", "--controller", "http://127.0.0.1:1", "--foreground",
            "--spool-dir", str(tmp_path / "spool")]  # fmt: skip
    cases = [
        (["--token-file", str(tmp_path / "missing")],
         f"token_file {tmp_path / 'missing'}: No such file or directory"),
        (["--token-file", str(tmp_path / "dir")], f"token_file {tmp_path / 'dir'}: Is a directory"),
        (["--token-file", str(tmp_path / "binary")],
         f"token_file {tmp_path / 'binary'}: not UTF-8 text"),
        (["--token-file", str(tmp_path / "empty")],
         f"token_file {tmp_path / 'empty'}: empty; it must hold the agent's token"),
        (["--job-listen", "127.0.0.1:0", "--job-token-file", str(tmp_path / "binary")],
         f"job token file {tmp_path / 'binary'}: cannot read it (not UTF-8 text)"),
        (["--sim-fault-file", str(tmp_path / "dir")],
         f"sim_fault_file {tmp_path / 'dir'}: Is a directory"),
    ]  # fmt: skip
    for args, expected in cases:
        result = subprocess.run(
            [sys.executable, "-m", "agents", "--metrics-port", "-1", "--socket-path", "",
             *base, *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if "error" in line]
        assert lines == [f"python -m agents: error: {expected}"], result.stderr
