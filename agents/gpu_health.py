"""The GPU signals that precede failures, read through NVML with nvidia-ml-py's names.

Each reader asks one NVML function and turns its answer into ``wire.GpuSample`` fields in
the wire's units; a board that lacks the feature (NOT_SUPPORTED) leaves the fields ``None``
(the sampler's ``ask`` does that), so a V100 reports retired pages and an H100 remapped
rows, each truthfully. What the controller makes of each signal is in docs/agent.md
("Health rules").

| field | NVML call |
|---|---|
| ``ecc_*_aggregate_total`` | ``nvmlDeviceGetTotalEccErrors(h, type, NVML_AGGREGATE_ECC)`` |
| ``ecc_locations`` | ``nvmlDeviceGetMemoryErrorCounter(h, type, counter, location)`` |
| ``retired_pages_*`` | ``nvmlDeviceGetRetiredPages(h, cause)``, ``...PendingStatus(h)`` |
| ``remapped_rows_*``, ``row_remap_*`` | ``nvmlDeviceGetRemappedRows(h)`` |
| ``pcie_replay_total`` | ``nvmlDeviceGetPcieReplayCounter(h)`` |
| ``nvlinks`` | ``nvmlDeviceGetNvLinkState(h, l)``, ``nvmlDeviceGetNvLinkErrorCounter(h, l, c)`` |
| ``fabric_*`` | ``nvmlDeviceGetGpuFabricInfo(h, c_nvmlGpuFabricInfo_t)`` |
| ``mig_mode*`` | ``nvmlDeviceGetMigMode(h)`` |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from trainguard.wire import EccLocationCounts, GpuSample, HardwareEvent, NvLinkSample

#: ``ask(what, fn, *args)``: the NVML answer, or None when the driver would not say.
Ask = Callable[..., Any]

#: Locations NVML counts ECC errors at (``NVML_MEMORY_LOCATION_*``), in wire names.
ECC_LOCATIONS: dict[str, int] = {
    "l1_cache": pynvml.NVML_MEMORY_LOCATION_L1_CACHE,
    "l2_cache": pynvml.NVML_MEMORY_LOCATION_L2_CACHE,
    "dram": pynvml.NVML_MEMORY_LOCATION_DRAM,
    "register_file": pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE,
    "texture_memory": pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY,
    "texture_shm": pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM,
    "cbu": pynvml.NVML_MEMORY_LOCATION_CBU,
    "sram": pynvml.NVML_MEMORY_LOCATION_SRAM,
}
FABRIC_STATES = {
    pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED: "not_supported",
    pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED: "not_started",
    pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS: "in_progress",
    pynvml.NVML_GPU_FABRIC_STATE_COMPLETED: "completed",
}
_NVLINK_COUNTERS = {
    "crc_errors_total": (
        pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    ),
    "replay_errors_total": (pynvml.NVML_NVLINK_ERROR_DL_REPLAY,),
    "recovery_errors_total": (pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,),
}
_TYPES = (
    ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
    ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
)
#: Busy fraction above which a PCIe generation below the maximum counts as degraded. GPUs
#: lower the link generation on their own when idle (power saving); width never drops.
PCIE_GEN_BUSY_PCT = 50.0


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _flag(value: Any) -> bool | None:
    return bool(value) if value is not None else None


def ecc_locations_present(ask: Ask, api: Any, handle: Any) -> list[str]:
    """The locations whose counters answer on this board (asked once, at start)."""
    return [
        name
        for name, loc in ECC_LOCATIONS.items()
        if ask(
            f"ecc {name}",
            api.nvmlDeviceGetMemoryErrorCounter,
            handle,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
            loc,
        )
        is not None
    ]


def read_memory_health(ask: Ask, api: Any, handle: Any, locations: Sequence[str]) -> dict[str, Any]:
    """Aggregate ECC, ECC by location, retired pages and row remapping."""
    out: dict[str, Any] = {}
    for kind, error in _TYPES:
        out[f"ecc_{kind}_aggregate_total"] = _int(
            ask(
                f"aggregate ecc {kind}",
                api.nvmlDeviceGetTotalEccErrors,
                handle,
                error,
                pynvml.NVML_AGGREGATE_ECC,
            )
        )
    counts = []
    for name in locations:
        for counter_name, counter in (
            ("volatile", pynvml.NVML_VOLATILE_ECC),
            ("aggregate", pynvml.NVML_AGGREGATE_ECC),
        ):
            values = {
                kind: _int(
                    ask(
                        f"ecc {name}",
                        api.nvmlDeviceGetMemoryErrorCounter,
                        handle,
                        error,
                        counter,
                        ECC_LOCATIONS[name],
                    )
                )
                for kind, error in _TYPES
            }
            counts.append(EccLocationCounts(location=name, counter=counter_name, **values))
    out["ecc_locations"] = counts
    for cause, field in (
        (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, "retired_pages_sbe"),
        (pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, "retired_pages_dbe"),
    ):
        pages = ask("retired pages", api.nvmlDeviceGetRetiredPages, handle, cause)
        out[field] = len(pages) if pages is not None else None
    out["retired_pages_pending"] = _flag(
        ask("retired pages pending", api.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    )
    rows = ask("remapped rows", api.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        corr, unc, pending, failed = rows
        out.update(
            remapped_rows_correctable=int(corr),
            remapped_rows_uncorrectable=int(unc),
            row_remap_pending=bool(pending),
            row_remap_failed=bool(failed),
        )
    return out


def read_links_and_fabric(
    ask: Ask,
    api: Any,
    handle: Any,
    links: Sequence[int],
    failures: Callable[[], int] = lambda: 0,
) -> dict[str, Any]:
    """Per-link NVLink state and counters (plus their sums), PCIe replays, fabric, MIG.

    ``failures()``: how many reads of this sample ``ask`` has seen fail so far (an NVML
    error, not NOT_SUPPORTED: both answer None). A read that failed says "unknown", never
    what a missing answer would read as: a link whose state failed is left out and the
    active count is unknown (one transient NVML_ERROR_UNKNOWN read as nvlink_down, then
    nvlink_up next tick: an urgent report and a flapping GPU); a counter that failed makes
    that link's total and the GPU's sum unknown (a sum over fewer links dips and jumps
    back, which a Prometheus ``rate()`` reads as a reset and a spike)."""
    nvlinks = []
    unread: set[str] = set()  # "state" and the counters some link failed to answer
    totals: dict[str, list[int]] = {name: [] for name in _NVLINK_COUNTERS}
    for link in links:
        before = failures()
        state = ask("nvlink state", api.nvmlDeviceGetNvLinkState, handle, link)
        state_read = failures() == before
        if not state_read:
            unread.add("state")
        counts: dict[str, int | None] = {}
        for name, counters in _NVLINK_COUNTERS.items():
            total: int | None = None
            before = failures()
            for counter in counters:
                value = ask(
                    f"nvlink {name}", api.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter
                )
                if value is not None:
                    total = (total or 0) + int(value)
            if failures() != before:
                unread.add(name)
                total = None
            counts[name] = total
            if total is not None:
                totals[name].append(total)
        if state_read:
            nvlinks.append(
                NvLinkSample(link=link, active=state == pynvml.NVML_FEATURE_ENABLED, **counts)
            )
    out: dict[str, Any] = {
        "nvlinks": nvlinks,
        "nvlink_active_count": (
            sum(n.active for n in nvlinks) if links and "state" not in unread else None
        ),
    }
    for name, values in totals.items():
        out[f"nvlink_{name}"] = sum(values) if values and name not in unread else None
    out["pcie_replay_total"] = _int(ask("pcie replay", api.nvmlDeviceGetPcieReplayCounter, handle))
    info = pynvml.c_nvmlGpuFabricInfo_t()
    if ask("fabric", api.nvmlDeviceGetGpuFabricInfo, handle, info) is not None:
        out["fabric_state"] = FABRIC_STATES.get(int(info.state), f"state_{int(info.state)}")
        out["fabric_status"] = int(info.status)
    mig = ask("mig mode", api.nvmlDeviceGetMigMode, handle)
    if mig is not None:
        out["mig_mode"], out["mig_mode_pending"] = bool(mig[0]), bool(mig[1])
    return out


def trim_for_wire(sample: GpuSample) -> None:
    """Leave out healthy NVLinks and zero ECC locations (sums and counts carry them).

    18 NVLinks of 8 GPUs in 5 samples are ~70 KB a report; only the links that are down
    or counted errors say something a sum does not.
    """
    sample.nvlinks = [
        n
        for n in sample.nvlinks
        if not n.active or n.crc_errors_total or n.replay_errors_total or n.recovery_errors_total
    ]
    sample.ecc_locations = [c for c in sample.ecc_locations if c.corrected or c.uncorrected]


def pcie_degraded(sample: GpuSample) -> str:
    """Why the PCIe link runs below its maximum, or "" when it does not (see module note)."""
    width, width_max = sample.pcie_link_width, sample.pcie_link_width_max
    if width is not None and width_max is not None and 0 < width < width_max:
        return f"PCIe link width x{width} of x{width_max}"
    gen, gen_max, busy = sample.pcie_link_gen, sample.pcie_link_gen_max, sample.utilization_gpu_pct
    if (
        gen is not None
        and gen_max is not None
        and gen < gen_max
        and (busy or 0) >= PCIE_GEN_BUSY_PCT
    ):
        return f"PCIe link Gen{gen} of Gen{gen_max} while {busy:.0f}% busy"
    return ""


def pcie_verdict(sample: GpuSample) -> str | None:
    """Why the PCIe link runs below its maximum, "" when this sample shows it at its maximum,
    or ``None`` when this sample cannot tell: a width or generation read that did not answer,
    or a generation below its maximum while the GPU is not busy (GPUs drop the generation
    on their own when idle, so an idle GPU at Gen4 of Gen5 is neither degraded nor
    restored). Transitions are made only on a verdict, so a training job's
    communication or checkpoint phases, or one failed read, never read as "restored"."""
    why = pcie_degraded(sample)
    if why:
        return why
    width, width_max = sample.pcie_link_width, sample.pcie_link_width_max
    if width is None or width_max is None:
        return None
    gen, gen_max = sample.pcie_link_gen, sample.pcie_link_gen_max
    if (gen is None) != (gen_max is None):
        return None  # one of the pair failed to answer this tick
    if gen is not None and gen_max is not None and gen < gen_max:
        return None  # below its maximum while not busy: no evidence either way
    return ""


class GpuTransitions:
    """Turns changes between two samples of one GPU into ``HardwareEvent``s.

    A link that goes down and comes back between two samples is only seen through its
    recovery counter; what a poll sees is the state at each tick, so that is what is
    reported, once per change.
    """

    def __init__(self) -> None:
        self._links: dict[tuple[int, int], bool] = {}
        self._pcie: dict[int, str] = {}
        self._unknown: dict[int, bool] = {}
        self._unreachable: dict[int, bool] = {}

    def update(self, sample: GpuSample, now_unix_s: float) -> list[HardwareEvent]:
        events: list[HardwareEvent] = []
        gpu = sample.index

        def event(kind: str, detail: str, port: int | None = None) -> None:
            events.append(
                HardwareEvent(
                    kind=kind, time_unix_s=now_unix_s, gpu_index=gpu, port=port, detail=detail
                )
            )

        was_unknown = self._unknown.get(gpu, False)
        if sample.unknown != was_unknown:
            self._unknown[gpu] = sample.unknown
            if sample.unknown:
                event("gpu_unknown", sample.error or "GPU did not answer")
        # Said once, when it turns so: an urgent report, not one per sample.
        if sample.unreachable != self._unreachable.get(gpu, False):
            self._unreachable[gpu] = sample.unreachable
            if sample.unreachable:
                event("gpu_unreachable", sample.error[:512] or "no NVML read answered")
        if sample.unknown or sample.lost or sample.unreachable:
            return events
        for link in sample.nvlinks:
            before = self._links.get((gpu, link.link))
            self._links[(gpu, link.link)] = link.active
            if before is not None and before != link.active:
                kind = "nvlink_up" if link.active else "nvlink_down"
                event(kind, f"NVLink {link.link} is {'up' if link.active else 'down'}", link.link)
        why = pcie_verdict(sample)
        if why is None:
            return events  # this sample cannot tell: the link keeps its last verdict
        before_why = self._pcie.get(gpu, "")
        self._pcie[gpu] = why
        if why and not before_why:
            event("pcie_link_degraded", why)
        elif before_why and not why:
            event("pcie_link_restored", f"PCIe link back to its maximum (was: {before_why})")
        return events


__all__ = [
    "ECC_LOCATIONS",
    "FABRIC_STATES",
    "GpuTransitions",
    "ecc_locations_present",
    "pcie_degraded",
    "pcie_verdict",
    "read_links_and_fabric",
    "read_memory_health",
    "trim_for_wire",
]
