"""The whole agent in-process against the fake controller: samples, urgency, commands."""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.daemon import Agent
from agents.errors import AgentConfigError, ListenError, SpoolError
from agents.settings import AgentSettings, load_settings
from tests import http_calls
from tests.agents.agents_testkit import TOKEN, FakeController, LocalClient, Running
from trainguard.wire import InflightCollective, JobRecords, Report, StepSummary


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tga-") as d:
        yield Path(d)


def settings(tmp_path: Path, sock_dir: Path, url: str, **kw: Any) -> AgentSettings:
    base: dict[str, Any] = {
        "controller_url": url,
        "token": TOKEN,
        "node_name": "node-1",
        "gpus": "sim:4",
        "sample_interval_s": 0.05,
        "report_interval_s": 1.0,
        "spool_dir": tmp_path / "spool",
        "socket_path": str(sock_dir / "agent.sock"),
        "metrics_port": 0,
        "backoff_max_s": 0.2,
        "powercap_dir": tmp_path / "no-powercap",
        "sysfs_root": tmp_path / "no-sys",
        "dev_dir": tmp_path / "no-dev",
    }
    base.update(kw)
    return load_settings(**base)


def all_samples(reports: list[Report]) -> list[float]:
    return [s.time_unix_s for r in reports for s in r.samples]


def test_reports_carry_every_sample_and_the_identity(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=0.3))
    taken: list[float] = []
    real_sample = agent.sample

    def counting_sample() -> Any:
        sample = real_sample()
        taken.append(sample.time_unix_s)
        return sample

    agent.sample = counting_sample  # type: ignore[method-assign]
    with Running(agent):
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 3)
    reports = agents_controller.state.ordered()
    assert [r.seq for r in reports] == list(range(len(reports)))
    first = reports[0]
    assert first.node.name == "node-1" and first.node.backend == "sim"
    assert len(first.node.gpus) == 4 and first.sample_interval_s == 0.05
    times = all_samples(reports)
    assert len(times) == len(set(times)) and times == sorted(times)
    sample = reports[1].samples[0]
    assert len(sample.gpus) == 4 and sample.node_power_source == "gpu_sum"
    assert sample.node_power_w == pytest.approx(sum(g.power_w or 0 for g in sample.gpus))
    # Clean stop: the last partial batch was sealed into the spool and, the controller being
    # up, delivered: every sample the agent took is at the server, once.
    assert agent.spool.pending() == []
    assert all_samples(agents_controller.state.ordered()) == taken


def test_an_xid_is_reported_at_once_not_at_the_interval(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    s = settings(
        tmp_path, sock_dir, agents_controller.url, report_interval_s=30.0,
        sim_faults=["kind=xid,code=79,gpu=3,at=0.5"],
    )  # fmt: skip
    agent = Agent(s)
    with Running(agent):
        agents_controller.wait_for(
            lambda: any(
                x.code == 79
                for r in agents_controller.state.ordered()
                for smp in r.samples
                for g in smp.gpus
                for x in g.xid_events
            ),
            timeout_s=10,
        )
        assert agent.stats.xid_total[(3, 79)] == 1
        # Well before report_interval_s (30 s) the XID report was out.
        port = agent.metrics_port
        text = http_calls.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'xid="79"' in text and "trainguard_gpu_power_watts" in text


def test_inflight_record_from_a_rank_triggers_an_urgent_report(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=30.0))
    with Running(agent):
        client = LocalClient(str(sock_dir / "agent.sock"))
        try:
            assert client.hello("train-a", rank=0).ok
            stuck = InflightCollective(
                job="train-a", rank=0, group="g0", op="all_reduce", seq=41, elapsed_s=12.0
            )
            assert client.records(JobRecords(inflight=[stuck])).ok
            agents_controller.wait_for(
                lambda: any(r.job.inflight for r in agents_controller.state.ordered()), 10
            )
        finally:
            client.close()


def _steps(rank: int, first: int, n: int) -> JobRecords:
    return JobRecords(
        steps=[
            StepSummary(
                job="train-a",
                rank=rank,
                world_size=2,
                step=first + i,
                step_time_s=0.07,
                compute_time_s=0.05,
                collective_wait_s=0.02,
            )
            for i in range(n)
        ]
    )


