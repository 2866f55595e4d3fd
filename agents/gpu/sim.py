"""A simulated NVML with pynvml's function names, units, return types and error classes.

The agent's sampler and command executor call whatever object they are given exactly as
they would call the ``pynvml`` module, so the simulated backend exercises the one code path
that runs on real GPUs. Units follow NVML: power and limits in mW, energy in mJ, clocks in
MHz, temperatures in °C, memory in bytes. Errors are ``pynvml.NVMLError`` subclasses built
from the real codes (``NVML_ERROR_GPU_IS_LOST``, ``NVML_ERROR_NO_PERMISSION``,
``NVML_ERROR_INVALID_ARGUMENT``, ``NVML_ERROR_TIMEOUT`` from an empty event wait, ...).
Struct-returning calls return pynvml's own ctypes structures, so fields such as ``busId``
read exactly as they do from the driver.

Scripted faults (:mod:`agents.gpu.faults`) run on the simulator's clock, which starts at
the first ``nvmlInit``. Without faults the load follows :func:`sim_model.utilization_pct`.
Every ``nvmlDevice*`` call on a GPU with a due ``hang`` fault blocks (outside the driver
lock, so the other GPUs keep answering) until the hang's duration passes or the driver is
shut down; a due ``nvml_error`` fault makes every call on that GPU raise its code (or only
its first ``calls``: a transient error; for ``duration`` seconds only: a GPU that comes back;
with ``events=1`` the event set's wait fails with it too). A due ``reset`` fault is a driver
reload or GPU reset as NVML shows it: the energy counter starts again from 0 and the
volatile ECC counters count only later errors (the aggregate ones too with
``aggregate=1``).

A load generator can drive a simulated GPU as a CUDA kernel drives a real one: while
``<load_dir>/gpu<N>.pid`` names a live process (the stand-in :mod:`agents.gpu.sim_load`
writes it), GPU N runs at 100 % utilization and reports the clocks and clock-event reasons
the model gives a fully busy board (a ``slowdown`` or ``thermal`` fault shows up there).

A GPU in MIG mode lists the model's ``mig_instances`` MIG instances (:mod:`agents.gpu.sim_mig`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from agents.gpu.faults import FaultSpec
from agents.gpu.sim_events import (
    ScheduledEvent,
    SimEventData,
    SimEventSet,
    SimEventsMixin,
    SimHandle,
)
from agents.gpu.sim_events import (
    sim_error as _error,
)
from agents.gpu.sim_mig import SimMigHandle, SimMigMixin
from agents.gpu.sim_model import GpuState, SimGpuModel, gpu_state, utilization_pct

#: XID the driver logs with a double-bit (uncorrectable) ECC error.
XID_DOUBLE_BIT_ECC = 48
#: Energy integration step (s): fine enough that Δenergy/Δt matches the reported power.
_ENERGY_STEP_S = 0.05
#: How long one look at a load marker stands (s): the energy integration asks many times.
_LOAD_LOOK_S = 0.02
#: The stand-in load generator (run as a file: it needs only the standard library).
SIM_LOAD_SCRIPT = Path(__file__).with_name("sim_load.py")
#: ``NVML_MEMORY_LOCATION_*`` value of each location name a fault may use.
_LOCATIONS = {
    "l1_cache": pynvml.NVML_MEMORY_LOCATION_L1_CACHE,
    "l2_cache": pynvml.NVML_MEMORY_LOCATION_L2_CACHE,
    "dram": pynvml.NVML_MEMORY_LOCATION_DRAM,
    "register_file": pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE,
    "sram": pynvml.NVML_MEMORY_LOCATION_SRAM,
}


@dataclass(slots=True)
class _Gpu:
    index: int
    uuid: str
    pci_bus_id: str
    power_limit_mw: int
    locked_clocks_mhz: tuple[int, int] | None = None
    energy_mj: float = 0.0
    energy_t_s: float = 0.0


def _pci_bus_id(index: int) -> str:
    """GPU ``index``'s PCI address: buses 0x18, 0x28, ... 0xF8 of domain 0, then the same
    buses of domain 1, 2, ... A PCI bus number is one byte: 0x18 + 0x10 * i went past it
    from GPU 15 on (``00000000:108:00.0``), longer than NVML's 16-byte legacy bus id, and
    every GPU of a 16-GPU simulated node from the 16th on had no inventory."""
    domain, slot = divmod(index, 15)
    return f"{domain:08X}:{0x18 + 0x10 * slot:02X}:00.0"


class SimNvml(SimEventsMixin, SimMigMixin):
    """``pynvml``-compatible simulated driver for ``gpu_count`` boards.

    ``no_permission`` makes every ``nvmlDeviceSet*`` call raise NO_PERMISSION, as an
    unprivileged agent sees on a real node; ``unsupported`` names functions that raise
    NOT_SUPPORTED (a PCIe card has no NVLink, say) and ``unsupported_by_gpu`` those that do
    on one GPU only (GPU index -> names: a consumer board without power readings or ECC next
    to datacenter ones); ``missing`` names functions that raise
    FUNCTION_NOT_FOUND (an older driver); ``utilization_pct`` pins the load; ``identity``
    (the node name) keeps UUIDs and load distinct between simulated nodes; ``load_dir``
    is where load markers are looked for (see the module docstring); ``mig_no_permission``
    refuses MIG device handles (NO_PERMISSION), as a container without the ``mig/monitor``
    capability sees.
    """

    def __init__(
        self,
        *,
        gpu_count: int = 8,
        seed: int = 0,
        identity: str = "",
        faults: Iterable[FaultSpec] = (),
        clock: Callable[[], float] = time.monotonic,
        no_permission: bool = False,
        unsupported: Iterable[str] = (),
        unsupported_by_gpu: Mapping[int, Iterable[str]] | None = None,
        missing: Iterable[str] = (),
        utilization_pct: int | None = None,
        model: SimGpuModel | None = None,
        load_dir: Path | None = None,
        mig_no_permission: bool = False,
    ) -> None:
        self.model = model or SimGpuModel()
        self.load_dir = load_dir
        self._own_load_dir = False
        self._load_seen: dict[int, tuple[float, bool]] = {}
        self.seed = seed
        # Mixing the node's identity in keeps GPU UUIDs and load traces distinct between
        # simulated nodes that share a seed (the controller keys GPUs by UUID).
        self._key = f"{identity}:{seed}" if identity else str(seed)
        self.faults = tuple(faults)
        self.no_permission = no_permission
        self.mig_no_permission = mig_no_permission
        self.unsupported = frozenset(unsupported)
        self.unsupported_by_gpu = {
            int(gpu): frozenset(names) for gpu, names in (unsupported_by_gpu or {}).items()
        }
        #: Calls failed so far by each ``nvml_error`` fault with ``calls`` (by id: faults
        #: stay in ``self.faults`` for the driver's life, so ids are not reused).
        self._error_calls: dict[int, int] = {}
        self.missing = frozenset(missing)
        self.fixed_utilization_pct = utilization_pct
        self._clock = clock
        self._lock = threading.RLock()
        self._refcount = 0
        self._t0: float | None = None
        rng = random.Random(f"sim-nvml:{self._key}")
        self._gpus = [
            _Gpu(
                index=i,
                uuid=f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}",
                pci_bus_id=_pci_bus_id(i),
                power_limit_mw=self.model.power_limit_default_mw,
            )
            for i in range(gpu_count)
        ]
        self._handles = [SimHandle(i) for i in range(gpu_count)]
        self._released = threading.Event()
        self._mig_mode = [self.model.mig_mode] * gpu_count
        self._events: list[ScheduledEvent] = []
        self._schedule(self.faults)

    def _schedule(self, faults: Iterable[FaultSpec]) -> None:
        events = list(self._events)
        for fault in faults:
            # (event type, event data) the driver delivers for this fault. Like the real
            # driver, an uncorrectable ECC error is both a double-bit ECC event and XID 48;
            # a correctable one is a single-bit ECC event (event data 0 for both kinds).
            due: list[tuple[int, int]] = []
            if fault.kind == "xid":
                due.append((pynvml.nvmlEventTypeXidCriticalError, fault.xid_code))
            elif fault.kind == "ecc":
                if fault.ecc_uncorrected:
                    due.append((pynvml.nvmlEventTypeDoubleBitEccError, 0))
                    due.append((pynvml.nvmlEventTypeXidCriticalError, XID_DOUBLE_BIT_ECC))
                if fault.ecc_corrected:
                    due.append((pynvml.nvmlEventTypeSingleBitEccError, 0))
            for event_type, data in due:
                events.append(ScheduledEvent(len(events), fault.gpu, fault.at_s, event_type, data))
        self._events = sorted(events, key=lambda e: (e.at_s, e.ident))

    def inject(self, fault: FaultSpec) -> FaultSpec:
        """Add a fault while the driver runs, ``fault.at_s`` seconds from now (chaos drills
        on the simulated cluster); returns it with its time on the driver's clock."""
        if not 0 <= fault.gpu < len(self._gpus):
            raise ValueError(f"gpu {fault.gpu} out of range (the node has {len(self._gpus)})")
        with self._lock:
            due = dataclasses.replace(fault, at_s=self.now_s() + fault.at_s)
            self.faults = (*self.faults, due)
            self._schedule([due])
        return due

    # ------------------------------------------------------------------ helpers

    def now_s(self) -> float:
        """Simulated time: seconds since the first ``nvmlInit`` (0 before it)."""
        return 0.0 if self._t0 is None else self._clock() - self._t0

    def _check(self, name: str) -> None:
        if self._refcount <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.missing:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if name in self.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _gpu(self, handle: Any, name: str) -> _Gpu:
        self._check(name)
        if isinstance(handle, SimMigHandle):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a MIG device: see sim_mig
        if not isinstance(handle, SimHandle) or not 0 <= handle.index < len(self._gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._is_lost(handle.index, self.now_s()):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._gpus[handle.index]

    def _due(self, kind: str, gpu: int, t_s: float | None = None) -> list[FaultSpec]:
        t = self.now_s() if t_s is None else t_s
        return [f for f in self.faults if f.kind == kind and f.gpu == gpu and f.at_s <= t]

    def _before_device_call(self, index: int) -> None:
        """Hang or fail like a dying GPU's driver; runs before the driver lock is taken."""
        while not self._released.is_set():
            t_s = self.now_s()
            if not any(t_s < f.at_s + f.duration_s for f in self._due("hang", index, t_s)):
                break
            self._released.wait(0.01)
        for fault in self._due("nvml_error", index):
            if self.now_s() >= fault.at_s + fault.duration_s:
                continue  # the GPU answers again
            calls = fault.value("calls")
            if calls:
                with self._lock:
                    done = self._error_calls.get(id(fault), 0)
                    if done >= calls:
                        continue  # a transient error: over after its first ``calls`` calls
                    self._error_calls[id(fault)] = done + 1
            raise _error(fault.value("code"))

    def _unsupported_on(self, index: int, name: str) -> bool:
        """``name`` answers NOT_SUPPORTED on this GPU (a lost GPU says it is lost instead)."""
        return name in self.unsupported_by_gpu.get(index, ()) and not self._is_lost(
            index, self.now_s()
        )

    def _ecc_due(self, gpu: int, counter_type: int) -> list[FaultSpec]:
        """The ECC faults a counter still counts: volatile counters those since the last
        ``reset``, aggregate ones those since the last ``reset`` with ``aggregate=1``."""
        since = max(
            (
                f.at_s
                for f in self._due("reset", gpu)
                if counter_type == pynvml.NVML_VOLATILE_ECC or f.value("aggregate")
            ),
            default=-math.inf,
        )
        return [f for f in self._due("ecc", gpu) if f.at_s >= since]

    def release_hangs(self) -> None:
        """End every simulated hang now (also done by the last ``nvmlShutdown``)."""
        self._released.set()

    def _is_lost(self, gpu: int, t_s: float) -> bool:
        return any(f.kind == "lost" and f.gpu == gpu and t_s >= f.at_s for f in self.faults)

    def _thermal_elapsed(self, gpu: int, t_s: float) -> float | None:
        for f in self.faults:
            if f.kind == "thermal" and f.gpu == gpu and f.at_s <= t_s < f.at_s + f.duration_s:
                return t_s - f.at_s
        return None

    def _loaded(self, index: int) -> bool:
        """Whether a live load generator names GPU ``index`` in ``load_dir`` now."""
        if self.load_dir is None:
            return False
        now = time.monotonic()
        seen = self._load_seen.get(index)
        if seen is not None and now - seen[0] < _LOAD_LOOK_S:
            return seen[1]
        try:
            pid = int((self.load_dir / f"gpu{index}.pid").read_text().strip() or 0)
            loaded = pid > 0
            if loaded:
                os.kill(pid, 0)
        except (OSError, ValueError):
            loaded = False
        self._load_seen[index] = (now, loaded)
        return loaded

    def sim_load_command(self) -> list[str]:
        """The stand-in load generator's command for this driver (``{index}`` and
        ``{seconds}`` are filled per GPU); makes ``load_dir`` if there is none yet."""
        if self.load_dir is None:
            self.load_dir = Path(tempfile.mkdtemp(prefix="trainguard-sim-load-"))
            self._own_load_dir = True
        return [
            sys.executable, str(SIM_LOAD_SCRIPT), "--dir", str(self.load_dir),
            "--gpu", "{index}", "--seconds", "{seconds}",
        ]  # fmt: skip

    def _slowdown(self, index: int, t_s: float) -> tuple[int | None, int]:
        """The clock cap and reason bits of the due ``slowdown`` faults."""
        due = self._due("slowdown", index, t_s)
        caps = [f.value("mhz") for f in due if f.value("mhz") > 0]
        mask = 0
        for f in due:
            if f.value("hw"):
                mask |= pynvml.nvmlClocksEventReasonHwSlowdown
            if f.value("brake"):
                mask |= pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        return (min(caps) if caps else None), mask

    def _state(self, gpu: _Gpu, t_s: float) -> GpuState:
        util = self.fixed_utilization_pct
        if self._loaded(gpu.index):
            util = 100
        elif util is None:
            util = utilization_pct(self.model, seed=self._key, gpu=gpu.index, t_s=t_s)
        locked = gpu.locked_clocks_mhz[1] if gpu.locked_clocks_mhz else None
        slowdown_mhz, slowdown_reasons = self._slowdown(gpu.index, t_s)
        return gpu_state(
            self.model,
            utilization=util,
            power_limit_w=gpu.power_limit_mw / 1000.0,
            locked_max_mhz=locked,
            thermal_elapsed_s=self._thermal_elapsed(gpu.index, t_s),
            seed=self._key,
            gpu=gpu.index,
            t_s=t_s,
            slowdown_mhz=slowdown_mhz,
            slowdown_reasons=slowdown_reasons,
        )

    def _advance_energy(self, gpu: _Gpu, t_s: float) -> None:
        """Integrate power up to ``t_s`` (left Riemann sum on a fine grid); the counter
        starts again from 0 at each due ``reset`` (NVML counts since the driver loaded)."""
        t = gpu.energy_t_s
        resets = sorted(
            f.at_s for f in self._due("reset", gpu.index, t_s) if f.at_s >= gpu.energy_t_s
        )
        for end, reset in [*((r, True) for r in resets), (t_s, False)]:
            while t < end:
                step = min(_ENERGY_STEP_S, end - t)
                gpu.energy_mj += self._state(gpu, t).power_w * step * 1000.0
                t += step
            if reset:
                gpu.energy_mj = 0.0
        gpu.energy_t_s = max(gpu.energy_t_s, t_s)

    def _setter(self, handle: Any, name: str) -> _Gpu:
        gpu = self._gpu(handle, name)
        if self.no_permission:
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        # Settings change power from now on; bank the energy drawn under the old ones.
        self._advance_energy(gpu, self.now_s())
        return gpu

    # ------------------------------------------------------------------ library

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            if self._t0 is None:
                self._t0 = self._clock()
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._check("nvmlShutdown")
            self._refcount -= 1
            if self._refcount == 0:
                self.release_hangs()
                if self._own_load_dir and self.load_dir is not None:
                    shutil.rmtree(self.load_dir, ignore_errors=True)
                    self.load_dir, self._own_load_dir = None, False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "sim-550.54.15"

    @property
    def gpu_count(self) -> int:
        """How many boards the simulated node has (never fails, unlike the NVML call)."""
        return len(self._gpus)

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._handles):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # Like the driver: a GPU that is hanging, failing or off the bus fails here too.
        self._before_device_call(index)
        if self._is_lost(index, self.now_s()):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._handles[index]

    # ------------------------------------------------------------------ identity

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetIndex").index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, SimMigHandle):
            return self._mig_device_uuid(handle)
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._gpu(handle, "nvmlDeviceGetName")
        return self.model.name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id.encode()
        info.domain, info.bus, info.device = 0, 0x18 + 0x10 * gpu.index, 0
        info.pciDeviceId = 0x233010DE
        return info

    # ------------------------------------------------------------------ power

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetPowerUsage")
            return int(self._state(gpu, self.now_s()).power_w * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
            self._advance_energy(gpu, self.now_s())
            return int(gpu.energy_mj)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerManagementLimit").power_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> list[int]:
        self._gpu(handle, "nvmlDeviceGetPowerManagementLimitConstraints")
        return [self.model.power_limit_min_mw, self.model.power_limit_max_mw]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetPowerManagementDefaultLimit")
        return self.model.power_limit_default_mw

    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, limit: int) -> None:
        with self._lock:
            gpu = self._setter(handle, "nvmlDeviceSetPowerManagementLimit")
            if not self.model.power_limit_min_mw <= limit <= self.model.power_limit_max_mw:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gpu.power_limit_mw = int(limit)

    # ------------------------------------------------------------------ clocks, thermals

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
            if sensor != pynvml.NVML_TEMPERATURE_GPU:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return int(self._state(gpu, self.now_s()).temperature_c)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        with self._lock:
            gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
            state = self._state(gpu, self.now_s())
            if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
                return state.sm_clock_mhz
            if type == pynvml.NVML_CLOCK_MEM:
                return state.mem_clock_mhz
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:
        self._gpu(handle, "nvmlDeviceGetMaxClockInfo")
        if type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return self.model.sm_clock_max_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return self.model.mem_clock_max_mhz
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceSetGpuLockedClocks(
        self, handle: Any, minGpuClockMHz: int, maxGpuClockMHz: int
    ) -> None:
        with self._lock:
            gpu = self._setter(handle, "nvmlDeviceSetGpuLockedClocks")
            if not 0 < minGpuClockMHz <= maxGpuClockMHz:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            top = min(maxGpuClockMHz, self.model.sm_clock_max_mhz)
            gpu.locked_clocks_mhz = (min(minGpuClockMHz, top), top)

    def nvmlDeviceResetGpuLockedClocks(self, handle: Any) -> None:
        with self._lock:
            self._setter(handle, "nvmlDeviceResetGpuLockedClocks").locked_clocks_mhz = None

    def _clock_reasons(self, handle: Any, name: str) -> int:
        with self._lock:
            return self._state(self._gpu(handle, name), self.now_s()).throttle_mask

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._clock_reasons(handle, "nvmlDeviceGetCurrentClocksEventReasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._clock_reasons(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        with self._lock:
            state = self._state(self._gpu(handle, "nvmlDeviceGetUtilizationRates"), self.now_s())
            return pynvml.c_nvmlUtilization_t(
                gpu=state.utilization_gpu_pct, memory=state.utilization_mem_pct
            )

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        with self._lock:
            state = self._state(self._gpu(handle, "nvmlDeviceGetMemoryInfo"), self.now_s())
            total = self.model.memory_total_bytes
            used = state.memory_used_bytes
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    # ------------------------------------------------------------------ health counters

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        if counterType not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        due = self._ecc_due(gpu.index, counterType)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return sum(f.ecc_corrected for f in due)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return sum(f.ecc_uncorrected for f in due)
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _pcie(self, gpu: int, key: str, best: int) -> int:
        """The link as trained now: the lowest value a due ``pcie`` fault set, else ``best``."""
        values = [f.value(key) for f in self._due("pcie", gpu) if f.value(key) > 0]
        return min([best, *values])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrPcieLinkGeneration")
        return self._pcie(gpu.index, "gen", self.model.pcie_gen_max)

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrPcieLinkWidth")
        return self._pcie(gpu.index, "width", self.model.pcie_width_max)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")
        return sum(f.value("replay") for f in self._due("pcie", gpu.index))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetMaxPcieLinkGeneration")
        return self.model.pcie_gen_max

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetMaxPcieLinkWidth")
        return self.model.pcie_width_max

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        self._gpu(device, "nvmlDeviceGetNvLinkState")
        if not 0 <= link < pynvml.NVML_NVLINK_MAX_LINKS:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if link >= self.model.nvlink_count:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        faults = self._link_faults(device.index, link)
        if any(f.value("down") for f in faults):
            return int(pynvml.NVML_FEATURE_DISABLED)
        return int(pynvml.NVML_FEATURE_ENABLED)

    def _link_faults(self, gpu: int, link: int) -> list[FaultSpec]:
        return [f for f in self._due("nvlink", gpu) if f.value("link") == link]

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        self.nvmlDeviceGetNvLinkState(device, link)
        if not 0 <= counter < pynvml.NVML_NVLINK_ERROR_COUNT:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        key = {
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc",
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
            pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
        }.get(counter)
        if key is None:
            return 0  # CRC data and ECC data stay 0: "crc" counts flit errors
        return sum(f.value(key) for f in self._link_faults(device.index, link))

    # ------------------------------------------------------------------ pre-failure signals

    def nvmlDeviceGetMemoryErrorCounter(
        self, handle: Any, errorType: int, counterType: int, locationType: int
    ) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryErrorCounter")
        if counterType not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        names = [n for n, v in _LOCATIONS.items() if v == locationType]
        if not names or names[0] not in self.model.ecc_locations:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        due = [f for f in self._ecc_due(gpu.index, counterType) if f.ecc_location == names[0]]
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return sum(f.ecc_corrected for f in due)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return sum(f.ecc_uncorrected for f in due)
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPages")
        if not self.model.page_retirement:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "sbe",
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "dbe",
        }.get(sourceFilter)
        if key is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = sum(f.value(key) for f in self._due("retire", gpu.index))
        return [0x1000 * (i + 1) for i in range(count)]  # page addresses, as pynvml returns

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        if not self.model.page_retirement:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(any(f.value("pending") for f in self._due("retire", gpu.index)))

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(device, "nvmlDeviceGetRemappedRows")
        if not self.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        due = self._due("remap", gpu.index)
        return (
            sum(f.value("correctable") for f in due),
            sum(f.value("uncorrectable") for f in due),
            int(any(f.value("pending") for f in due)),
            int(any(f.value("failed") for f in due)),
        )

    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetGpuFabricInfo")
        if not self.model.fabric_supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        due = self._due("fabric", gpu.index)
        gpuFabricInfo.state = (
            due[-1].value("state") if due else pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        )
        gpuFabricInfo.status = due[-1].value("status") if due else pynvml.NVML_SUCCESS
        gpuFabricInfo.cliqueId = 1
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetMigMode")
        return [self._mig_mode[gpu.index], self._mig_mode[gpu.index]]


