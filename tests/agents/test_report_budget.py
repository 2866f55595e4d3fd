"""The node agent's report stays under the wire's cap whatever the legal settings.

A 64-GPU node's sample is about 64 KB, a 256-port NIC sample adds more: 300 of them
(``report_interval_s=300``, ``sample_interval_s=1``) used to make one report of tens of MB,
which the controller refuses whole (``MAX_REPORT_BYTES``), losing every sample in it. The
batch now asks for an early report past its flush size and, when no report can go meanwhile
(or a journal is replayed after a restart), thins older samples evenly, never the newest.
Real parts: the simulated NVML backend, a sysfs tree laid out as the kernel does, the real
Agent, its spool and journal, and a real HTTP controller.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest

from agents.batch import Batch
from agents.metrics import AgentCollector
from tests.agents.agents_testkit import FakeController, Running
from tests.agents.sysfs_tree import NICS, SysfsTree
from trainguard.wire import MAX_REPORT_BYTES, HardwareEvent, NodeSample, Report, XidEvent

#: 128 ports on each of the tree's two cards: the wire's 256 ports per sample.
PORTS_PER_NIC = 128
#: Samples a 300 s report of 1 s samples would hold.
SAMPLES = 300
THINNING = "older samples thinned evenly"


def _big_node(tmp_path: Path) -> Path:
    tree = SysfsTree(tmp_path / "sys").build()
    for name in NICS:
        for port in range(2, PORTS_PER_NIC + 1):
            tree.set_port(name, port, state="4: ACTIVE", phys_state="5: LinkUp")
            for counter in ("symbol_error", "port_rcv_errors", "link_downed", "port_xmit_data"):
                tree.set_counter(name, port, counter, 2**40 + port)
    return tree.root


def _fill(agent: Any, first: NodeSample, count: int) -> list[bool]:
    """``count`` samples as the 1 s ticks of a 300 s interval before ``first`` would add
    them, no report sealed meanwhile (the reporter not keeping up); the third carries an XID
    and a hardware event. Returns what each add said about reporting early."""
    early = []
    for i in range(count):
        update: dict[str, Any] = {"time_unix_s": first.time_unix_s - count + i}
        if i == 2:
            gpus = list(first.gpus)
            xid = XidEvent(code=79, time_unix_s=update["time_unix_s"], gpu_index=5)
            gpus[5] = gpus[5].model_copy(update={"xid_events": [xid]})
            down = HardwareEvent(kind="nic_port_down", time_unix_s=update["time_unix_s"])
            update |= {"gpus": gpus, "events": [down]}
        early.append(agent.batch.add_sample(first.model_copy(update=update)))
    return early


def _spooled(agent: Any, seq: int) -> tuple[int, Report]:
    data = agent.spool.path_for(seq).read_bytes()
    return len(data), Report.model_validate_json(data)


def _check_thinned(report: Report, newest: NodeSample) -> None:
    times = [s.time_unix_s for s in report.samples]
    assert times[-1] == newest.time_unix_s  # the newest is never lost
    gaps = {b - a for a, b in itertools.pairwise(times[:-1])}
    assert len(gaps) == 1 and gaps.pop() > 1  # the older ones evenly spaced
    # The XID and the port event of a sample left out ride in the next one kept.
    assert [e.code for s in report.samples for e in s.gpus[5].xid_events] == [79]
    assert [e.kind for s in report.samples for e in s.events] == ["nic_port_down"]


def _big_agent(agent_factory: Any, tmp_path: Path) -> Any:
    return agent_factory(
        gpus="sim:64",
        nvml_timeout_s=30,
        sysfs_root=tmp_path / "sys",
        report_interval_s=300,
        sample_interval_s=1,
    )


def test_a_300s_report_of_a_64_gpu_256_port_node_stays_under_the_cap(
    agent_factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _big_node(tmp_path)
    agent = _big_agent(agent_factory, tmp_path)
    template = agent.sample()
    assert len(template.gpus) == 64 and len(template.nics) == 256
    agent.batch.reset(agent.spool.next_seq)  # the test's samples only
    with caplog.at_level(logging.INFO, logger="agents"):
        early = _fill(agent, template, SAMPLES - 1)
        # The 300th through the agent's own tick: the big batch asks for a report now.
        agent._urgent.clear()
        newest = agent.sample()
        assert agent._urgent.is_set()
        seq = agent.flush()
    assert early[0] is False and True in early
    size, report = _spooled(agent, seq)
    assert size < MAX_REPORT_BYTES and len(report.samples) < SAMPLES
    _check_thinned(report, newest)
    thinned = agent.batch.thinned_samples_total
    assert thinned == SAMPLES - len(report.samples)
    assert sum(THINNING in r.getMessage() for r in caplog.records) == 1
    metric = {
        m.name: m.samples[0].value
        for m in AgentCollector(agent.metrics_source).collect()
        if m.name == "trainguard_agent_samples_thinned"
    }
    assert metric == {"trainguard_agent_samples_thinned": thinned}


def test_a_journal_replayed_after_a_restart_makes_a_report_under_the_cap(
    agent_factory: Any, tmp_path: Path
) -> None:
    """The agent dies with 300 big samples journaled (the controller was away and the spool
    failing, say): the restarted agent's first report must fit too, the newest sample in it.
    Without the 256 ports (64 KB a sample, 19 MB in all): a cheaper journal, as far past the
    cap."""
    agent = _big_agent(agent_factory, tmp_path)
    template = agent.sample()
    agent.batch.reset(agent.spool.next_seq)
    _fill(agent, template, SAMPLES - 1)
    agent.batch.add_sample(template)
    agent.batch.close()  # killed: the journal holds every sample it took
    restarted = Batch(
        agent.spool.journal_dir,
        next_seq=agent.spool.next_seq,
        quarantine_dir=agent.spool.quarantine_dir,
    )
    agent.batch = restarted  # the restarted agent's batch over the same spool
    seq = agent.flush()
    size, report = _spooled(agent, seq)
    assert size < MAX_REPORT_BYTES
    _check_thinned(report, template)


def test_a_long_report_interval_reports_early_and_loses_no_sample(
    agent_factory: Any, agents_controller: FakeController
) -> None:
    """A spool of 64 KiB (legal) cannot hold a 300 s report of even 4 GPUs: the batch's cap
    follows the spool, so reports go out early, each one whole, no sample thinned."""
    agent = agent_factory(
        controller_url=agents_controller.url,
        report_interval_s=300,
        sample_interval_s=0.02,
        spool_max_bytes=64 * 1024,
    )
    with Running(agent):
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 3)
    reports = agents_controller.state.ordered()
    assert agent.batch.thinned_samples_total == 0 and agent.spool.state.dropped_total == 0
    assert all(len(r.model_dump_json(exclude_none=True)) <= 64 * 1024 for r in reports)
    times = [s.time_unix_s for r in reports for s in r.samples]
    assert len(times) > 10 and times == sorted(times)
    assert len(reports[0].samples) > 1
