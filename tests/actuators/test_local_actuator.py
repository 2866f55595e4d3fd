"""The local-process actuator against real processes (a tiny Python rank, no torch).

The rank writes its environment to ``$OUT/g<gen>.rank<rank>.json``, optionally starts a
``sleep`` child (ignoring SIGTERM) in its process group, then sleeps; on SIGTERM it exits 0 unless
``IGNORE_TERM`` is set (a hung rank), and ``EXIT_RANK``/``EXIT_CODE`` make one rank exit at
once with a given status.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from controller.actuators.base import ActuatorError, Placement
from controller.actuators.local import LocalJobSpec, LocalProcessActuator

pytestmark = pytest.mark.slow

T = TypeVar("T")

RANK_SCRIPT = r"""
import json, os, signal, subprocess, sys, time
env = dict(os.environ)
if env.get("SPAWN_CHILD"):
    # A child that ignores SIGTERM: only the actuator's SIGKILL sweep of the group ends it.
    child = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 60"])
    env["CHILD_PID"] = str(child.pid)
if env.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
out = os.path.join(env["OUT"], f"g{env['TRAINGUARD_GENERATION']}.rank{env['RANK']}.json")
with open(out + ".tmp", "w") as f:
    json.dump(env, f)
os.replace(out + ".tmp", out)
print("rank", env["RANK"], "up", flush=True)
if env.get("EXIT_RANK") == env["RANK"]:
    sys.exit(int(env["EXIT_CODE"]))
if env.get("EXIT_ALL"):
    sys.exit(0)
time.sleep(60)
"""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def make_spec(tmp_path: Path, **overrides: Any) -> LocalJobSpec:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    fields: dict[str, Any] = {
        "name": "gpt",
        "argv": [sys.executable, "-c", RANK_SCRIPT],
        "pool": ["node-a", "node-b", "node-c"],
        "ranks_per_node": 2,
        "tp": 2,
        "env": {"OUT": str(out), "COMMON": "yes"},
        "node_env": {
            "node-a": {"TRAINGUARD_AGENT_SOCKET": "/run/a.sock"},
            "node-b": {"TRAINGUARD_AGENT_SOCKET": "/run/b.sock"},
        },
        "log_dir": tmp_path / "logs",
    }
    fields.update(overrides)
    return LocalJobSpec(**fields)


def read_envs(
    tmp_path: Path, generation: int, world: int, timeout_s: float = 20.0
) -> list[dict[str, str]]:
    paths = [tmp_path / "out" / f"g{generation}.rank{r}.json" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"ranks of generation {generation} never started"
        time.sleep(0.02)
    return [json.loads(p.read_text()) for p in paths]


def alive(pid: int) -> bool:
    """True for a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_launch_gives_each_rank_torchrun_env_and_its_node_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator(grace_s=2.0)
        act.register(make_spec(tmp_path))
        p = Placement(job="gpt", nodes=("node-b", "node-a"), ranks_per_node=2, tp=2, resume_step=30)
        # The controller's own settings (its tokens) never reach a rank.
        monkeypatch.setenv("TRAINGUARD_TOKENS", "secret-controller-tokens")
        result = await act.launch(p)
        assert result.details["world_size"] == 4
        envs = await asyncio.to_thread(read_envs, tmp_path, 0, 4)
        for rank, env in enumerate(envs):
            node = "node-b" if rank < 2 else "node-a"
            assert env["RANK"] == str(rank)
            assert env["WORLD_SIZE"] == "4"
            assert env["LOCAL_RANK"] == str(rank % 2)
            assert env["LOCAL_WORLD_SIZE"] == "2"
            assert env["MASTER_ADDR"] == "127.0.0.1"
            assert env["MASTER_PORT"] == str(result.details["master_port"])
            assert env["TRAINGUARD_JOB"] == "gpt"
            assert env["TRAINGUARD_NODE"] == node
            assert env["TRAINGUARD_GENERATION"] == "0"
            assert env["TRAINGUARD_RESUME_STEP"] == "30"
            assert env["TG_TP"] == "2"
            assert env["COMMON"] == "yes"
            assert env["TRAINGUARD_AGENT_SOCKET"] == f"/run/{node[-1]}.sock"
            assert env["TRAINGUARD_GPU_INDEX"] == str(rank % 2)
            assert "TRAINGUARD_TOKENS" not in env
        st = act.status("gpt")
        assert st is not None and not st.finished
        assert [r.node for r in st.ranks] == ["node-b", "node-b", "node-a", "node-a"]
        assert st.ranks[3].log_path.name == "gpt.g0.rank3.log"
        with pytest.raises(ActuatorError, match="still running; use restart_job"):
            await act.launch(p)
        await act.close()
        assert "rank 3 up" in st.ranks[3].log_path.read_text()
        assert (await act.wait_finished("gpt", timeout_s=1)).finished

    run(scenario())


