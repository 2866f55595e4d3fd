"""Leftovers of the agent's report budgets and damaged inputs (docs/agent.md, "Reports,
spool and journal"): hardware-event storms, the sample item cap, non-UTF-8 bond slaves and a
spool smaller than one report. Real parts: the Batch and its journal, the simulated NVML
backend, a sysfs tree laid out as the kernel does, the real Agent and its spool.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from agents.batch import MAX_SAMPLES, Batch, report_size
from agents.errors import AgentConfigError
from agents.nics import NicMonitor
from tests.agents.sysfs_tree import SysfsTree
from trainguard import wire
from trainguard.wire import HardwareEvent, JobRecords, NodeSample, Report, StepSummary


def _event(kind: str, t: float, **kw: Any) -> HardwareEvent:
    return HardwareEvent(kind=kind, time_unix_s=t, detail=f"{kind} at {t}", **kw)


def _batch(tmp_path: Path, **kw: Any) -> Batch:
    journal = tmp_path / "spool" / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    return Batch(journal, next_seq=1, **kw)


# --------------------------------------------------------------------------- sample item cap


def test_the_sample_item_cap_thins_evenly_and_keeps_the_incident_start(tmp_path: Path) -> None:
    """More samples than the wire's item cap (tiny samples, well under the byte budget, while
    no report can go): the cap used to drop the OLDEST sample, with its events, while the
    byte budget thins evenly. Now both thin: the first sample (an incident's start, with its
    event) stays, the samples left are evenly spaced, and the count fits the wire."""
    batch = _batch(tmp_path)
    start = _event("gpu_unreachable", 0.0, gpu_index=3)
    batch.add_sample(NodeSample(time_unix_s=0.0, events=[start]))
    for i in range(1, MAX_SAMPLES + 200):
        batch.add_sample(NodeSample(time_unix_s=float(i)))
    samples = batch.peek().samples
    assert len(samples) <= MAX_SAMPLES
    assert samples[0].time_unix_s == 0.0 and samples[0].events == [start]
    assert samples[-1].time_unix_s == float(MAX_SAMPLES + 199)
    gaps = {b.time_unix_s - a.time_unix_s for a, b in itertools.pairwise(samples[:-1])}
    assert gaps == {2.0}
    assert batch.thinned_samples_total == MAX_SAMPLES + 200 - len(samples)
    batch.close()


# --------------------------------------------------------------------------- spool vs report


def test_a_spool_smaller_than_one_report_of_the_node_is_refused_at_start(
    agent_factory: Any,
) -> None:
    """A 64-GPU node with the 64 KiB minimum spool: every report (about 64 KB of samples and
    the identity) is larger than the spool and would be set aside unsent, all data lost.
    The agent now refuses to start, in one line that names the floor."""
    with pytest.raises(AgentConfigError) as caught:
        agent_factory(gpus="sim:64", spool_max_bytes=64 * 1024)
    message = str(caught.value)
    assert "\n" not in message and "spool_max_bytes=65536 cannot hold one report" in message
    need = int(message.rsplit(" ", 1)[-1])
    assert 64 * 1024 < need < wire.MAX_REPORT_BYTES
    agent = agent_factory(gpus="sim:64", spool_max_bytes=need)  # the floor it names works
    agent.sample()
    seq = agent.flush()
    assert agent.spool.path_for(seq).stat().st_size <= need
    assert agent.spool.state.dropped_total == 0


def _steps(n: int) -> JobRecords:
    return JobRecords(
        steps=[
            StepSummary(
                job="train-a",
                rank=i % 8,
                world_size=8,
                step=i,
                step_time_s=1.0,
                compute_time_s=0.8,
                collective_wait_s=0.2,
            )
            for i in range(n)
        ]
    )


def test_job_records_follow_a_small_spool_and_never_sink_the_samples(agent_factory: Any) -> None:
    """A legal 64 KiB spool on a 4-GPU node: the job-record budget was fixed at 3/4 of the
    wire's 4 MiB, so 1,000 step summaries (about 150 KB) made a report larger than the spool,
    set aside unsent with the node's samples. Now the budget follows the spool: the records
    that do not fit are dropped and counted, the report (samples too) is spooled."""
    agent = agent_factory(spool_max_bytes=64 * 1024)
    agent.sample()
    records = _steps(1_000)
    agent.batch.add_records(records, report_size(records))
    agent.sample()
    seq = agent.flush()
    path = agent.spool.path_for(seq)
    assert path.exists() and path.stat().st_size <= 64 * 1024
    report = Report.model_validate_json(path.read_bytes())
    assert len(report.samples) == 2 and 0 < len(report.job.steps) < 1_000
    assert agent.batch.dropped_records_total == 1_000 - len(report.job.steps)
    assert agent.spool.state.dropped_total == 0


# --------------------------------------------------------------------------- event storms


def _storm(t: float) -> list[HardwareEvent]:
    """One tick of a storm on a 64-GPU, 256-port node: every NVLink flapping (down and up
    seen) and seven error counters rising on every port: 4,096 events, the wire's cap."""
    events = [
        _event(kind, t, gpu_index=gpu, port=link)
        for gpu in range(64)
        for link in range(18)
        for kind in ("nvlink_down", "nvlink_up")
    ]
    events += [
        _event(
            "nic_errors_rising",
            t,
            device=f"mlx5_{port // 2}",
            port=port % 2 + 1,
            counter=f"counter_{c}",
            delta=10 + c,
        )
        for port in range(256)
        for c in range(7)
    ]
    return events[:4_096]


