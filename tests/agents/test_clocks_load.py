"""The ``clocks_load`` preflight check: real load processes, NVML reads through the simulator.

The simulated driver models a loaded GPU (``load_dir`` markers written by the stand-in
``agents/gpu/sim_load.py`` while it runs) with the same calls and units as pynvml, so the
check's own code (spawning, sampling on its thread, judging) is what runs on a real node.
The real generator (``collectives/gpu_load.py``) runs here too: this machine has torch but
no CUDA, so it must come back *skipped*, and without torch it must say so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agents.clocks_load import (
    EXIT_NO_CUDA,
    EXIT_NO_TORCH,
    ClocksLoadRunner,
    LoadSettings,
    default_load_command,
    load_targets,
    merge,
    run_clocks_load,
)
from agents.daemon import Agent
from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.preflight import NO_LOAD_REQUESTED, Check, summary
from agents.sampler import GpuSampler
from agents.settings import load_settings
from tests.agents.agents_testkit import TOKEN, FakeController, LocalClient, Running
from tests.agents.sysfs_tree import SysfsTree

PY = sys.executable
GPU_LOAD = Path(__file__).resolve().parents[2] / "collectives" / "gpu_load.py"


class SimNode:
    """A simulated idle node (0 % utilization until something loads a GPU) and its sampler."""

    def __init__(self, load_dir: Path, faults: str = "", gpus: int = 2) -> None:
        self.api = SimNvml(
            gpu_count=gpus, utilization_pct=0, faults=parse_fault_specs(faults), load_dir=load_dir
        )
        self.api.nvmlInit()
        self.sampler = GpuSampler(self.api, timeout_s=2.0)
        self.sampler.open()

    def load(self, command: list[str], seconds: float = 1.0, **kw: Any) -> dict[str, Check]:
        targets = load_targets(
            self.sampler.sample(),
            self.sampler.inventory,
            self.sampler.handles,
            kw.pop("locked", lambda _i: None),
        )
        settings = LoadSettings(command=tuple(command), seconds=seconds, **kw)
        return {c.target: c for c in run_clocks_load(self.api, targets, settings)}

    def close(self) -> None:
        self.sampler.close()
        self.api.nvmlShutdown()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    made = SimNode(tmp_path)
    yield made
    made.close()


def stand_in(node: SimNode) -> list[str]:
    return node.api.sim_load_command()


def test_a_healthy_gpu_under_load_passes_with_its_clock(node: SimNode) -> None:
    got = node.load(stand_in(node))
    assert set(got) == {"gpu0", "gpu1"}
    for check in got.values():
        assert (check.name, check.status) == ("clocks_load", "pass"), check.reason
        assert check.reason.startswith("SM clock 1980 MHz under load (")
        assert check.reason.endswith("100% of max 1980 MHz; clock-event reasons: none")
    # The load is over: the stand-in took its marker with it and the GPU is idle again.
    assert not list(node.api.load_dir.iterdir())  # type: ignore[union-attr]
    assert {g.utilization_gpu_pct for g in node.sampler.sample()} == {0}


def test_slowdown_reasons_and_low_clocks_fail_with_what_nvml_said(tmp_path: Path) -> None:
    faults = "kind=thermal,gpu=0;kind=slowdown,gpu=1,mhz=700;kind=slowdown,gpu=2,brake=1"
    node = SimNode(tmp_path, faults, gpus=4)
    try:
        got = node.load(stand_in(node))
    finally:
        node.close()
    status = {t: c.status for t, c in got.items()}
    assert status == {"gpu0": "fail", "gpu1": "fail", "gpu2": "fail", "gpu3": "pass"}
    assert got["gpu0"].reason.startswith("sw_thermal_slowdown, hw_thermal_slowdown in ")
    assert "SM clock 1188 MHz under load" in got["gpu0"].reason  # 60 % of 1980
    assert got["gpu1"].reason.startswith("SM clock 700 MHz under load (")
    assert got["gpu1"].reason.endswith(
        "is 35% of max 1980 MHz (needs 60%); clock-event reasons: none"
    )
    # The power brake fails even at full clock: the board is being held back by its supply.
    assert got["gpu2"].reason.startswith("hw_power_brake_slowdown in ")
    assert "SM clock 1980 MHz" in got["gpu2"].reason


def test_a_driver_before_r535_is_read_through_the_throttle_name(tmp_path: Path) -> None:
    node = SimNode(tmp_path, "kind=thermal,gpu=0")
    node.api.missing = frozenset({"nvmlDeviceGetCurrentClocksEventReasons"})
    try:
        got = node.load(stand_in(node))
    finally:
        node.close()
    assert got["gpu0"].status == "fail"
    assert got["gpu0"].reason.startswith("sw_thermal_slowdown, hw_thermal_slowdown in ")
    assert got["gpu1"].status == "pass", got["gpu1"].reason


def test_a_clock_lock_counts_against_the_lock_this_agent_set(node: SimNode) -> None:
    for handle in node.sampler.handles:
        node.api.nvmlDeviceSetGpuLockedClocks(handle, 500, 1000)
    got = node.load(stand_in(node), locked=lambda i: 1000 if i == 0 else None)
    assert got["gpu0"].status == "pass"
    assert "100% of the 1000 MHz lock this agent set" in got["gpu0"].reason
    # Locked by someone else: 1000 of 1980 MHz is too slow, and NVML says why.
    assert got["gpu1"].status == "fail"
    assert got["gpu1"].reason.endswith(
        "is 51% of max 1980 MHz (needs 60%); clock-event reasons: applications_clocks_setting"
    )


def test_a_load_command_that_fails_fails_the_check(node: SimNode) -> None:
    crash = (
        "import sys; print('CUDA error: an illegal memory access', file=sys.stderr); sys.exit(1)"
    )
    got = node.load([PY, "-c", crash])
    assert got["gpu0"].status == "fail"
    assert got["gpu0"].reason == (
        "load command exited with status 1: CUDA error: an illegal memory access"
    )
    missing = node.load(["/nonexistent/gpu-load", "{gpu}"])
    assert missing["gpu1"].status == "fail"
    assert missing["gpu1"].reason == (
        "load command did not run: /nonexistent/gpu-load: No such file or directory"
    )


def test_a_load_that_reached_no_gpu_is_no_pass(node: SimNode) -> None:
    got = node.load([PY, "-c", "import time; time.sleep(0.5)"])
    assert [c.status for c in got.values()] == ["fail", "fail"]
    assert "the load ran but NVML never saw the GPU busy" in got["gpu0"].reason
    assert got["gpu0"].reason.endswith("at most 0% utilization)")


def test_a_hung_load_is_killed_at_the_limit(node: SimNode, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    hang = (
        "import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); "
        "time.sleep(300)"
    )
    got = node.load([PY, "-c", hang, str(pids)], seconds=0.2, grace_s=1.0)
    assert [c.status for c in got.values()] == ["fail", "fail"]
    assert got["gpu0"].reason == "load command ran past 1.2 s and was killed"
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2
    for pid in started:  # reaped, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_no_torch_or_no_cuda_is_a_skip_never_a_pass(node: SimNode) -> None:
    # The real generator, started the way the agent starts it; -S hides site-packages.
    no_torch = node.load([PY, "-S", str(GPU_LOAD), "--gpu", "{gpu}", "--seconds", "{seconds}"])
    assert [c.status for c in no_torch.values()] == ["skip", "skip"]
    assert no_torch["gpu0"].reason.startswith(
        "no load generated: torch is not importable (gpu_load: torch is not importable ("
    )
    exit4 = node.load(
        [PY, "-c", f"import sys; print('no GPU', file=sys.stderr); sys.exit({EXIT_NO_CUDA})"]
    )
    assert exit4["gpu1"].status == "skip"
    assert exit4["gpu1"].reason == "no load generated: no usable CUDA device (no GPU)"


@pytest.mark.slow  # torch's import alone: 15-60 s of wall time on this shared machine
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_real_generator_skips_on_a_node_without_cuda(tmp_path: Path) -> None:
    import torch  # only to know what this machine is

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu runs the generator for real")
    command = default_load_command()
    assert command is not None and command[1] == str(GPU_LOAD)
    node = SimNode(tmp_path, gpus=1)
    try:
        got = node.load(command, seconds=0.5)
    finally:
        node.close()
    assert [c.status for c in got.values()] == ["skip"]
    assert got["gpu0"].reason.startswith(
        "no load generated: no usable CUDA device (gpu_load: no CUDA device visible (torch "
    )


def test_exit_statuses_match_the_generator() -> None:
    spec = importlib.util.spec_from_file_location("gpu_load_file", GPU_LOAD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    spec.loader.exec_module(module)  # imports no torch at module level
    assert (module.EXIT_NO_TORCH, module.EXIT_NO_CUDA) == (EXIT_NO_TORCH, EXIT_NO_CUDA)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] == "torch"}


def test_the_sim_reports_load_only_while_the_marker_names_a_live_process(tmp_path: Path) -> None:
    api = SimNvml(gpu_count=1, utilization_pct=0, load_dir=tmp_path)
    api.nvmlInit()
    h = api.nvmlDeviceGetHandleByIndex(0)
    try:
        assert api.nvmlDeviceGetUtilizationRates(h).gpu == 0
        (tmp_path / "gpu0.pid").write_text(f"{os.getpid()}\n")
        time.sleep(0.05)
        assert api.nvmlDeviceGetUtilizationRates(h).gpu == 100
        assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
        (tmp_path / "gpu0.pid").write_text("999999999\n")  # no such process
        time.sleep(0.05)
        assert api.nvmlDeviceGetUtilizationRates(h).gpu == 0
        assert api.nvmlDeviceGetCurrentClocksEventReasons(h) == (
            pynvml.nvmlClocksEventReasonGpuIdle
        )
    finally:
        api.nvmlShutdown()


# ---------------------------------------------------------------------- through the agent


def _agent(tmp_path: Path, url: str, tree: SysfsTree, sock: str = "", **kw: Any) -> Agent:
    s = load_settings(
        controller_url=url, token=TOKEN, node_name="load-node", gpus="sim:2",
        sample_interval_s=0.05, report_interval_s=0.1, spool_dir=tmp_path / "spool",
        socket_path=sock, metrics_port=-1, powercap_dir=tmp_path / "no-powercap",
        sysfs_root=tree.root, dev_dir=tmp_path / "no-dev", **kw,
    )  # fmt: skip
    return Agent(s)


def _acks(controller: FakeController, command_id: str) -> list[Any]:
    reports = controller.state.ordered()
    return [a for r in reports for a in r.command_acks if a.command_id == command_id]


def test_the_heartbeat_goes_on_while_the_agent_loads_its_gpus(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    agent = _agent(tmp_path, agents_controller.url, tree, preflight_load_s=2.0)
    loads: set[threading.Thread] = set()

    def load_acked() -> bool:
        loads.update(t for t in threading.enumerate() if t.name == "preflight-load")
        return bool(_acks(agents_controller, "pf-load"))

    with Running(agent):
        agents_controller.queue_command("load-node", {"id": "pf-load", "kind": "run_preflight"})
        agents_controller.wait_for(lambda: "pf-load" in agents_controller.state.delivered_at)
        # The controller resends while the load runs: no second load, no early ack.
        agents_controller.queue_command("load-node", {"id": "pf-load", "kind": "run_preflight"})
        agents_controller.wait_for(load_acked, timeout_s=60)
        # The load thread acks as its last act: wait for it to end, the agent still running.
        for thread in loads:
            thread.join(timeout=10)
        assert len(loads) == 1 and not any(t.is_alive() for t in loads)
    state = agents_controller.state
    delivered, acked = state.delivered_at["pf-load"], state.acked_at["pf-load"]
    during = [t for t in state.post_times if delivered < t < acked]
    # The reporter thread carried the command; had it run the load, nothing would have been
    # posted between the command and its ack.
    assert len(during) >= 3, (len(during), acked - delivered)
    (ack,) = _acks(agents_controller, "pf-load")
    assert ack.status == "succeeded", ack.reason
    assert ack.reason == "preflight passed: 15 checks (0 skipped)"


def test_no_load_over_a_running_job_or_when_disabled(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    with tempfile.TemporaryDirectory(prefix="tgl-") as short:
        sock = str(Path(short) / "agent.sock")
        agent = _agent(tmp_path, agents_controller.url, tree, sock=sock, preflight_load_s=0.5)
        with Running(agent):
            client = LocalClient(sock)
            assert client.hello("train-a", rank=0).ok
            agents_controller.wait_for(lambda: agent._local_clients() == 1)
            assert agent._load_settings() == (
                None,
                "no load generated: 1 job rank(s) connected to this agent",
            )
            agents_controller.queue_command("load-node", {"id": "pf-job", "kind": "run_preflight"})
            agents_controller.wait_for(lambda: _acks(agents_controller, "pf-job"))
            client.close()
    (ack,) = _acks(agents_controller, "pf-job")
    assert ack.reason == "preflight passed: 13 checks (2 skipped)"
    off = _agent(tmp_path / "off", agents_controller.url, tree, preflight_load=False)
    try:
        assert off._load_settings() == (None, "no load generated: disabled (preflight_load=false)")
    finally:
        off.stop()


def test_a_crashed_check_fails_the_preflight_instead_of_vanishing() -> None:
    runner = ClocksLoadRunner()
    got: list[list[Check]] = []

    def broken(_cancel: threading.Event) -> list[Check]:
        raise RuntimeError("bug")

    runner.start(broken, got.append).join(timeout=10)
    placeholder = [Check("clocks_load", "gpu0", "skip", NO_LOAD_REQUESTED)]
    (results,) = got
    merged = merge(placeholder, results)
    assert [(c.target, c.status) for c in merged] == [("gpu0", "skip"), ("node", "fail")]
    assert merged[1].reason == "agent error: RuntimeError"
    assert summary(merged).startswith("preflight failed 1/1 checks: node clocks_load: agent error")


def test_stopping_the_agent_kills_the_load_and_skips_the_check(node: SimNode) -> None:
    cancel = threading.Event()
    targets = load_targets(node.sampler.sample(), node.sampler.inventory, node.sampler.handles)
    settings = LoadSettings(command=tuple(stand_in(node)), seconds=300)
    out: list[list[Check]] = []
    worker = threading.Thread(
        target=lambda: out.append(run_clocks_load(node.api, targets, settings, cancel=cancel))
    )
    worker.start()
    load_dir = node.api.load_dir
    assert load_dir is not None
    deadline = time.monotonic() + 60
    while len(list(load_dir.glob("gpu*.pid"))) < 2:  # both stand-ins are loading
        assert time.monotonic() < deadline, "the stand-in loads never started"
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in load_dir.glob("gpu*.pid")]
    cancel.set()
    worker.join(timeout=30)
    assert not worker.is_alive()
    (checks,) = out
    assert {(c.status, c.reason) for c in checks} == {
        ("skip", "cancelled: the agent stopped during the load")
    }
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