def test_stop_sends_sigterm_then_sigkill_to_a_rank_that_ignores_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator(grace_s=0.5)
        spec = make_spec(tmp_path, node_env={"node-b": {"IGNORE_TERM": "1"}})
        act.register(spec)
        await act.launch(Placement(job="gpt", nodes=("node-a", "node-b"), ranks_per_node=2, tp=2))
        await asyncio.to_thread(read_envs, tmp_path, 0, 4)
        t0 = time.monotonic()
        result = await act.stop_job("gpt", reason="test")
        took = time.monotonic() - t0
        assert 0.4 < took < 5, took
        assert result.details["killed_ranks"] == [2, 3]
        assert result.details["exit_codes"] == [0, 0, -9, -9]
        assert "2 ranks needed SIGKILL" in result.outcome
        again = await act.stop_job("gpt", reason="test")
        assert again.outcome == "job gpt not running"
        st = act.status("gpt")
        assert st is not None and st.finished and not st.succeeded

    run(scenario())


def test_restart_with_a_smaller_placement_and_generation_guard(tmp_path: Path) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator(grace_s=2.0)
        act.register(make_spec(tmp_path, tp=1))
        g0 = Placement(job="gpt", nodes=("node-a", "node-b", "node-c"), ranks_per_node=2)
        first = await act.launch(g0)
        await asyncio.to_thread(read_envs, tmp_path, 0, 6)
        g1 = Placement(
            job="gpt", nodes=("node-a", "node-c"), ranks_per_node=2, generation=1, resume_step=5
        )
        result = await act.restart_job(g1, reason="node-b isolated")
        assert result.details["stopped"]["exit_codes"] == [0] * 6
        assert not any(alive(pid) for pid in first.details["pids"])
        envs = await asyncio.to_thread(read_envs, tmp_path, 1, 4)
        assert [e["TRAINGUARD_NODE"] for e in envs] == ["node-a"] * 2 + ["node-c"] * 2
        assert {e["WORLD_SIZE"] for e in envs} == {"4"}
        assert {e["TRAINGUARD_RESUME_STEP"] for e in envs} == {"5"}
        assert envs[0]["MASTER_PORT"] != str(first.details["master_port"])
        assert await act.current_placement("gpt") == g1
        # A retried restart of the same generation, or an older one, is refused.
        for stale in (g1, g0):
            with pytest.raises(ActuatorError, match="is not newer than generation 1"):
                await act.restart_job(stale, reason="retry")
        assert all(r.running for r in act.status("gpt").ranks)  # type: ignore[union-attr]
        assert [e["reason"] for e in act.events] == ["Restarted"]
        await act.close()

    run(scenario())


