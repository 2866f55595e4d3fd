"""Preflight: the agent's hardware checks on demand, pass / fail / skip per check with a reason.

Run before a node is given to a job (``trainguard preflight --local`` on the node, or the
controller's ``run_preflight`` command through the agent). Each check reads what the agent
already reads, fresh: one sample of every GPU through the same sampler (so a hung GPU is a
failed check, not a hung preflight) and one read of every RDMA port. Only ``clocks_load``
generates work (a load process per GPU). :func:`agents.clocks_load.run_preflight` runs them
all, for the daemon (the load on a thread of its own) and for the CLI alike.

=================  ==========================================================================
check              fails when
=================  ==========================================================================
``nvml``           NVML fails on a node with NVIDIA devices (the agent's ``gpu_error``)
``nvml_sanity``    a GPU is lost, hung past the timeout, or fails to answer power/temperature/
                   clocks/memory (a reading the board does not support is no failure)
``ecc``            uncorrectable ECC errors since driver load (volatile)
``memory_repair``  a row remap failed or is pending, a page retirement is pending, or 60+
                   pages are retired
``nvlink``         some NVLinks of the GPU are down while others are up
``pcie``           the PCIe link runs at fewer lanes than the board supports
``clocks_load``    under a short matmul load, a hardware slowdown reason is set or the median
                   SM clock stays below 60 % of the max (rule and skips in
                   :mod:`agents.clocks_load`); here a placeholder the load's result replaces
``nic_port``       an RDMA port is not ACTIVE/LinkUp, or slower than expected (the given rate,
                   else the fastest port of the same link layer on the node)
=================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from agents.gpu.backend import GpuBackend
from agents.nics import port_is_up
from trainguard.wire import GpuSample, NicPortSample

#: Retired pages at which DCGM fails a board (the controller's rule uses the same number).
RETIRED_PAGES_LIMIT = 60

Status = Literal["pass", "fail", "skip"]
#: ``clocks_load`` until a load ran (the caller asked for none).
NO_LOAD_REQUESTED = "no load requested (the agent's preflight runs one; see docs/agent.md)"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    target: str
    status: Status
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _gpu_checks(sample: GpuSample, down_at_start: Sequence[int]) -> list[Check]:
    target = f"gpu{sample.index}"

    def check(name: str, status: Status, reason: str) -> Check:
        return Check(name, target, status, reason)

    if sample.lost:
        return [check("nvml_sanity", "fail", "GPU lost (NVML_ERROR_GPU_IS_LOST)")]
    if sample.unknown or sample.unreachable:
        return [check("nvml_sanity", "fail", sample.error or "NVML did not answer")]
    out: list[Check] = []
    core = {
        "power": sample.power_w,
        "temperature": sample.temperature_c,
        "sm clock": sample.sm_clock_mhz,
        "memory": sample.memory_total_bytes,
    }
    missing = [name for name, value in core.items() if value is None]
    if missing and sample.error:
        out.append(
            check("nvml_sanity", "fail", f"no answer for {', '.join(missing)} ({sample.error})")
        )
    else:
        # Without an error, what is missing is what the board does not support (NVML's
        # NOT_SUPPORTED, which the sampler leaves unsaid: a vGPU or a consumer board has no
        # power reading): no fault of this GPU, or such a node could never pass.
        read = [
            f"{sample.power_w:.0f} W" if sample.power_w is not None else "",
            f"{sample.temperature_c:.0f} C" if sample.temperature_c is not None else "",
            f"{sample.sm_clock_mhz} MHz" if sample.sm_clock_mhz is not None else "",
        ]
        unsupported = f"; not supported by the board: {', '.join(missing)}" if missing else ""
        out.append(check("nvml_sanity", "pass", ", ".join(r for r in read if r) + unsupported))
    unc = sample.ecc_uncorrected_total
    if unc is None:
        out.append(check("ecc", "skip", "ECC counters not available (ECC off or unsupported)"))
    elif unc > 0:
        out.append(check("ecc", "fail", f"{unc} uncorrectable ECC errors since driver load"))
    else:
        out.append(check("ecc", "pass", f"0 uncorrectable, {sample.ecc_corrected_total} corrected"))
    out.append(check("memory_repair", *_memory_repair(sample)))
    up = sample.nvlink_active_count or 0
    down = sorted({*(link.link for link in sample.nvlinks if not link.active), *down_at_start})
    if up and down:
        out.append(check("nvlink", "fail", f"NVLink {', '.join(map(str, down))} down"))
    elif up:
        out.append(check("nvlink", "pass", f"{up} links up"))
    else:
        out.append(check("nvlink", "skip", "no active NVLink on this GPU"))
    width, width_max = sample.pcie_link_width, sample.pcie_link_width_max
    if width is None or width_max is None:
        out.append(check("pcie", "skip", "PCIe link width not reported"))
    elif width < width_max:
        out.append(check("pcie", "fail", f"PCIe link x{width} of x{width_max}"))
    else:
        out.append(check("pcie", "pass", f"x{width} Gen{sample.pcie_link_gen}"))
    out.append(check("clocks_load", "skip", NO_LOAD_REQUESTED))
    return out


def _memory_repair(sample: GpuSample) -> tuple[Status, str]:
    if sample.row_remap_failed:
        return "fail", "row remapping failed: the GPU needs service"
    if sample.row_remap_pending:
        return "fail", "row remap pending: reset the GPU first"
    if sample.retired_pages_pending:
        return "fail", "page retirement pending: reset the GPU first"
    retired = (sample.retired_pages_sbe or 0) + (sample.retired_pages_dbe or 0)
    if retired >= RETIRED_PAGES_LIMIT:
        return "fail", f"{retired} retired pages (limit {RETIRED_PAGES_LIMIT})"
    if sample.remapped_rows_correctable is not None:
        rows = (sample.remapped_rows_correctable or 0) + (sample.remapped_rows_uncorrectable or 0)
        return "pass", f"{rows} rows remapped, none pending"
    if sample.retired_pages_sbe is not None:
        return "pass", f"{retired} pages retired, none pending"
    return "skip", "neither row remapping nor page retirement reported"


def _nic_checks(ports: Sequence[NicPortSample], expected_gbps: float | None) -> list[Check]:
    out = []
    best: dict[str, float] = {}
    for port in ports:
        if port.rate_gbps is not None:
            best[port.link_layer] = max(best.get(port.link_layer, 0.0), port.rate_gbps)
    for port in ports:
        target = f"{port.device}/{port.port}"
        want = expected_gbps if expected_gbps is not None else best.get(port.link_layer)
        rate = port.rate_gbps
        if not port_is_up(port.state) or port.phys_state != "LinkUp":
            out.append(Check("nic_port", target, "fail", f"{port.state} ({port.phys_state})"))
        elif want is not None and (rate is None or rate < want):
            source = "expected" if expected_gbps is not None else "the node's fastest port runs"
            out.append(Check("nic_port", target, "fail", f"{rate or 0:g} Gb/s, {source} {want:g}"))
        else:
            out.append(Check("nic_port", target, "pass", f"{port.state} {rate or 0:g} Gb/s"))
    return out


def evaluate(
    backend: GpuBackend,
    gpus: Sequence[GpuSample],
    ports: Sequence[NicPortSample],
    *,
    nvlinks_down_at_start: Callable[[int], Sequence[int]] = lambda _i: (),
    expected_nic_rate_gbps: float | None = None,
) -> list[Check]:
    """The checks over one sample of every GPU and one read of every RDMA port."""
    checks: list[Check] = []
    if backend.error:
        checks.append(Check("nvml", "node", "fail", backend.error))
    elif backend.kind == "sim":
        checks.append(Check("nvml", "node", "pass", "simulated GPUs (sim): not real hardware"))
    elif not gpus:
        checks.append(Check("nvml", "node", "pass", "no NVIDIA devices: this node has no GPUs"))
    else:
        checks.append(Check("nvml", "node", "pass", f"driver {backend.driver_version}"))
    for sample in gpus:
        checks += _gpu_checks(sample, nvlinks_down_at_start(sample.index))
    checks += _nic_checks(ports, expected_nic_rate_gbps)
    return checks


def summary(checks: Sequence[Check]) -> str:
    """One line for an ack: the verdict and every failed check (truncated to 1,024 chars)."""
    failed = [c for c in checks if c.status == "fail"]
    ran = sum(1 for c in checks if c.status != "skip")
    if not failed:
        return f"preflight passed: {ran} checks ({len(checks) - ran} skipped)"
    parts = "; ".join(f"{c.target} {c.name}: {c.reason}" for c in failed)
    return f"preflight failed {len(failed)}/{ran} checks: {parts}"[:1024]


__all__ = [
    "NO_LOAD_REQUESTED",
    "RETIRED_PAGES_LIMIT",
    "Check",
    "evaluate",
    "summary",
]