def test_step_summaries_go_out_early_once_a_rank_has_job_flush_steps_of_them(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    """The report timer is 30 s; step summaries of a job still reach the controller
    within the early-flush rule: fewer than ``job_flush_steps`` of one rank wait for the
    timer, that many go out (not before ``job_flush_min_interval_s`` after the last)."""
    agent = Agent(
        settings(
            tmp_path,
            sock_dir,
            agents_controller.url,
            report_interval_s=30.0,
            job_flush_steps=8,
            job_flush_min_interval_s=0.5,
        )
    )

    def delivered() -> list[int]:
        return [s.step for r in agents_controller.state.ordered() for s in r.job.steps]

    with Running(agent):
        ranks = [LocalClient(str(sock_dir / "agent.sock")) for _ in range(2)]
        try:
            assert all(c.hello("train-a", rank=r).ok for r, c in enumerate(ranks))
            # Seven steps of each of two ranks: 14 summaries, but no rank has 8.
            assert all(c.records(_steps(r, 0, 7)).ok for r, c in enumerate(ranks))
            threading.Event().wait(2.0)
            assert delivered() == []
            assert ranks[0].records(_steps(0, 7, 1)).ok  # rank 0's eighth
            agents_controller.wait_for(lambda: len(delivered()) == 15, 10)
            assert sorted(delivered()) == sorted([*range(8), *range(7)])
        finally:
            for c in ranks:
                c.close()


def test_commands_from_the_reply_are_executed_and_acked_in_a_later_report(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    agents_controller.queue_command(
        "node-1", {"id": "cmd-1", "kind": "set_power_limit", "gpu_index": 2, "limit_w": 300}
    )
    agents_controller.queue_command(
        "node-1", {"id": "cmd-2", "kind": "set_power_limit", "gpu_index": 2, "limit_w": 9000}
    )
    agents_controller.queue_command("node-1", {"id": "cmd-3", "kind": "job_stop", "job": "train-a"})
    # A command kind from a newer controller: refused alone, the report is still acknowledged.
    agents_controller.queue_command("node-1", {"id": "cmd-4", "kind": "reboot_node"})
    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=0.3))
    with Running(agent):

        def acks() -> dict[str, Any]:
            return {
                a.command_id: a for r in agents_controller.state.ordered() for a in r.command_acks
            }

        agents_controller.wait_for(lambda: len(acks()) == 4, timeout_s=10)
        agents_controller.wait_for(
            lambda: any(
                g.index == 2 and g.power_limit_w == 300.0
                for r in agents_controller.state.ordered()
                for s in r.samples
                for g in s.gpus
            )
        )
    got = acks()
    assert got["cmd-1"].status == "succeeded"
    assert got["cmd-2"].status == "failed" and "allowed range" in got["cmd-2"].reason
    assert got["cmd-3"].status == "failed" and "no rank of job train-a" in got["cmd-3"].reason
    assert got["cmd-4"].status == "failed" and "invalid reboot_node command" in got["cmd-4"].reason
    assert agents_controller.state.duplicates == 0  # no report was resent over it


def test_a_failing_tick_does_not_stop_the_agent(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=0.2))
    calls = {"n": 0}
    real = agent.sampler.sample

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("driver hiccup")
        return real()

    agent.sampler.sample = flaky  # type: ignore[method-assign]
    with Running(agent):
        agents_controller.wait_for(
            lambda: len(all_samples(agents_controller.state.ordered())) >= 10
        )
    assert calls["n"] >= 12


def test_a_fault_line_for_a_missing_gpu_costs_that_line_not_the_tick(
    tmp_path: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = tmp_path / "faults"
    agent = Agent(
        settings(
            tmp_path,
            sock_dir,
            "http://127.0.0.1:9",
            socket_path="",
            metrics_port=-1,
            sim_fault_file=faults,
        )
    )
    try:
        faults.write_text("kind=lost,gpu=99\nkind=thermal,gpu=2,at=0,duration=60\n")
        with caplog.at_level("WARNING"):
            sample = agent.sample()  # no ValueError out of the tick
        assert len(sample.gpus) == 4
        assert [(f.kind, f.gpu) for f in agent.backend.api.faults] == [("thermal", 2)]
        assert any("gpu 99 out of range (the node has 4)" in r.getMessage() for r in caplog.records)
    finally:
        agent.batch.close()
        agent.sampler.close()
        agent.backend.shutdown()


def test_settings_errors_are_one_line() -> None:
    with pytest.raises(AgentConfigError) as exc:
        load_settings(gpus="tpu:4", sample_interval_s=0, node_name="Node_1", metrics_port=70000)
    msg = str(exc.value)
    assert "\n" not in msg
    for field in ("gpus", "sample_interval_s", "node_name", "metrics_port"):
        assert field in msg
    with pytest.raises(AgentConfigError, match="report_interval_s"):
        load_settings(sample_interval_s=5, report_interval_s=1)
    with pytest.raises(AgentConfigError, match="controller_url is required"):
        Agent(load_settings(gpus="sim:1", controller_url=None))


def test_env_prefix_and_fault_list_from_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TRAINGUARD_AGENT_GPUS", "sim:3")
    monkeypatch.setenv("TRAINGUARD_AGENT_SIM_FAULTS", "kind=xid,code=79,gpu=2,at=1;kind=lost,gpu=0")
    monkeypatch.setenv("TRAINGUARD_AGENT_TOKEN", "s3cret-s3cret-s3cret")
    s = AgentSettings(node_name="n")
    assert s.gpus == "sim:3" and len(s.sim_faults) == 2
    assert "s3cret" not in repr(s) and s.spool_dir is not None and "agent-n" in str(s.spool_dir)


def test_unusable_spool_and_busy_metrics_port_are_one_line_errors(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SpoolError, match="is unusable") as exc:
        Agent(settings(tmp_path, sock_dir, agents_controller.url, spool_dir=blocker / "spool"))
    assert "\n" not in str(exc.value)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, metrics_port=port))
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}") as err:
            agent.start()
        assert err.value.exit_code == 2
        agent.stop()
    finally:
        busy.close()
    assert not (sock_dir / "agent.sock").exists()