def _device_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: SimNvml, *args: Any, **kwargs: Any) -> Any:
        handle = args[0] if args else next(iter(kwargs.values()), None)
        # A MIG device is part of its parent: the parent's hang or error is its own too.
        index = handle.parent if isinstance(handle, SimMigHandle) else None
        if isinstance(handle, SimHandle):
            index = handle.index
        if index is not None:
            self._before_device_call(index)
            if self._unsupported_on(index, fn.__name__):
                raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return fn(self, *args, **kwargs)

    return call


# Every per-device call can hang or fail through a fault; enumeration calls cannot.
for _name in dir(SimNvml):
    if _name.startswith("nvmlDevice") and _name not in (
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
    ):
        setattr(SimNvml, _name, _device_call(getattr(SimNvml, _name)))


def sim_nvml_function_names() -> list[str]:
    """Every pynvml-named function the simulator implements (pinned by a test)."""
    return sorted(n for n in dir(SimNvml) if n.startswith("nvml") and callable(getattr(SimNvml, n)))


__all__ = [
    "SIM_LOAD_SCRIPT",
    "XID_DOUBLE_BIT_ECC",
    "SimEventData",
    "SimEventSet",
    "SimHandle",
    "SimMigHandle",
    "SimNvml",
    "sim_nvml_function_names",
]
