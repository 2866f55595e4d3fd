"""Command executor: GPU commands through the NVML-like API, job commands relayed."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest
from pydantic import TypeAdapter

from agents.commands import REMEMBERED_COMMANDS, CommandExecutor, CommandTimeout, Finish
from agents.gpu.sim import SimNvml
from trainguard.wire import Command, CommandAck, CommandStatus, RunPreflight

COMMAND = TypeAdapter(Command)


def executor(
    no_permission: bool = False, relay_clients: int = 0
) -> tuple[CommandExecutor, SimNvml, list[CommandAck], list[object]]:
    api = SimNvml(gpu_count=2, no_permission=no_permission, utilization_pct=100)
    api.nvmlInit()
    handles = [api.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    acks: list[CommandAck] = []
    relayed: list[object] = []

    def relay(cmd: object) -> int:
        relayed.append(cmd)
        return relay_clients

    return CommandExecutor(api, handles, relay=relay, on_ack=acks.append), api, acks, relayed


def cmd(**kw: object) -> Command:
    return COMMAND.validate_python(kw)


def test_set_and_reset_power_limit_convert_watts_to_milliwatts() -> None:
    ex, api, acks, _ = executor()
    h = api.nvmlDeviceGetHandleByIndex(1)
    ex.handle([cmd(id="c1", kind="set_power_limit", gpu_index=1, limit_w=350.5)])
    assert acks[-1].status == CommandStatus.SUCCEEDED
    assert "350.5 W" in acks[-1].reason and "was 700 W" in acks[-1].reason
    assert api.nvmlDeviceGetEnforcedPowerLimit(h) == 350_500
    assert api.nvmlDeviceGetPowerUsage(h) <= 350_500  # the cap bites
    ex.handle([cmd(id="c2", kind="reset_power_limit", gpu_index=1)])
    assert acks[-1].status == CommandStatus.SUCCEEDED
    assert api.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000


@pytest.mark.parametrize("limit_w", [150.0, 700.5, 5000.0])
def test_out_of_range_power_limit_names_the_allowed_range(limit_w: float) -> None:
    ex, api, _, _ = executor()
    ack = ex.execute(cmd(id="c1", kind="set_power_limit", gpu_index=0, limit_w=limit_w))
    assert ack.status == CommandStatus.FAILED and "allowed range 200-700 W" in ack.reason
    assert api.nvmlDeviceGetEnforcedPowerLimit(api.nvmlDeviceGetHandleByIndex(0)) == 700_000


def test_no_permission_is_a_failed_ack_saying_root_is_needed() -> None:
    ex, _, _, _ = executor(no_permission=True)
    for c in (
        cmd(id="a", kind="set_power_limit", gpu_index=0, limit_w=300),
        cmd(id="b", kind="lock_clocks", gpu_index=0, min_mhz=500, max_mhz=1400),
        cmd(id="c", kind="unlock_clocks", gpu_index=0),
    ):
        ack = ex.execute(c)
        assert ack.status == CommandStatus.FAILED
        assert ack.reason.startswith("no permission:") and "needs root" in ack.reason


def test_lock_and_unlock_clocks() -> None:
    ex, api, _, _ = executor()
    h = api.nvmlDeviceGetHandleByIndex(0)
    ack = ex.execute(cmd(id="l1", kind="lock_clocks", gpu_index=0, min_mhz=600, max_mhz=1400))
    assert ack.status == CommandStatus.SUCCEEDED
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1400
    assert ex.locked_clock_mhz(0) == 1400
    bad = ex.execute(cmd(id="l2", kind="lock_clocks", gpu_index=0, min_mhz=600, max_mhz=2500))
    assert bad.status == CommandStatus.FAILED and "allowed range 1-1980 MHz" in bad.reason
    inverted = ex.execute(cmd(id="l3", kind="lock_clocks", gpu_index=0, min_mhz=900, max_mhz=800))
    assert inverted.status == CommandStatus.FAILED and "above max_mhz" in inverted.reason
    assert ex.execute(cmd(id="u1", kind="unlock_clocks", gpu_index=0)).status == "succeeded"
    assert api.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert ex.locked_clock_mhz(0) is None


def test_unknown_gpu_index_fails_cleanly() -> None:
    ex, _, _, _ = executor()
    ack = ex.execute(cmd(id="x", kind="set_power_limit", gpu_index=7, limit_w=300))
    assert (
        ack.status == CommandStatus.FAILED and "out of range (this node has 2 GPUs)" in ack.reason
    )


def test_job_commands_are_relayed_or_fail_without_local_ranks() -> None:
    ex, _, _, relayed = executor(relay_clients=3)
    ack = ex.execute(cmd(id="j1", kind="job_checkpoint", job="train-a"))
    assert ack.status == CommandStatus.RELAYED and "3 local client(s)" in ack.reason
    assert len(relayed) == 1
    lonely, _, _, _ = executor(relay_clients=0)
    ack = lonely.execute(cmd(id="j2", kind="job_stop", job="train-b"))
    assert (
        ack.status == CommandStatus.FAILED and ack.reason == "no rank of job train-b on this node"
    )


def test_a_repeated_command_id_is_not_executed_twice() -> None:
    ex, api, acks, relayed = executor(relay_clients=1)
    h = api.nvmlDeviceGetHandleByIndex(0)
    first = cmd(id="same", kind="set_power_limit", gpu_index=0, limit_w=300)
    ex.handle([first])
    api.nvmlDeviceSetPowerManagementLimit(h, 500_000)  # someone changes it meanwhile
    ex.handle([first])
    assert api.nvmlDeviceGetEnforcedPowerLimit(h) == 500_000  # not re-applied
    assert acks[0] == acks[1]  # the same ack is sent again
    job = cmd(id="j", kind="job_link_probe", job="t", at_step=5, pairs=[[0, 1]])
    ex.handle([job, job])
    assert len(relayed) == 1


def test_a_preflight_acks_when_it_finishes_and_a_resend_does_not_start_it_again() -> None:
    api = SimNvml(gpu_count=1)
    api.nvmlInit()
    acks: list[CommandAck] = []
    started: list[tuple[str, Finish]] = []

    def preflight(command: RunPreflight, finish: Finish) -> None:
        started.append((command.id, finish))  # finishes later, as a GPU load does

    ex = CommandExecutor(api, [], relay=lambda _c: 0, on_ack=acks.append, preflight=preflight)
    pf = cmd(id="pf", kind="run_preflight")
    assert ex.handle([pf]) == [] and acks == []
    assert ex.handle([pf]) == [] and len(started) == 1  # the controller resent it meanwhile
    threading.Thread(target=started[0][1], args=(False, "gpu0 clocks_load: hw_slowdown")).start()
    deadline = time.monotonic() + 10
    while not acks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(a.command_id, a.status, a.reason) for a in acks] == [
        ("pf", CommandStatus.FAILED, "gpu0 clocks_load: hw_slowdown")
    ]
    again = ex.handle([pf])  # resent after the ack was lost: the same verdict, no new run
    assert again == acks[:1] and len(started) == 1
    started[0][1](True, "late second verdict")  # ignored
    assert len(acks) == 2 and acks[1] == acks[0]


def test_execute_waits_for_a_preflight_that_finishes_on_another_thread() -> None:
    api = SimNvml(gpu_count=1)
    api.nvmlInit()
    started, go = threading.Event(), threading.Event()

    def preflight(command: RunPreflight, finish: Finish) -> None:
        def load() -> None:
            go.wait(10)
            finish(True, f"{command.id} passed")

        threading.Thread(target=load, daemon=True).start()
        started.set()

    ex = CommandExecutor(api, [], relay=lambda _c: 0, on_ack=lambda _a: None, preflight=preflight)
    got: list[CommandAck] = []
    caller = threading.Thread(
        target=lambda: got.append(ex.execute(cmd(id="pf", kind="run_preflight")))
    )
    caller.start()
    assert started.wait(10)
    caller.join(0.2)
    assert caller.is_alive() and got == []  # no ack before the preflight finished
    go.set()
    caller.join(10)
    assert not caller.is_alive()
    assert [(a.command_id, a.status, a.reason) for a in got] == [
        ("pf", CommandStatus.SUCCEEDED, "pf passed")
    ]
    # Finished inline, before execute() could wait: the ack is there at once.
    inline = CommandExecutor(
        api, [], relay=lambda _c: 0, on_ack=lambda _a: None,
        preflight=lambda c, finish: finish(False, "no sample"),
    )  # fmt: skip
    assert inline.execute(cmd(id="pf2", kind="run_preflight")).reason == "no sample"


def test_execute_gives_up_on_a_preflight_that_never_finishes() -> None:
    api = SimNvml(gpu_count=1)
    api.nvmlInit()
    finishes: list[Finish] = []
    acks: list[CommandAck] = []
    ex = CommandExecutor(
        api, [], relay=lambda _c: 0, on_ack=acks.append,
        preflight=lambda _c, finish: finishes.append(finish),
    )  # fmt: skip
    with pytest.raises(CommandTimeout, match=r"command pf \(run_preflight\) not finished"):
        ex.execute(cmd(id="pf", kind="run_preflight"), timeout_s=0.05)
    assert acks == []
    # The preflight still acks itself when it does finish, and a later execute sees that.
    finishes[0](True, "late")
    assert [a.reason for a in acks] == ["late"]
    assert ex.execute(cmd(id="pf", kind="run_preflight"), timeout_s=0.05).reason == "late"
    with pytest.raises(ValueError, match="timeout_s"):
        ex.execute(cmd(id="pf3", kind="run_preflight"), timeout_s=0)


def test_execute_gets_its_ack_even_once_it_is_no_longer_remembered() -> None:
    # The preflight finishes and then more than REMEMBERED_COMMANDS other commands are acked
    # before execute() waits: the ack is gone from those remembered, yet it reaches execute.
    api = SimNvml(gpu_count=1)
    api.nvmlInit()
    ex: CommandExecutor

    def preflight(command: RunPreflight, finish: Finish) -> None:
        finish(True, f"{command.id} passed")
        for i in range(REMEMBERED_COMMANDS + 1):
            ex.submit(cmd(id=f"j{i}", kind="job_checkpoint", job="a"))

    ex = CommandExecutor(api, [], relay=lambda _c: 1, on_ack=lambda _a: None, preflight=preflight)
    got: list[CommandAck] = []
    caller = threading.Thread(
        target=lambda: got.append(ex.execute(cmd(id="pf", kind="run_preflight"), timeout_s=10)),
        daemon=True,
    )
    caller.start()
    caller.join(10)
    assert not caller.is_alive()
    assert [(a.command_id, a.reason) for a in got] == [("pf", "pf passed")]
    assert ex._for_waiters == {} and ex._waiters == {}  # nothing kept once delivered
