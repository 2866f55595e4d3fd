"""A node agent's report stays under its cap when every part of it is full at once.

Each part of a report had a budget of its own, each sized alone: job records 3/4 of the cap,
XIDs 1/8, hardware events 1/16, samples thinned within 7/8 (never below one), command acks
2,048 of any size, the node's identity about 1/8. A node in a storm (XIDs on every GPU, 256
ports flapping and counting errors, a job flooding step summaries, acks piling up) filled
them all at once, and the report passed the cap: the controller refuses such a report whole
(or a small spool sets it aside), so the node went dark exactly when it mattered. The parts
now share the contents' budget in a fixed order (``agents.batch``). Real parts: the
simulated NVML backend, a sysfs tree laid out as the kernel does, the real Agent, its batch
and spool; each part is filled through the batch as the agent's ticks would fill it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agents.batch import MAX_ACKS, MAX_STEPS, Batch, report_size
from agents.daemon import Agent
from tests.agents.test_report_budget import _big_node
from trainguard.wire import (
    MAX_REPORT_BYTES,
    CommandAck,
    CommandStatus,
    GpuSample,
    HardwareEvent,
    JobRecords,
    NicPortSample,
    NodeSample,
    Report,
    StepSummary,
    XidEvent,
)

#: Storm ticks before the report is sealed (the reporter not keeping up).
TICKS = 12
#: Counters a port's error storm rises on: with 256 ports, the wire's 4,096 events a tick,
#: each its own subject (folding cannot shrink them below the events' budget).
COUNTERS = [f"port_err_{i}" for i in range(16)]
XID_DETAIL = "XID 13 reported by NVML; 1500 XID 13 on this GPU since the last sample"


def _xids(batch: Any, sample: NodeSample, t: float) -> NodeSample:
    """Every GPU with as many XIDs as the watcher's drain would list (``xid_limit``, at
    least 8 a GPU, so a long storm reaches the XIDs' hard cap); GPU 0's first is a 79."""
    limit = batch.xid_limit(len(sample.gpus))
    gpus = []
    for g in sample.gpus:
        codes = [79 if g.index == 0 and i == 0 else 13 + 18 * (i % 2) for i in range(limit)]
        events = [
            XidEvent(code=c, time_unix_s=t + i / 1e4, gpu_index=g.index, detail=XID_DETAIL)
            for i, c in enumerate(codes)
        ]
        gpus.append(g.model_copy(update={"xid_events": events}))
    return sample.model_copy(update={"gpus": gpus})


def _events(t: float) -> list[HardwareEvent]:
    """A tick of 256 ports' error counters rising: the wire's 4,096 events, each its own
    subject (also on a node whose ports the test leaves out: the wire takes them)."""
    return [
        HardwareEvent(
            kind="nic_errors_rising",
            time_unix_s=t,
            device=f"mlx5_{p % 2}",
            port=p // 2 + 1,
            counter=counter,
            delta=1_000_000 + p,
            detail=f"{counter} rose on mlx5_{p % 2}/{p // 2 + 1}",
        )
        for p in range(256)
        for counter in COUNTERS
    ][:4_096]


def _flood(records: int) -> JobRecords:
    """A job flooding step summaries, each as large as its fields allow (role, group)."""
    return JobRecords(
        steps=[
            StepSummary(
                job="flood",
                rank=i % 4096,
                world_size=4096,
                step=i // 4096,
                step_time_s=1.25,
                compute_time_s=0.75,
                collective_wait_s=0.5,
                nonfinite_first_group="g" * 128,
                role="r" * 128,
            )
            for i in range(records)
        ]
    )


def _storm(agent: Any, template: NodeSample) -> float:
    """Fill every part of the batch to its own budget; returns the newest sample's time."""
    batch = agent.batch
    t = template.time_unix_s
    for tick in range(TICKS):
        t += 1
        sample = _xids(batch, template.model_copy(update={"time_unix_s": t}), t)
        events = _events(t) if tick < 2 else []
        batch.add_sample(sample.model_copy(update={"events": events}))
    flood = _flood(MAX_STEPS)
    batch.add_records(flood, report_size(flood))
    for i in range(MAX_ACKS):
        ack = CommandAck(command_id=f"cmd-{i}", status=CommandStatus.FAILED, reason="x" * 1024)
        batch.add_ack(ack)
    # The newest tick: a GPU falls off the bus amid the storm.
    t += 1
    lost = HardwareEvent(kind="gpu_unreachable", time_unix_s=t, gpu_index=7)
    sample = _xids(batch, template.model_copy(update={"time_unix_s": t}), t)
    batch.add_sample(sample.model_copy(update={"events": [lost, *_events(t)[1:]]}))
    return t