def test_a_hardware_event_storm_keeps_the_gpu_loss_and_its_budget(tmp_path: Path) -> None:
    """A GPU turns unreachable, then link flaps and rising NIC counters come at the wire's
    4,096 events per tick while no report can go. Events had no budget of their own: each
    tick's 600 KB of events filled the report until thinning merged samples and cut the
    merged list's head, pushing the GPU's loss out. Now the report's events stay within
    their budget (the storm folded to the newest per subject and cut) and the loss is kept."""
    batch = _batch(tmp_path)
    batch.add_sample(NodeSample(time_unix_s=0.0))  # the first sample is never thinned
    lost = _event("gpu_unreachable", 1.0, gpu_index=7)
    batch.add_sample(NodeSample(time_unix_s=1.0, events=[lost]))
    for t in range(2, 14):
        batch.add_sample(NodeSample(time_unix_s=float(t), events=_storm(float(t))))
    events = [e for s in batch.peek().samples for e in s.events]
    assert lost in events
    assert sum(report_size(e) + 1 for e in events) <= batch.event_budget_bytes
    assert batch.dropped_events_total >= 12 * 4_096 - len(events)
    batch.close()


def test_a_tick_past_the_event_cap_keeps_its_gpu_loss(agent_factory: Any) -> None:
    """The tick's events are listed GPU first, then NICs and bonds: cutting the list to the
    wire's 4,096 kept its tail, so a NIC storm dropped the GPU's ``gpu_unknown`` of the same
    tick from the sample. Now the list is folded and the loss kept."""
    agent = agent_factory()
    agent.sample()
    agent.sampler.events.append(_event("gpu_unknown", 1.0, gpu_index=1))
    storm = _storm(1.0)
    agent.nics.sample = lambda _now: ([], storm)
    sample = agent.sample()
    assert any(e.kind == "gpu_unknown" and e.gpu_index == 1 for e in sample.events)
    assert len(sample.events) <= 4_096


# --------------------------------------------------------------------------- damaged names


def test_a_non_utf8_bond_slave_costs_neither_the_bond_nor_its_members(tmp_path: Path) -> None:
    """Linux lets an interface name hold any byte but ``/``, ``:`` and white space. One
    slave named ``eth\\xff1`` made the bond's ``slaves`` file unreadable as text: the bond
    was reported with no members, and its healthy members going down was never an event.
    Now every member is reported, the odd one spelled ``\\xff``, and its flap is an event."""
    tree = SysfsTree(tmp_path / "sys").build()
    net = tree.root / "class" / "net"
    odd = os.fsdecode(b"eth\xff1")
    iface = tree.root / "devices" / "virtual" / "net" / odd
    (iface / "bonding_slave").mkdir(parents=True)
    (iface / "operstate").write_text("up\n")
    (iface / "bonding_slave" / "mii_status").write_text("up\n")
    (net / odd).symlink_to(iface)
    (net / "bond0" / "bonding" / "slaves").write_bytes(b"eno1 eth\xff1 eno2\n")
    monitor = NicMonitor(tree.root)
    bonds, _ = monitor.bonds(1.0)
    assert [m.name for m in bonds[0].members] == ["eno1", "eth\\xff1", "eno2"]
    tree.set_member("eno2", "down", 1)
    (iface / "bonding_slave" / "mii_status").write_text("down\n")
    bonds, events = monitor.bonds(2.0)
    assert [m.mii_status for m in bonds[0].members] == ["up", "down", "down"]
    assert [e.detail for e in events] == ["eth\\xff1 of bond0 is down", "eno2 of bond0 is down"]
    NodeSample(time_unix_s=2.0, bonds=bonds, events=events)  # the wire takes them
