"""The agent's /metrics: names, base units, dcgm-style labels, scraped over HTTP."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from agents.gpu.faults import parse_fault_specs
from agents.gpu.sim import SimNvml
from agents.metrics import MetricsServer, MetricsSource
from agents.sampler import GpuSampler
from agents.stats import AgentStats
from tests import http_calls
from trainguard.wire import NicPortSample, NodeSample

GPU_METRICS = {
    "trainguard_gpu_power_watts",
    "trainguard_gpu_energy_joules",  # exposed as ..._joules_total
    "trainguard_gpu_temperature_celsius",
    "trainguard_gpu_sm_clock_hertz",
    "trainguard_gpu_memory_clock_hertz",
    "trainguard_gpu_utilization_ratio",
    "trainguard_gpu_memory_used_bytes",
    "trainguard_gpu_power_limit_watts",
    "trainguard_gpu_ecc_errors",
    "trainguard_gpu_xid_errors",
    "trainguard_gpu_clocks_event_reasons",
    "trainguard_gpu_lost",
    "trainguard_gpu_unknown",
    "trainguard_gpu_ecc_aggregate_errors",
    "trainguard_gpu_remapped_rows",
    "trainguard_gpu_row_remap_pending",
    "trainguard_gpu_row_remap_failed",
    "trainguard_gpu_pcie_replays",
    "trainguard_gpu_pcie_link_width",
    "trainguard_gpu_nvlink_errors",
    "trainguard_gpu_nvlinks_down",
    "trainguard_node_power_watts",
    "trainguard_node_hardware_events",
    "trainguard_nic_port_up",
    "trainguard_nic_port_rate_bits_per_second",
    "trainguard_nic_port_errors",
    "trainguard_nic_port_congestion",
}
AGENT_METRICS = {
    "trainguard_agent_reports_sent",
    "trainguard_agent_report_failures",
    "trainguard_agent_reports_rejected",
    "trainguard_agent_spool_dropped",
    "trainguard_agent_spool_reports",
    "trainguard_agent_spool_bytes",
    "trainguard_agent_local_clients",
    "trainguard_agent_records_dropped",
    "trainguard_agent_last_report_success_timestamp_seconds",
}


def test_scrape_has_every_metric_in_base_units_with_dcgm_labels() -> None:
    api = SimNvml(
        gpu_count=2,
        faults=parse_fault_specs("kind=ecc,gpu=1,uncorrected=2;kind=thermal,gpu=0"),
    )
    api.nvmlInit()
    sampler = GpuSampler(api)
    inventory = sampler.open()
    stats = AgentStats()
    stats.count_xid(1, 79)
    stats.add("reports_sent_total", 3)
    stats.last_report_ok_unix_s = 1234.5
    stats.count_events(["nic_port_down", "nic_port_down", "gpu_unknown"])
    port = NicPortSample(
        device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0,
        counters={"symbol_error": 4, "np_cnp_sent": 9, "port_xmit_data": 10**12},
    )  # fmt: skip
    gpus = sampler.sample()
    source = MetricsSource(
        hostname="node-a",
        inventory=inventory,
        gpu_pods=lambda: {1: ("train-0", "ml")},
        stats=stats,
        spool_stats=lambda: (2, 4096),
        spool_dropped_total=lambda: 5,
        local_clients=lambda: 3,
        latest=NodeSample(
            time_unix_s=1.0,
            gpus=gpus,
            node_power_w=900.0,
            node_power_source="gpu_sum",
            nics=[port],
        ),
    )
    server = MetricsServer(source)
    port = server.start("127.0.0.1", 0)
    try:
        text = http_calls.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) >= GPU_METRICS | AGENT_METRICS
    assert "trainguard_gpu_energy_joules_total" in text
    assert "trainguard_agent_reports_sent_total 3.0" in text
    power = {s.labels["gpu"]: s for s in families["trainguard_gpu_power_watts"].samples}
    assert set(power) == {"0", "1"}
    labels = power["1"].labels
    assert labels["UUID"] == inventory[1].uuid and labels["modelName"] == inventory[1].name
    assert labels["pci_bus_id"] == inventory[1].pci_bus_id and labels["Hostname"] == "node-a"
    assert labels["device"] == "nvidia1" and "hostname" not in labels
    assert (labels["pod"], labels["namespace"]) == ("train-0", "ml")
    assert (power["0"].labels["pod"], power["0"].labels["namespace"]) == ("", "")
    assert power["1"].value == gpus[1].power_w
    sm = next(
        s for s in families["trainguard_gpu_sm_clock_hertz"].samples if s.labels["gpu"] == "0"
    )
    assert sm.value == gpus[0].sm_clock_mhz * 1e6  # type: ignore[operator]
    util = next(s for s in families["trainguard_gpu_utilization_ratio"].samples)
    assert 0 <= util.value <= 1
    ecc = {
        (s.labels["gpu"], s.labels["type"]): s.value
        for s in families["trainguard_gpu_ecc_errors"].samples
        if s.name.endswith("_total")
    }
    assert ecc[("1", "uncorrected")] == 2 and ecc[("0", "uncorrected")] == 0
    xid = [s for s in families["trainguard_gpu_xid_errors"].samples if s.name.endswith("_total")]
    assert [(s.labels["gpu"], s.labels["xid"], s.value) for s in xid] == [("1", "79", 1.0)]
    # One bitmask series per GPU, not one per reason: GPU 0 is thermally throttled.
    reasons = {
        s.labels["gpu"]: s.value for s in families["trainguard_gpu_clocks_event_reasons"].samples
    }
    assert reasons == {
        "0": float(gpus[0].throttle_reasons_mask),
        "1": float(gpus[1].throttle_reasons_mask),
    }
    assert int(reasons["0"]) & 0x40  # nvmlClocksEventReasonHwThermalSlowdown
    assert "trainguard_gpu_throttle_reason" not in text
    per_gpu = [
        s for f in families.values() for s in f.samples
        if s.labels.get("gpu") == "0" and not s.name.endswith("_created")
    ]  # fmt: skip
    assert len(per_gpu) <= 30, len(per_gpu)  # the budget documented in docs/agent.md
    nic = {
        (s.name, s.labels.get("counter")): s.value
        for s in families["trainguard_nic_port_errors"].samples
    }
    assert nic[("trainguard_nic_port_errors_total", "symbol_error")] == 4
    assert families["trainguard_nic_port_up"].samples[0].value == 1
    assert families["trainguard_nic_port_rate_bits_per_second"].samples[0].value == 400e9
    events = {
        s.labels["kind"]: s.value
        for s in families["trainguard_node_hardware_events"].samples
        if s.name.endswith("_total")
    }
    assert events == {"nic_port_down": 2.0, "gpu_unknown": 1.0}
    node = families["trainguard_node_power_watts"].samples[0]
    assert node.value == 900.0 and node.labels["source"] == "gpu_sum"
    assert families["trainguard_agent_spool_reports"].samples[0].value == 2
    assert families["trainguard_agent_local_clients"].samples[0].value == 3
    assert "trainguard_agent_spool_dropped_total 5.0" in text


def test_scrape_before_the_first_sample_still_serves_agent_metrics() -> None:
    source = MetricsSource(
        hostname="h", inventory=[], stats=AgentStats(), spool_stats=lambda: (0, 0),
        spool_dropped_total=lambda: 0,
    )  # fmt: skip
    server = MetricsServer(source)
    port = server.start("127.0.0.1", 0)
    try:
        text = http_calls.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        server.stop()
    assert "trainguard_agent_reports_sent_total 0.0" in text
    assert "trainguard_gpu_power_watts" not in text