def _sealed(agent: Agent, seq: int) -> bytes:
    """The report as the daemon would send it: spooled, or set aside as larger than a small
    spool (which sends nothing of it)."""
    path = agent.spool.path_for(seq)
    if path.exists():
        return path.read_bytes()
    return (agent.spool.rejected_dir / path.name).read_bytes()


def _parts(data: bytes) -> dict[str, int]:
    """Bytes of each part of a report, as serialized: to say where they went."""
    r = Report.model_validate_json(data)
    xids = sum(report_size(e) + 1 for s in r.samples for g in s.gpus for e in g.xid_events)
    events = sum(report_size(e) + 1 for s in r.samples for e in s.events)
    samples = sum(report_size(s) + 1 for s in r.samples)
    return {
        "report": len(data),
        "identity": report_size(r.node),
        "samples": samples - xids - events,
        "xids": xids,
        "events": events,
        "records": report_size(r.job),
        "acks": sum(report_size(a) + 1 for a in r.command_acks),
        "sample_count": len(r.samples),
    }


@pytest.mark.parametrize(
    ("gpus", "ports", "spool_max_bytes"),
    [(64, 256, 256 * 1024 * 1024), (8, 0, 64 * 1024)],
    ids=["64-gpu-256-port-4MiB", "8-gpu-64KiB-spool"],
)
def test_a_storm_filling_every_budget_at_once_keeps_the_report_under_the_cap(
    agent_factory: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    gpus: int,
    ports: int,
    spool_max_bytes: int,
) -> None:
    if ports:
        _big_node(tmp_path)
    agent = agent_factory(
        gpus=f"sim:{gpus}",
        nvml_timeout_s=30,
        sysfs_root=tmp_path / "sys",
        report_interval_s=300,
        sample_interval_s=1,
        spool_max_bytes=spool_max_bytes,
    )
    cap = min(MAX_REPORT_BYTES, spool_max_bytes)
    template = agent.sample()
    assert len(template.gpus) == gpus and len(template.nics) == ports
    agent.batch.reset(agent.spool.next_seq)  # the storm's items only
    caplog.set_level(logging.CRITICAL, logger="agents.batch")  # a line per dropped ack
    newest = _storm(agent, template)
    batch = agent.batch
    # Every part was filled past its own budget, so each had to give some up.
    assert batch.dropped_records_total and batch.dropped_xids_total
    assert batch.dropped_events_total
    seq = agent.flush()
    data = _sealed(agent, seq)
    parts = _parts(data)
    assert len(data) <= cap, parts
    assert agent.spool.state.dropped_total == 0, parts  # spooled, not set aside
    report = Report.model_validate_json(data)  # the controller's model takes it
    # What the controller acts on is in it: the newest sample, the GPU's loss, the XID 79.
    assert report.samples[-1].time_unix_s == newest
    lost = [(e.kind, e.gpu_index) for s in report.samples for e in s.events]
    assert ("gpu_unreachable", 7) in lost
    assert 79 in [e.code for s in report.samples for e in s.gpus[0].xid_events]
    # The records gave way, not the acks (which the controller needs to close its loop).
    assert report.job.steps and report.command_acks


def test_a_sample_near_the_cap_gives_up_its_storm_but_not_its_losses(tmp_path: Path) -> None:
    """The last resort, on a spool near its floor: one sample's gauges nearly fill the
    contents' budget, so its XIDs and hardware events, each within its own budget, pass it
    together. The flaps go, then the XIDs but the newest of each code per GPU (counted);
    the GPU's loss and the fatal XID stay, and the contents fit."""
    batch = Batch(tmp_path, next_seq=0, max_report_bytes=64 * 1024)
    port = NicPortSample(
        device="mlx5_0",
        port=1,
        state="4: ACTIVE",
        phys_state="5: LinkUp",
        counters=dict.fromkeys(COUNTERS, 2**40),
    )
    ports = (batch.budget_bytes - 5_000) // (report_size(port) + 1)
    nics = [port.model_copy(update={"port": p}) for p in range(1, ports + 1)]
    gpus = [
        GpuSample(
            index=g,
            xid_events=[
                XidEvent(code=79 if i == 0 else 13, time_unix_s=1 + i / 100, detail=XID_DETAIL)
                for i in range(8)
            ],
        )
        for g in range(8)
    ]
    lost = HardwareEvent(kind="gpu_unreachable", time_unix_s=1.0, gpu_index=7)
    sample = NodeSample(time_unix_s=1.0, nics=nics, gpus=gpus, events=[lost, *_events(1.0)[1:]])
    batch.add_sample(sample)
    (kept,) = batch.peek().samples
    assert report_size(kept) + 1 <= batch.budget_bytes
    assert kept.events == [lost] and batch.dropped_events_total > 0
    assert all([e.code for e in g.xid_events] == [79, 13] for g in kept.gpus)
    assert batch.dropped_xids_total == 8 * 6
    assert kept.nics == nics  # the gauges stay
    batch.close()
