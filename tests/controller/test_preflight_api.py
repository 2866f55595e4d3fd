"""Preflight end to end: the CLI asks the controller, the controller asks the agent through
the command channel, the agent runs its checks and the verdict comes back.

A real controller (uvicorn), a real in-process agent on simulated GPUs with a scripted
pending row remap (its ``clocks_load`` check loads the simulated GPUs with the stand-in
for 0.5 s), and ``trainguard preflight`` run in-process; ``--local`` runs the same checks on
this machine without a controller.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.daemon import Agent
from agents.settings import load_settings
from tests import http_calls
from tests.agents.sysfs_tree import SysfsTree
from trainguard.cli.app import run


@pytest.fixture
def agent_on(live_controller: Any, tmp_path: Path) -> Iterator[Agent]:
    tree = SysfsTree(tmp_path / "sys").build()
    settings = load_settings(
        controller_url=live_controller.url, token=live_controller.agent_token,
        node_name="pf-node", gpus="sim:2", sim_faults=["kind=remap,gpu=1,pending=1"],
        sample_interval_s=0.1, report_interval_s=0.3, spool_dir=tmp_path / "spool",
        preflight_load_s=0.5,
        socket_path="", metrics_port=-1, powercap_dir=tmp_path / "no-powercap",
        sysfs_root=tree.root, dev_dir=tmp_path / "no-dev",
    )  # fmt: skip
    agent = Agent(settings)
    stop = threading.Event()
    agent.start()
    thread = threading.Thread(target=agent.run_until, args=(stop,), daemon=True)
    thread.start()
    try:
        # The controller knows a node from its first report on.
        deadline = time.monotonic() + 20
        url = f"{live_controller.url}/api/v1/nodes/pf-node"
        while http_calls.get(url, headers=live_controller.headers("viewer")).status_code != 200:
            assert time.monotonic() < deadline, "the agent never reported"
            time.sleep(0.05)
        yield agent
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.stop()


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run(list(args), prog_name="trainguard")
    out = capsys.readouterr()
    return code, out.out, out.err


def test_preflight_through_the_controller_names_the_failure(
    live_controller: Any, agent_on: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--server", live_controller.url, "--token", live_controller.operator_token]
    code, out, err = _cli(capsys, "preflight", "pf-node", *base, "-o", "json", "--wait", "20")
    assert code == 1, err
    (row,) = json.loads(out)
    assert (row["node"], row["result"]) == ("pf-node", "fail")
    assert row["reason"] == (
        "preflight failed 1/15 checks: gpu1 memory_repair: row remap pending: reset the GPU first"
    )
    # The same verdict is readable by id (for the Kubernetes actuator or a scheduler hook).
    got = http_calls.get(
        f"{live_controller.url}/api/v1/nodes/pf-node/preflight/{row['command']}",
        headers=live_controller.headers("viewer"),
    ).json()
    assert (got["kind"], got["status"]) == ("run_preflight", "failed")
    # A node the controller never heard of is a usage error (exit 2), one line.
    code, _out, err = _cli(capsys, "preflight", "no-such-node", *base)
    assert code == 2 and "not found" in err and err.count("\n") == 1


def test_preflight_api_refuses_viewers_and_bad_bodies(live_controller: Any) -> None:
    url = f"{live_controller.url}/api/v1/nodes/pf-x/preflight"
    assert http_calls.post(url, headers=live_controller.headers("viewer")).status_code == 403
    bad = http_calls.post(
        url, json={"expected_nic_rate_gbps": -1}, headers=live_controller.headers("operator")
    )
    assert bad.status_code == 422


def test_local_preflight_and_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    local = ["preflight", "--local", "--gpus", "sim:2", "--sysfs-root", str(tree.root)]
    code, out, err = _cli(capsys, *local, "--load-s", "0.5")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["NODE", "CHECK", "TARGET", "RESULT", "REASON"]
    assert any("simulated GPUs (sim): not real hardware" in r for r in rows)
    # --local loads the GPUs too (the simulator's stand-in load here), and says when it did not.
    loaded = [r.split() for r in rows if " clocks_load " in r]
    assert [(r[2], r[3]) for r in loaded] == [("gpu0", "pass"), ("gpu1", "pass")], rows
    code, out, _ = _cli(capsys, *local, "--load-s", "0", "-o", "json")
    skipped = [c for c in json.loads(out) if c["name"] == "clocks_load"]
    assert (
        code == 0
        and [(c["status"], c["reason"]) for c in skipped]
        == [("skip", "no load generated: --load-s 0")] * 2
    )
    code, out, _ = _cli(
        capsys, *local, "--load-s", "0", "--expected-nic-rate-gbps", "800", "-o", "json"
    )
    failed = [c for c in json.loads(out) if c["status"] == "fail"]
    assert code == 1 and {c["target"] for c in failed} == {"mlx5_0/1", "mlx5_1/1"}
    code, _, err = _cli(capsys, "preflight")
    assert code == 2 and "name at least one NODE, or use --local" in err
    code, _, err = _cli(capsys, "preflight", "n1", "--local")
    assert code == 2 and "not both" in err