def test_refuses_placements_that_do_not_fit_the_spec(tmp_path: Path) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator()
        act.register(make_spec(tmp_path))
        with pytest.raises(ActuatorError, match="not registered"):
            await act.launch(Placement(job="other", nodes=("node-a",), ranks_per_node=2))
        with pytest.raises(ActuatorError, match="outside its pool: node-z"):
            await act.launch(Placement(job="gpt", nodes=("node-z",), ranks_per_node=2, tp=2))
        with pytest.raises(ActuatorError, match="the spec says 2, 2"):
            await act.launch(Placement(job="gpt", nodes=("node-a",), ranks_per_node=4, tp=2))
        missing = make_spec(tmp_path, name="broken", argv=[str(tmp_path / "no-such-binary")])
        act.register(missing)
        with pytest.raises(ActuatorError, match="cannot start"):
            await act.launch(Placement(job="broken", nodes=("node-a",), ranks_per_node=2, tp=2))
        assert await act.current_placement("gpt") is None
        assert await act.candidate_nodes("gpt") == ["node-a", "node-b", "node-c"]
        with pytest.raises(ActuatorError, match="never launched"):
            await act.wait_finished("gpt")

    run(scenario())
    with pytest.raises(ValueError, match="tp=3 must divide"):
        make_spec(tmp_path, tp=3)
    with pytest.raises(ValueError, match="outside the pool"):
        make_spec(tmp_path, node_env={"node-q": {}})


def test_status_and_wait_finished_report_exit_codes(tmp_path: Path) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator()
        act.register(
            make_spec(
                tmp_path,
                env={
                    "OUT": str(tmp_path / "out"),
                    "EXIT_ALL": "1",
                    "EXIT_RANK": "1",
                    "EXIT_CODE": "3",
                },
            )
        )
        await act.launch(Placement(job="gpt", nodes=("node-a",), ranks_per_node=2, tp=2))
        st = await act.wait_finished("gpt", timeout_s=20)
        assert st.finished and not st.succeeded
        assert [r.exit_code for r in st.ranks] == [0, 3]
        assert st.as_dict()["ranks"][1]["exit_code"] == 3
        # A finished generation may be followed by a plain launch of a newer one.
        await act.launch(
            Placement(job="gpt", nodes=("node-b",), ranks_per_node=2, tp=2, generation=1)
        )
        await act.close()

    run(scenario())


def test_close_leaves_no_process_behind(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        act = LocalProcessActuator(grace_s=0.3)
        act.register(
            make_spec(
                tmp_path,
                env={"OUT": str(tmp_path / "out"), "SPAWN_CHILD": "1"},
                node_env={"node-c": {"IGNORE_TERM": "1"}},
            )
        )
        await act.launch(Placement(job="gpt", nodes=("node-a", "node-c"), ranks_per_node=2, tp=2))
        envs = await asyncio.to_thread(read_envs, tmp_path, 0, 4)
        pids = [int(e["CHILD_PID"]) for e in envs]
        st = act.status("gpt")
        assert st is not None
        pids += [r.pid for r in st.ranks]
        assert all(alive(pid) for pid in pids)
        await act.close()
        await act.close()  # idempotent
        return pids

    pids = run(scenario())
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # orphaned children are reaped by init, not by us
    assert not [pid for pid in pids if alive(pid)]


def test_isolation_is_bookkeeping_and_events_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        act = LocalProcessActuator()
        act.register(make_spec(tmp_path))
        with caplog.at_level("INFO", logger="controller.actuators.local"):
            r1 = await act.isolate_node("node-b", reason="xid 79")
            r2 = await act.isolate_node("node-b", reason="xid 79")
        assert (r1.outcome, r2.outcome) == ("node node-b isolated", "node node-b already isolated")
        assert act.isolated_nodes == {"node-b": "xid 79"}
        # The pool is returned as is: subtracting isolated nodes is the engine's job.
        assert await act.candidate_nodes("gpt") == ["node-a", "node-b", "node-c"]
        assert (
            await act.release_node("node-b", reason="repaired")
        ).outcome == "node node-b released"
        assert (
            await act.release_node("node-b", reason="x")
        ).outcome == "node node-b was not isolated"
        assert "Isolated node-b: xid 79" in caplog.text
        assert caplog.records[0].fields["event"]["warning"] is True  # type: ignore[attr-defined]

    run(scenario())
    assert os.environ.get("TRAINGUARD_RESUME_STEP") is None