def test_an_uncorrectable_ecc_event_asks_for_a_report_at_once(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    s = settings(
        tmp_path, sock_dir, agents_controller.url, report_interval_s=30.0,
        sim_faults=["kind=ecc,gpu=2,at=0.5,uncorrected=1", "kind=ecc,gpu=1,at=0.5,corrected=4"],
    )  # fmt: skip
    agent = Agent(s)
    reasons: list[str] = []
    real = agent.request_report

    def spy(why: str) -> None:
        reasons.append(why)
        real(why)

    agent.request_report = spy  # type: ignore[method-assign]
    with Running(agent):
        agents_controller.wait_for(
            lambda: "uncorrectable ECC error on GPU 2" in reasons and "XID 48 on GPU 2" in reasons,
            timeout_s=10,
        )
    # A corrected error is counted by the next sample, never an urgent report of its own.
    assert not any("GPU 1" in r for r in reasons)


def test_a_hung_gpu_does_not_stop_the_heartbeat(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    s = settings(
        tmp_path,
        sock_dir,
        agents_controller.url,
        report_interval_s=0.2,
        nvml_timeout_s=0.5,
        sim_faults=["kind=hang,gpu=1,at=0.3"],
    )
    agent = Agent(s)
    with Running(agent):
        agents_controller.wait_for(
            lambda: any(
                g.unknown for r in agents_controller.state.ordered() for x in r.samples
                for g in x.gpus
            )
            and len(agents_controller.state.reports) >= 6
        )  # fmt: skip
    reports = agents_controller.state.ordered()
    unknown = [g for r in reports for x in r.samples for g in x.gpus if g.unknown]
    assert {g.index for g in unknown} == {1} and "did not answer" in unknown[0].error
    events = [e for r in reports for x in r.samples for e in x.events]
    assert [(e.kind, e.gpu_index) for e in events] == [("gpu_unknown", 1)]
    last = [x for r in reports for x in r.samples][-1]
    assert [g.power_w is not None for g in last.gpus] == [True, False, True, True]


def test_a_gpu_that_hangs_while_the_agent_starts_does_not_hold_up_its_start(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    """Registering a GPU for XID events is an NVML call like any other: on a wedged GPU it
    hung ``Agent.start`` (the heartbeat never began; seen as a 300 s timeout of the test
    above on a loaded machine, where the start came after its hang's ``at=0.3``). It runs
    on a thread of its own now; the other GPUs still get registered."""
    from agents.gpu.faults import parse_fault_spec

    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=0.2))
    api = agent.backend.api
    api.inject(parse_fault_spec("kind=hang,gpu=1,at=0,duration=3600"))
    with Running(agent):
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 3)
        assert agent.xids is not None
        assert agent.xids.registered == [0]  # GPU 0 before the hung GPU 1, nothing after
    reports = agents_controller.state.ordered()
    unknown = {g.index for r in reports for x in r.samples for g in x.gpus if g.unknown}
    assert unknown == {1}


def test_metrics_name_the_node_and_the_pod_using_each_gpu(
    tmp_path: Path, sock_dir: Path, agents_controller: FakeController
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    agent = Agent(settings(tmp_path, sock_dir, agents_controller.url, report_interval_s=0.3))
    with Running(agent):
        client = LocalClient(str(sock_dir / "agent.sock"))
        hello = {"type": "hello", "job": "train-a", "rank": 0, "world_size": 2, "pid": 1,
                 "gpu_index": 1, "pod": "train-a-worker-0", "namespace": "ml"}  # fmt: skip
        assert client.send_json(hello).ok
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 1)
        text = http_calls.get(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5).text
        client.close()
    power = {
        s.labels["gpu"]: s.labels
        for f in text_string_to_metric_families(text)
        if f.name == "trainguard_gpu_power_watts"
        for s in f.samples
    }
    assert set(power) == {"0", "1", "2", "3"}
    assert all(labels["Hostname"] == "node-1" for labels in power.values())  # not the pod
    assert (power["1"]["pod"], power["1"]["namespace"]) == ("train-a-worker-0", "ml")
    assert (power["0"]["pod"], power["0"]["namespace"]) == ("", "")
