"""Starting a generation with the local actuator: all ranks or none, nothing left behind.

Found by the local-actuator acceptance probe: an error other than OSError while starting
ranks leaked the ranks already started; a failed launch was recorded as the current
generation (and its retry refused); ``launch`` over a generation that exited on its own
left that generation's children running; one bad configured job kept the others from
starting; a log directory that is a file raised a raw OSError. Real processes (a tiny
Python rank, no torch).
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.actuators import local_launch
from controller.actuators.base import ActuatorError, Placement
from controller.actuators.local import JobStatus, LocalJobSpec, LocalProcessActuator
from controller.logic.remediation.rules import PolicyError
from controller.services.remediation.wiring import load_local_jobs

pytestmark = pytest.mark.slow

RANK = r"""
import os, subprocess, sys, time
if os.environ.get("CHILD_PID_FILE"):
    # A child in the rank's process group that ignores SIGTERM, left behind when the rank exits.
    child = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 60"])
    path = os.environ["CHILD_PID_FILE"]
    with open(path + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(path + ".tmp", path)
if os.environ.get("EXIT_NOW"):
    sys.exit(0)
time.sleep(60)
"""


def spec(tmp_path: Path, **overrides: Any) -> LocalJobSpec:
    fields: dict[str, Any] = {
        "name": "j",
        "argv": [sys.executable, "-c", RANK],
        "pool": ["a", "b", "c"],
        "ranks_per_node": 1,
        "log_dir": tmp_path / "logs",
    }
    fields.update(overrides)
    return LocalJobSpec(**fields)


def placement(nodes: tuple[str, ...], generation: int = 0, job: str = "j") -> Placement:
    return Placement(job=job, nodes=nodes, ranks_per_node=1, generation=generation)


@pytest.fixture
def popen_fails_on_second_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Popen raises an error that is no OSError for the second rank; yields the ranks started."""
    real = subprocess.Popen
    started: list[Any] = []

    def popen(*args: Any, **kwargs: Any) -> Any:
        if len(started) == 1:
            raise RuntimeError("boom\nsecond line")
        proc = real(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(local_launch.subprocess, "Popen", popen)
    yield started
    _kill_leftovers(started)


def _kill_leftovers(procs: list[Any]) -> None:
    """Only where the actuator failed to (a regression): the test leaves nothing running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_error_while_starting_ranks_kills_and_reaps_those_started(
    tmp_path: Path, popen_fails_on_second_call: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        act = LocalProcessActuator(grace_s=0.5)
        act.register(spec(tmp_path))
        try:
            with pytest.raises(ActuatorError) as err:
                await act.launch(placement(("a", "b")))
            assert "\n" not in str(err.value) and "RuntimeError: boom second line" in str(err.value)
            [first] = popen_fails_on_second_call
            assert first.returncode == -signal.SIGKILL  # killed and reaped, not left running
            assert act.status("j") is None and await act.current_placement("j") is None
            monkeypatch.undo()
            await act.launch(placement(("a", "b")))  # the same generation again
            st = act.status("j")
            assert st is not None and [r.running for r in st.ranks] == [True, True]
        finally:
            await act.close()

    asyncio.run(main())


def test_a_restart_that_fails_half_way_leaves_no_rank_and_may_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        act = LocalProcessActuator(grace_s=0.5)
        act.register(spec(tmp_path))
        started: list[Any] = []
        try:
            await act.launch(placement(("a",)))
            real = subprocess.Popen

            def popen(*args: Any, **kwargs: Any) -> Any:
                if started:
                    raise ValueError("embedded null byte")
                started.append(real(*args, **kwargs))
                return started[-1]

            monkeypatch.setattr(local_launch.subprocess, "Popen", popen)
            with pytest.raises(ActuatorError, match=r"cannot start rank 1 .*embedded null byte"):
                await act.restart_job(placement(("a", "b"), generation=1), reason="t")
            assert started[0].returncode == -signal.SIGKILL
            current = await act.current_placement("j")
            assert current is not None and current.generation == 0  # the last one started
            monkeypatch.undo()
            await act.restart_job(placement(("a", "b"), generation=1), reason="retry")
            st = act.status("j")
            assert st is not None and st.placement.generation == 1
            assert [r.running for r in st.ranks] == [True, True]
        finally:
            await act.close()
            _kill_leftovers(started)

    asyncio.run(main())


def test_a_failed_launch_is_not_recorded_and_no_ranks_is_not_success(tmp_path: Path) -> None:
    async def main() -> None:
        act = LocalProcessActuator(grace_s=0.5)
        act.register(spec(tmp_path, argv=[str(tmp_path / "no-such-command")]))
        try:
            with pytest.raises(ActuatorError, match="No such file or directory"):
                await act.launch(placement(("a", "b")))
            assert act.status("j") is None and await act.current_placement("j") is None
            act.register(spec(tmp_path))
            await act.launch(placement(("a",)))
            act.register(spec(tmp_path, argv=[str(tmp_path / "no-such-command")]))
            with pytest.raises(ActuatorError, match="No such file or directory"):
                await act.restart_job(placement(("a", "b"), generation=1), reason="t")
            st = act.status("j")
            assert st is not None and st.placement.generation == 0 and not st.succeeded
            act.register(spec(tmp_path))
            await act.restart_job(placement(("a", "b"), generation=1), reason="fixed")
            current = await act.current_placement("j")
            assert current is not None and current.generation == 1
        finally:
            await act.close()
        assert not JobStatus(placement=placement(("a",)), ranks=[]).succeeded

    asyncio.run(main())


def test_launch_over_a_finished_generation_sweeps_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"

    async def main() -> int:
        act = LocalProcessActuator(grace_s=0.5)
        act.register(spec(tmp_path, env={"CHILD_PID_FILE": str(pid_file), "EXIT_NOW": "1"}))
        try:
            await act.launch(placement(("a",)))
            st = await act.wait_finished("j", timeout_s=20)
            assert st.finished and st.succeeded
            child = os.pidfd_open(int(pid_file.read_text()))
            try:
                act.register(spec(tmp_path))
                await act.launch(placement(("a",), generation=1))
                # Readable once the child has exited: the sweep's SIGKILL reached it.
                readable, _, _ = select.select([child], [], [], 10)
                if not readable:
                    signal.pidfd_send_signal(child, signal.SIGKILL)
                return len(readable)
            finally:
                os.close(child)
        finally:
            await act.close()

    assert asyncio.run(main()) == 1, "generation 0's child outlived the launch of generation 1"


def test_start_tries_every_configured_job_and_names_each_that_failed(tmp_path: Path) -> None:
    missing = [str(tmp_path / "no-such-command")]
    jobs = [
        (spec(tmp_path, name="bad1", argv=missing), placement(("a",), job="bad1")),
        (spec(tmp_path, name="good"), placement(("a",), job="good")),
        (spec(tmp_path, name="bad2", argv=missing), placement(("b",), job="bad2")),
    ]

    async def main() -> None:
        act = LocalProcessActuator(grace_s=0.5, jobs=jobs)
        try:
            with pytest.raises(ActuatorError, match="2 of 3 configured local jobs") as err:
                await act.start()
            assert "'bad1'" in str(err.value) and "'bad2'" in str(err.value)
            assert "'good'" not in str(err.value)
            st = act.status("good")
            assert st is not None and [r.running for r in st.ranks] == [True]
            pid = st.ranks[0].pid
            # Started again: the failed jobs are tried (and reported) again, the good one kept.
            with pytest.raises(ActuatorError, match="2 of 3 configured local jobs"):
                await act.start()
            st = act.status("good")
            assert st is not None and st.ranks[0].pid == pid
        finally:
            await act.close()

    asyncio.run(main())


def test_a_new_leader_goes_on_leading_when_a_configured_job_does_not_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's start used to let the actuator's error through, which ended the new
    leader's start (runtime._lead: no writer, no tickers) for one bad job in the file."""
    from controller.services.remediation.restore import start_configured

    missing = [str(tmp_path / "no-such-command")]
    jobs = [
        (spec(tmp_path, name="bad", argv=missing), placement(("a",), job="bad")),
        (spec(tmp_path, name="good"), placement(("a", "b"), job="good")),
    ]

    async def main() -> dict[str, int]:
        act = LocalProcessActuator(grace_s=0.5, jobs=jobs)
        sizes: dict[str, int] = {}
        try:
            await start_configured(act, sizes)
        finally:
            await act.close()
        return sizes

    with caplog.at_level("ERROR"):
        sizes = asyncio.run(main())
    assert any("'bad'" in r.getMessage() for r in caplog.records)
    assert sizes == {}  # the good job's size comes from its first restart's placement


def test_bad_directories_give_one_line_errors_before_the_running_generation_stops(
    tmp_path: Path,
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")

    async def main() -> None:
        act = LocalProcessActuator(grace_s=0.5)
        try:
            for log_dir in (a_file, a_file / "sub"):
                act.register(spec(tmp_path, log_dir=log_dir))
                with pytest.raises(
                    ActuatorError, match=re.escape(f"cannot create log_dir {log_dir}: ")
                ):
                    await act.launch(placement(("a",)))
            act.register(spec(tmp_path, cwd=tmp_path / "missing"))
            with pytest.raises(ActuatorError) as err:
                await act.launch(placement(("a",)))
            assert f"working directory {tmp_path / 'missing'} does not exist" in str(err.value)
            assert sys.executable not in str(err.value)
            act.register(spec(tmp_path))
            await act.launch(placement(("a",)))
            act.register(spec(tmp_path, log_dir=a_file))
            with pytest.raises(ActuatorError, match="cannot create log_dir"):
                await act.restart_job(placement(("a", "b"), generation=1), reason="t")
            st = act.status("j")  # the running generation was not stopped for nothing
            assert st is not None and st.placement.generation == 0
            assert [r.running for r in st.ranks] == [True]
        finally:
            await act.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"node_env": {"b": {"X": "bad\x00"}}}, "node_env"),
        ({"env": {"X\x00": "v"}}, "env"),
        ({"argv": [sys.executable, "-c", "pass\x00"]}, "argv"),
        ({"cwd": Path("/tmp/x\x00")}, "cwd"),
    ],
)
def test_the_spec_refuses_nul_bytes(tmp_path: Path, overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"job 'j': {field} contains a NUL byte"):
        spec(tmp_path, **overrides)


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ('"env": {"X": "bad\\u0000"}', "env"),
        ('"env": {"X\\u0000": "v"}', "env"),
        ('"node_env": {"a": {"X": "bad\\u0000"}}', "node_env"),
        ('"argv": ["python", "-c", "pass\\u0000"]', "argv"),
        ('"cwd": "/tmp/x\\u0000"', "cwd"),
        ('"env": {"A=B": "v"}', "env"),
    ],
)
def test_the_jobs_file_refuses_what_cannot_reach_a_rank(
    tmp_path: Path, entry: str, field: str
) -> None:
    path = tmp_path / "jobs.yaml"
    base = '"name": "j", "pool": ["a"]' + ("" if entry.startswith('"argv"') else ', "argv": ["x"]')
    path.write_text(f"[{{{base}, {entry}}}]")
    with pytest.raises(PolicyError, match=rf"\[0\]\.{field}: Value error, ") as err:
        load_local_jobs(path)
    assert "\n" not in str(err.value)
