"""Wire reports to policy inputs, and the package's public face."""

from __future__ import annotations

import power
from power.config import Priority, WorkloadKind
from power.domains import parse_domains
from power.policy import PowerPolicy
from power.reports import apply_job_priorities, gpu_statuses, readings_from_sample
from trainguard.wire import GpuInfo, GpuSample, NodeIdentity, NodeSample

IDENTITY = NodeIdentity(
    name="node-1",
    labels={"trainguard.io/priority": "low", "trainguard.io/workload": "inference"},
    gpus=[
        GpuInfo(
            index=i,
            uuid=f"GPU-{i}",
            name="NVIDIA H100 80GB HBM3",
            sm_clock_max_mhz=1980,
            power_limit_min_w=200.0,
            power_limit_max_w=700.0,
        )
        for i in range(2)
    ],
)


def test_server_reading_is_the_gpu_sum_or_the_meter() -> None:
    sample = NodeSample(
        time_unix_s=100.0,
        gpus=[GpuSample(index=0, power_w=300.0), GpuSample(index=1, power_w=350.0)],
    )
    r = readings_from_sample("node-1", sample, time_s=101.0)
    assert r["node-1"].power_w == 650.0 and r["node-1"].time_s == 101.0
    metered = sample.model_copy(update={"node_power_w": 1400.0, "node_power_source": "rapl"})
    assert readings_from_sample("node-1", metered)["node-1"].power_w == 1400.0


def test_a_silent_gpu_leaves_no_server_reading_so_caps_hold() -> None:
    sample = NodeSample(
        time_unix_s=100.0,
        gpus=[GpuSample(index=0, power_w=300.0), GpuSample(index=1, power_w=None)],
    )
    assert readings_from_sample("node-1", sample) == {}


def test_gpu_domains_get_their_own_readings() -> None:
    tree = parse_domains(
        {
            "name": "node-1",
            "kind": "server",
            "budget_w": 2000,
            "children": [{"name": "node-1-g1", "kind": "gpu", "budget_w": 700, "gpu_index": 1}],
        }
    )
    sample = NodeSample(
        time_unix_s=5.0, gpus=[GpuSample(index=0, power_w=300.0), GpuSample(index=1, power_w=350.0)]
    )
    r = readings_from_sample("node-1", sample, tree=tree)
    assert r["node-1-g1"].power_w == 350.0 and r["node-1"].power_w == 650.0


def test_gpu_statuses_carry_labels_and_current_caps() -> None:
    sample = NodeSample(
        time_unix_s=1.0,
        gpus=[
            GpuSample(index=0, locked_sm_clock_mhz=1575, power_limit_w=700.0),
            GpuSample(index=1),
        ],
    )
    st = gpu_statuses(IDENTITY, sample)
    assert [s.index for s in st] == [0, 1]
    assert st[0].priority is Priority.LOW and st[0].workload is WorkloadKind.INFERENCE
    assert st[0].locked_sm_clock_mhz == 1575 and st[1].locked_sm_clock_mhz is None
    unlabelled = IDENTITY.model_copy(update={"labels": {}})
    assert gpu_statuses(unlabelled)[0].priority is Priority.HIGH


def test_end_to_end_from_wire_to_h100_caps() -> None:
    tree = parse_domains(
        {
            "name": "row-a",
            "kind": "row",
            "budget_w": 1500,
            "children": [{"name": "node-1", "kind": "server", "budget_w": 2000}],
        }
    )
    policy = PowerPolicy(tree)
    sample = NodeSample(
        time_unix_s=0.0, gpus=[GpuSample(index=0, power_w=650.0), GpuSample(index=1, power_w=650.0)]
    )
    res = policy.tick(0.0, readings_from_sample("node-1", sample), gpu_statuses(IDENTITY, sample))
    # 1300 W of 1500 W = 86.7%: T1, low priority to H100's moderate cap.
    assert {(d.gpu_index, d.command.kind) for d in res.decisions} == {
        (0, "lock_clocks"),
        (1, "lock_clocks"),
    }
    assert all(d.command.max_mhz == 1800 for d in res.decisions)  # type: ignore[union-attr]


def test_public_surface_is_pinned() -> None:
    assert sorted(power.__all__) == [
        "ActuationEffect",
        "ConfigError",
        "Decision",
        "Domain",
        "DomainKind",
        "DomainStatus",
        "DomainTree",
        "GpuStatus",
        "Knob",
        "Level",
        "PolicyConfig",
        "PolicyIncident",
        "PowerError",
        "PowerPolicy",
        "Priority",
        "Reading",
        "TickResult",
        "TraceError",
        "WorkloadKind",
        "apply_job_priorities",
        "gpu_statuses",
        "load_domains",
        "parse_domains",
        "priority_from_labels",
        "readings_from_sample",
    ]


def test_job_priorities_override_the_node_gpu_by_gpu() -> None:
    gpus = gpu_statuses(IDENTITY)  # the node is labelled low
    other = gpu_statuses(IDENTITY.model_copy(update={"name": "node-2"}))
    both = gpus + other
    assert apply_job_priorities(both, []) == both
    out = apply_job_priorities(both, [("node-1", 0, Priority.HIGH)])
    assert [(g.server, g.index, g.priority) for g in out] == [
        ("node-1", 0, Priority.HIGH),
        ("node-1", 1, Priority.LOW),
        ("node-2", 0, Priority.LOW),
        ("node-2", 1, Priority.LOW),
    ]
    # A rank without a GPU index covers its node; on a shared GPU high wins over low.
    out = apply_job_priorities(both, [("node-2", None, Priority.HIGH), ("node-1", 1, Priority.LOW)])
    assert [g.priority for g in out] == [Priority.LOW, Priority.LOW, Priority.HIGH, Priority.HIGH]
    high = gpu_statuses(IDENTITY, priority=Priority.HIGH)
    out = apply_job_priorities(
        high,
        [("node-1", 0, Priority.LOW), ("node-1", 0, Priority.HIGH), ("node-1", 1, Priority.LOW)],
    )
    assert [g.priority for g in out] == [Priority.HIGH, Priority.LOW]  # a low job lowers its GPU
