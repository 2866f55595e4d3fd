"""Reading every ``wire.GpuSample`` field from an NVML-like API.

The sampler asks the driver field by field, so one refusal costs one field, not the
sample: NOT_SUPPORTED (a PCIe card has no NVLink) becomes ``None`` silently, any other
NVML error becomes ``None`` with one log line per (GPU, field, error). GPU_IS_LOST ends the
GPU's sample with ``lost=True``, which the daemon treats as urgent.

Counters are read in the scope that answers "did it change since driver load": volatile ECC
totals and NVLink error counters summed over the links found active at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from trainguard.wire import GpuInfo, GpuSample, XidEvent, decode_throttle_reasons

log = logging.getLogger(__name__)

_NVLINK_COUNTERS = {
    "nvlink_crc_errors_total": (
        pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    ),
    "nvlink_replay_errors_total": (pynvml.NVML_NVLINK_ERROR_DL_REPLAY,),
    "nvlink_recovery_errors_total": (pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,),
}


class GpuLostError(Exception):
    """Internal: the driver said NVML_ERROR_GPU_IS_LOST while reading this GPU."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    info: GpuInfo
    nvlinks: list[int] = field(default_factory=list)


class GpuSampler:
    """Discovers the node's GPUs once, then samples them on demand."""

    def __init__(
        self,
        api: Any,
        *,
        xid_source: Callable[[int], list[XidEvent]] | None = None,
        locked_clock_mhz: Callable[[int], int | None] | None = None,
        on_lost: Callable[[int], None] | None = None,
    ) -> None:
        self._api = api
        self._xid_source = xid_source
        self._locked_clock_mhz = locked_clock_mhz
        self._on_lost = on_lost
        self._gpus: list[_Gpu] = []
        self._warned: set[tuple[int, str, int]] = set()
        self._use_throttle_name = False
        self.lost: set[int] = set()

    # ------------------------------------------------------------------ discovery

    def open(self) -> list[GpuInfo]:
        """Enumerate GPUs and read their static inventory (names, limits, max clocks)."""
        count = int(self._api.nvmlDeviceGetCount())
        self._gpus = []
        for index in range(count):
            handle = self._api.nvmlDeviceGetHandleByIndex(index)
            self._gpus.append(_Gpu(index, handle, self._inventory(index, handle)))
            self._gpus[-1].nvlinks = self._active_nvlinks(index, handle)
        return self.inventory

    @property
    def inventory(self) -> list[GpuInfo]:
        return [g.info for g in self._gpus]

    @property
    def handles(self) -> list[Any]:
        return [g.handle for g in self._gpus]

    def _inventory(self, index: int, handle: Any) -> GpuInfo:
        try:
            uuid = _text(self._api.nvmlDeviceGetUUID(handle)) or f"gpu-{index}"
        except pynvml.NVMLError as exc:
            log.warning("GPU %d: no UUID (%s)", index, exc)
            uuid = f"gpu-{index}-unknown"
        ask = self._ask_quietly
        name = ask(index, "name", self._api.nvmlDeviceGetName, handle)
        pci = ask(index, "pci", self._api.nvmlDeviceGetPciInfo, handle)
        memory = ask(index, "memory", self._api.nvmlDeviceGetMemoryInfo, handle)
        limits = ask(
            index, "limits", self._api.nvmlDeviceGetPowerManagementLimitConstraints, handle
        )
        default = ask(index, "default", self._api.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        sm_max = ask(
            index, "sm_max", self._api.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM
        )
        mem_max = ask(
            index, "mem_max", self._api.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM
        )
        return GpuInfo(
            index=index,
            uuid=uuid[:128],
            name=_text(name)[:128] if name is not None else "",
            pci_bus_id=_text(pci.busId)[:64] if pci is not None else "",
            memory_total_bytes=int(memory.total) if memory is not None else 0,
            power_limit_min_w=limits[0] / 1000.0 if limits is not None else None,
            power_limit_max_w=limits[1] / 1000.0 if limits is not None else None,
            power_limit_default_w=default / 1000.0 if default is not None else None,
            sm_clock_max_mhz=int(sm_max) if sm_max is not None else None,
            mem_clock_max_mhz=int(mem_max) if mem_max is not None else None,
        )

    def _active_nvlinks(self, index: int, handle: Any) -> list[int]:
        links: list[int] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if self._api.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    links.append(link)
            except pynvml.NVMLError:
                continue  # NOT_SUPPORTED / INVALID_ARGUMENT past the last link
        return links

    def _ask_quietly(self, index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value != pynvml.NVML_ERROR_NOT_SUPPORTED:
                log.warning("GPU %d: cannot read %s at start (%s)", index, what, exc)
            return None

    # ------------------------------------------------------------------ sampling

    def _ask(self, gpu: _Gpu, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError from None
            key = (gpu.index, what, int(exc.value))
            if exc.value != pynvml.NVML_ERROR_NOT_SUPPORTED and key not in self._warned:
                self._warned.add(key)
                log.warning("GPU %d: %s unavailable (%s); reporting null", gpu.index, what, exc)
            return None

    def sample(self) -> list[GpuSample]:
        """One sample per GPU; never raises for a driver error."""
        out = []
        for gpu in self._gpus:
            xids = self._xid_source(gpu.index) if self._xid_source else []
            try:
                sample = self._sample_one(gpu)
            except GpuLostError:
                sample = GpuSample(index=gpu.index, uuid=gpu.info.uuid, lost=True)
                if gpu.index not in self.lost:
                    self.lost.add(gpu.index)
                    log.error(
                        "GPU %d (%s) is lost (NVML_ERROR_GPU_IS_LOST)", gpu.index, gpu.info.uuid
                    )
                    if self._on_lost is not None:
                        self._on_lost(gpu.index)
            else:
                if gpu.index in self.lost:
                    self.lost.discard(gpu.index)
                    log.warning("GPU %d answers again", gpu.index)
            sample.xid_events = xids[-1024:]
            out.append(sample)
        return out

    def _sample_one(self, gpu: _Gpu) -> GpuSample:
        api, h, ask = self._api, gpu.handle, self._ask
        power_mw = ask(gpu, "power", api.nvmlDeviceGetPowerUsage, h)
        energy_mj = ask(gpu, "energy", api.nvmlDeviceGetTotalEnergyConsumption, h)
        limit_mw = ask(gpu, "power limit", api.nvmlDeviceGetEnforcedPowerLimit, h)
        temp = ask(gpu, "temperature", api.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        sm = ask(gpu, "sm clock", api.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        mem = ask(gpu, "memory clock", api.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        util = ask(gpu, "utilization", api.nvmlDeviceGetUtilizationRates, h)
        memory = ask(gpu, "memory", api.nvmlDeviceGetMemoryInfo, h)
        mask = self._throttle_mask(gpu)
        mask = int(mask or 0) & 0xFFFF_FFFF_FFFF_FFFF
        ecc = {
            kind: ask(
                gpu,
                f"ecc {kind}",
                api.nvmlDeviceGetTotalEccErrors,
                h,
                error,
                pynvml.NVML_VOLATILE_ECC,
            )
            for kind, error in (
                ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            )
        }
        pcie = {
            name: ask(gpu, name, fn, h)
            for name, fn in (
                ("pcie_link_gen", api.nvmlDeviceGetCurrPcieLinkGeneration),
                ("pcie_link_width", api.nvmlDeviceGetCurrPcieLinkWidth),
                ("pcie_link_gen_max", api.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_link_width_max", api.nvmlDeviceGetMaxPcieLinkWidth),
            )
        }
        return GpuSample(
            index=gpu.index,
            uuid=gpu.info.uuid,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            sm_clock_mhz=int(sm) if sm is not None else None,
            mem_clock_mhz=int(mem) if mem is not None else None,
            locked_sm_clock_mhz=self._locked_clock_mhz(gpu.index)
            if self._locked_clock_mhz
            else None,
            utilization_gpu_pct=min(100.0, float(util.gpu)) if util is not None else None,
            utilization_mem_pct=min(100.0, float(util.memory)) if util is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            throttle_reasons_mask=mask,
            throttle_reasons=decode_throttle_reasons(mask),
            ecc_corrected_total=_int_or_none(ecc["corrected"]),
            ecc_uncorrected_total=_int_or_none(ecc["uncorrected"]),
            **{k: _int_or_none(v) for k, v in pcie.items()},
            **self._nvlink_totals(gpu),
        )

    def _throttle_mask(self, gpu: _Gpu) -> Any:
        """Clock-event reasons; drivers before r535 only have the older "throttle" name."""
        if not self._use_throttle_name:
            try:
                return self._api.nvmlDeviceGetCurrentClocksEventReasons(gpu.handle)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                        raise GpuLostError from None
                    return self._ask(gpu, "throttle reasons", _raise, exc)
                self._use_throttle_name = True
        return self._ask(
            gpu, "throttle reasons", self._api.nvmlDeviceGetCurrentClocksThrottleReasons, gpu.handle
        )

    def _nvlink_totals(self, gpu: _Gpu) -> dict[str, int | None]:
        totals: dict[str, int | None] = {}
        for name, counters in _NVLINK_COUNTERS.items():
            total: int | None = None
            for link in gpu.nvlinks:
                for counter in counters:
                    value = self._ask(
                        gpu,
                        name,
                        self._api.nvmlDeviceGetNvLinkErrorCounter,
                        gpu.handle,
                        link,
                        counter,
                    )
                    if value is not None:
                        total = (total or 0) + int(value)
            totals[name] = total
        return totals


def _raise(exc: Exception) -> None:
    raise exc


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


__all__ = ["GpuLostError", "GpuSampler"]
