"""Damaged inputs the node agent reads: each costs its own field, never the GPU samples or
the agent's start.

RAPL counters that run backwards or "wrap" into a 262 kW spike, an InfiniBand ``rate`` file
with a garbled number, a token file with a line break inside, a journal entry that cannot
be read, a labels setting that is not JSON. Sysfs is a fake tree in ``tmp_path``
(``sysfs_tree``); start-up behaviour is checked on a real agent process.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.batch import Batch
from agents.errors import AgentConfigError
from agents.nics import NicMonitor, parse_rate_gbps
from agents.node_power import NodePowerSampler, RaplReader
from agents.reporter import InvalidTokenError, Reporter, read_token_file
from agents.settings import load_settings
from agents.spool import Spool
from agents.stats import AgentStats
from tests.agents.agents_testkit import TOKEN, FakeController
from tests.agents.sysfs_tree import SysfsTree
from tests.agents.test_spool import builder
from trainguard.wire import BondSample, GpuSample, NodeSample

ROOT = Path(__file__).resolve().parents[2]
SECRET = "agentagentagentagentagent"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def rapl_zone(root: Path, energy_uj: int, max_uj: int) -> Path:
    path = root / "intel-rapl:0"
    path.mkdir(parents=True)
    (path / "name").write_text("package-0\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def set_energy(zone: Path, energy_uj: int) -> None:
    (zone / "energy_uj").write_text(f"{energy_uj}\n")


def gpu(power_w: float) -> GpuSample:
    return GpuSample(index=0, power_w=power_w)


def warnings_from(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= 30]


# ------------------------------------------------------------------ RAPL


@pytest.mark.parametrize("max_uj", [0, -7])
def test_a_backwards_counter_without_a_range_falls_back_to_the_gpu_sum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, max_uj: int
) -> None:
    zone = rapl_zone(tmp_path, 900_000_000_000, max_uj)
    clock = Clock()
    sampler = NodePowerSampler(RaplReader(tmp_path, clock=clock))
    sampler.node_power([gpu(300.0)])
    figures = []
    for step in range(1, 4):
        clock.t += 1.0
        set_energy(zone, 900_000_000_000 - step * 1_000_000_000)  # backwards, no range
        figures.append(sampler.node_power([gpu(300.0)]))
    assert figures == [(300.0, "gpu_sum")] * 3  # was (-699.0, "rapl"): the sample failed
    warned = warnings_from(caplog, "agents.node_power")
    assert len(warned) == 1 and "cannot explain it as a wrap" in warned[0]


def test_a_one_microjoule_step_back_is_not_a_262_kilowatt_spike(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zone = rapl_zone(tmp_path, 5_000_000, 262_143_328_850)
    clock = Clock()
    sampler = NodePowerSampler(RaplReader(tmp_path, clock=clock))
    sampler.node_power([gpu(100.0)])
    clock.t += 1.0
    set_energy(zone, 4_999_999)
    assert sampler.node_power([gpu(100.0)]) == (100.0, "gpu_sum")  # was 262,243 W
    assert "more than" in warnings_from(caplog, "agents.node_power")[0]
    # The counter goes on normally: the next interval is a real figure again.
    clock.t += 1.0
    set_energy(zone, 4_999_999 + 150_000_000)
    watts, source = sampler.node_power([gpu(100.0)])
    assert watts == pytest.approx(250.0) and source == "rapl"


def test_a_counter_past_its_own_range_is_no_wrap(tmp_path: Path) -> None:
    zone = rapl_zone(tmp_path, 10**15, 100)
    clock = Clock()
    rapl = RaplReader(tmp_path, clock=clock)
    rapl.read_w()
    clock.t += 1.0
    set_energy(zone, 10**15 - 5)
    assert rapl.read_w() is None  # was 1e-4 W "after a wrap" of a 100 µJ range


def test_a_negative_counter_gives_no_figure(tmp_path: Path) -> None:
    zone = rapl_zone(tmp_path, 1_000, 262_143_328_850)
    clock = Clock()
    rapl = RaplReader(tmp_path, clock=clock)
    rapl.read_w()
    clock.t += 1.0
    set_energy(zone, -5_000)
    assert rapl.read_w() is None


# ------------------------------------------------------------------ the agent's tick


def test_a_backwards_rapl_counter_does_not_sink_the_gpu_samples(
    tmp_path: Path, agent_factory: Any
) -> None:
    powercap = tmp_path / "powercap"
    zone = rapl_zone(powercap, 900_000_000_000, 0)
    agent = agent_factory(gpus="sim:2", powercap_dir=powercap)
    agent.sample()
    set_energy(zone, 800_000_000_000)
    sample = agent.sample()  # raised ValidationError: node_power_w=-99,999.x
    assert len(sample.gpus) == 2 and sample.node_power_source == "gpu_sum"
    assert len(agent.batch.peek().samples) == 2


def test_a_refused_field_or_a_failing_reader_costs_only_its_part(
    agent_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    agent = agent_factory(gpus="sim:2")
    monkeypatch.setattr(agent.node_power, "node_power", lambda _g: (-4999.0, "rapl"))

    def broken(_now: float) -> Any:
        raise RuntimeError("sysfs went away")

    monkeypatch.setattr(agent.nics, "bonds", broken)
    samples = [agent.sample() for _ in range(3)]
    for sample in samples:
        assert len(sample.gpus) == 2
        assert sample.node_power_w is None and sample.node_power_source == "none"
        assert sample.bonds == []
    warned = warnings_from(caplog, "agents.daemon")
    assert len([w for w in warned if w.startswith("bonds unreadable")]) == 1  # once, not per tick
    assert len([w for w in warned if "node_power_w" in w]) == 1


def test_more_ports_than_the_wire_takes_are_capped_not_lost(
    agent_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = agent_factory(gpus="sim:2")
    monkeypatch.setattr(
        agent.nics, "bonds", lambda _now: ([BondSample(name=f"b{i}") for i in range(100)], [])
    )
    sample = agent.sample()
    assert len(sample.gpus) == 2 and len(sample.bonds) == 64


# ------------------------------------------------------------------ NICs


@pytest.mark.parametrize("rate", ["1.2.3 Gb/sec", ". Gb/sec", "9" * 400 + " Gb/sec", "fast"])
def test_a_garbled_rate_costs_the_rate_not_the_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, rate: str
) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    (tree.port_dir("mlx5_0", 1) / "rate").write_text(rate + "\n")
    monitor = NicMonitor(tmp_path / "sys")
    for now in (1.0, 2.0):
        ports, _ = monitor.sample(now)  # raised ValueError from float("1.2.3")
        by_device = {p.device: p for p in ports}
        assert by_device["mlx5_0"].rate_gbps is None and by_device["mlx5_0"].state == "ACTIVE"
        assert by_device["mlx5_1"].rate_gbps == 400.0
    warned = warnings_from(caplog, "agents.nics")
    assert len(warned) == 1 and "rate" in warned[0]


def test_real_rates_still_parse() -> None:
    assert parse_rate_gbps("400 Gb/sec (4X NDR)") == 400.0
    assert parse_rate_gbps("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_rate_gbps("53.125 Gb/sec (1X HDR)") == 53.125
    assert parse_rate_gbps("") is None and parse_rate_gbps(None) is None


def test_a_port_number_or_numa_node_past_the_wire_costs_only_that(tmp_path: Path) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    tree.set_port("mlx5_0", 99999999, state="4: ACTIVE", phys_state="5: LinkUp")
    numa = tmp_path / "sys" / "class" / "infiniband" / "mlx5_1" / "device" / "numa_node"
    numa.write_text("-7\n")
    monitor = NicMonitor(tmp_path / "sys")
    ports, _ = monitor.sample(1.0)  # port 99999999 failed NicPortSample validation
    assert sorted((p.device, p.port) for p in ports) == [("mlx5_0", 1), ("mlx5_1", 1)]
    inventory = {(n.device, n.port): n for n in monitor.inventory({0: "00000000:18:00.0"})}
    assert inventory[("mlx5_1", 1)].numa_node is None  # NicInfo refused -7 at start


def test_a_garbled_rate_leaves_the_agents_samples_whole(tmp_path: Path, agent_factory: Any) -> None:
    tree = SysfsTree(tmp_path / "sys").build()
    (tree.port_dir("mlx5_0", 1) / "rate").write_text("1.2.3 Gb/sec\n")
    agent = agent_factory(gpus="sim:2", sysfs_root=tmp_path / "sys")
    sample = agent.sample()
    assert len(sample.gpus) == 2 and len(sample.nics) == 2


# ------------------------------------------------------------------ token


def test_a_token_file_with_a_line_break_inside_is_refused_without_the_secret(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tok"
    path.write_text(f"{SECRET}\ngarbage\n")
    with pytest.raises(InvalidTokenError) as caught:
        read_token_file(path)
    assert SECRET not in str(caught.value) and "garbage" not in str(caught.value)
    assert "no spaces or line breaks inside it" in str(caught.value)
    path.write_text(f"  {SECRET}\n")  # surrounding whitespace is fine
    assert read_token_file(path) == SECRET


class Capture:
    def __init__(self, error: Exception | None = None) -> None:
        self.auth: list[str | None] = []
        self.error = error

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.error is not None:
            raise self.error
        self.auth.append(request.headers.get("authorization"))
        return httpx.Response(503, json={"detail": "busy"})


def reporter(tmp_path: Path, transport: Capture, **kw: Any) -> Reporter:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    spool.append(builder(spool))
    return Reporter(
        spool,
        controller_url="http://ctl:1",
        stats=AgentStats(),
        on_reply=lambda _r: None,
        transport=httpx.MockTransport(transport),
        **kw,
    )


def test_a_rotated_token_file_with_a_line_break_keeps_the_last_good_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tok"
    path.write_text("good-token\n")
    capture = Capture()
    rep = reporter(tmp_path, capture, token=None, token_file=path)
    rep.send_oldest()
    path.write_text(f"{SECRET}\ngarbage\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within one mtime tick
    rep.send_oldest()
    rep.send_oldest()
    assert capture.auth == ["Bearer good-token"] * 3
    errors = [r.fields["error"] for r in caplog.records if hasattr(r, "fields")]
    assert errors == [  # once for this version of the file, not once per request
        f"token_file {path}: invalid token: it may hold only visible ASCII characters, "
        "no spaces or line breaks inside it"
    ]
    assert SECRET not in caplog.text


def test_a_delivery_error_that_quotes_the_header_is_logged_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    error = httpx.LocalProtocolError(f"Illegal header value b'Bearer {SECRET}\\ngarbage'")
    rep = reporter(tmp_path, Capture(error), token=SECRET)
    assert rep.send_oldest() == "retry"
    assert "report delivery failed" in caplog.text
    assert SECRET not in caplog.text and "controller unreachable" not in caplog.text


def test_a_token_setting_with_a_line_break_is_refused() -> None:
    with pytest.raises(AgentConfigError) as caught:
        load_settings(controller_url="http://c:1", token=f"{SECRET}\ngarbage")
    assert SECRET not in str(caught.value) and "line breaks" in str(caught.value)
    assert load_settings(controller_url="http://c:1", token=f"{SECRET}\n").token is not None


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
@pytest.mark.parametrize("foreground", ["--foreground", "--no-foreground"])
def test_the_agent_refuses_a_token_file_with_a_line_break_at_start(
    tmp_path: Path, foreground: str
) -> None:
    path = tmp_path / "tok"
    path.write_text(f"{SECRET}\ngarbage\n")
    result = subprocess.run(
        [sys.executable, "-m", "agents", "--metrics-port", "-1", "--socket-path", "",
         "--gpus", "sim:1", "--controller", "http://127.0.0.1:9", foreground,
         "--spool-dir", str(tmp_path / "spool"), "--token-file", str(path)],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"python -m agents: error: token_file {path}: invalid token: it may hold only "
        "visible ASCII characters, no spaces or line breaks inside it"
    ]


# ------------------------------------------------------------------ journal


def test_a_directory_in_the_journal_is_quarantined_not_fatal(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    (journal / "pending-000000000050.jsonl").mkdir(parents=True)
    (journal / "pending-000000000007.jsonl").mkdir()  # the seq being opened now
    (journal / "pending-000000000003.jsonl").mkdir()  # already spooled: to delete
    batch = Batch(journal, next_seq=7)  # raised IsADirectoryError
    batch.add_sample(NodeSample(time_unix_s=1.0))
    batch.close()
    quarantined = sorted(p.name.rsplit(".", 1)[0] for p in (tmp_path / "quarantine").iterdir())
    assert quarantined == [f"pending-{n:012d}.jsonl" for n in (3, 7, 50)]
    assert (journal / "pending-000000000007.jsonl").read_text().count("\n") == 1


def test_a_fifo_or_dangling_link_in_the_journal_does_not_block_the_start(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    os.mkfifo(journal / "pending-000000000004.jsonl")  # the seq being opened now
    os.mkfifo(journal / "pending-000000000008.jsonl")  # to replay
    (journal / "pending-000000000009.jsonl").symlink_to(tmp_path / "nowhere")
    built: list[Batch] = []
    # Opening or reading a FIFO blocks until a writer comes: on a thread, so a regression
    # fails this test instead of hanging the run.
    thread = threading.Thread(target=lambda: built.append(Batch(journal, next_seq=4)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert built, "Batch() blocked on a FIFO in the journal"
    built[0].close()
    quarantined = sorted(p.name.rsplit(".", 1)[0] for p in (tmp_path / "quarantine").iterdir())
    assert quarantined == [f"pending-{n:012d}.jsonl" for n in (4, 8, 9)]


def test_an_unreadable_journal_file_is_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    bad = journal / "pending-000000000009.jsonl"
    bad.write_text('{"t":"sample","v":{"time_unix_s":1.0}}\n')
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kw: Any) -> str:
        if self.name == bad.name:
            raise OSError(errno.EIO, "Input/output error")
        return real(self, *args, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    batch = Batch(journal, next_seq=9, quarantine_dir=tmp_path / "q")
    batch.close()
    assert [p.name.rsplit(".", 1)[0] for p in (tmp_path / "q").iterdir()] == [bad.name]


@pytest.mark.slow  # spawns the agent in a fresh interpreter
def test_the_agent_starts_past_a_damaged_journal(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = tmp_path / "spool"
    (spool / "journal" / "pending-000000000050.jsonl").mkdir(parents=True)
    log = tmp_path / "agent.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agents", "--controller", agents_controller.url,
         "--token", TOKEN, "--node-name", "n1", "--gpus", "sim:1", "--sample-interval", "0.05",
         "--report-interval", "0.2", "--spool-dir", str(spool), "--socket-path", "",
         "--metrics-port", "-1", "--powercap-dir", str(tmp_path / "none")],
        cwd=ROOT, env=clean_env(), stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) >= 1, 30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
    assert rc == 0, log.read_text()[-3000:]  # was 1 on every start: a crash loop
    assert "quarantined pending-000000000050.jsonl" in log.read_text()
    assert agents_controller.state.ordered()[0].samples


# ------------------------------------------------------------------ settings


@pytest.mark.slow  # spawns the CLI in a fresh interpreter
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("{{{", "labels: TRAINGUARD_AGENT_LABELS is not valid JSON (Expecting property name"),
        ("[1]", 'TRAINGUARD_AGENT_LABELS is a JSON list; expected a JSON object of strings, '
                'e.g. {"rack": "r12", "zone": "a"}'),
    ],
)  # fmt: skip
def test_trainguard_agent_with_bad_labels_in_the_environment_is_one_line_exit_2(
    tmp_path: Path, value: str, expected: str
) -> None:
    env = {**clean_env(), "TRAINGUARD_AGENT_LABELS": value}
    result = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "agent", "--gpus", "sim:1",
         "--controller", "http://127.0.0.1:9", "--metrics-port", "-1", "--socket-path", "",
         "--spool-dir", str(tmp_path / "spool")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]  # was 1, SettingsError
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_labels_from_the_environment_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_AGENT_LABELS", '{"rack": "r1"}')
    monkeypatch.setenv("TRAINGUARD_AGENT_PREFLIGHT_LOAD_COMMAND", '["python", "x.py"]')
    settings = load_settings(controller_url="http://c:1")
    assert settings.labels == {"rack": "r1"}
    assert settings.preflight_load_command == ["python", "x.py"]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"a": "x" * 300}, "labels.a: String should have at most 253 characters"),
        ({"a": "b\x00"}, "labels.a: String should match pattern"),
        ({f"k{i}": "v" for i in range(513)}, "labels: Dictionary should have at most 512 items"),
    ],
)
def test_a_label_the_report_cannot_carry_is_a_settings_error(
    labels: dict[str, str], expected: str
) -> None:
    # It used to pass the settings and fail NodeIdentity inside Agent(): a traceback, exit 1.
    with pytest.raises(AgentConfigError) as caught:
        load_settings(controller_url="http://c:1", labels=labels)
    assert expected in str(caught.value)
