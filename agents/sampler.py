"""Reading every ``wire.GpuSample`` field from an NVML-like API.

The sampler asks the driver field by field, so one refusal costs one field, not the
sample: NOT_SUPPORTED (a PCIe card has no NVLink) becomes ``None`` silently, any other
NVML error becomes ``None`` with one log line per (GPU, field, error). GPU_IS_LOST ends the
GPU's sample with ``lost=True``, which the daemon treats as urgent. An answer the wire
refuses (an ECC total of 2^64-1, a power of -1 mW) is a refusal too: that field is null,
named in the sample's ``error`` and one warning line per (GPU, field). So is a reading no GPU
can give (``PLAUSIBLE_MAX``): NVML's "unknown" sentinels (0xFFFFFFFF for power, limit or
temperature, 2^64-1 for energy) would otherwise read as 4.3 MW or 4e9 C and enter node power.

Counters are read in the scope that answers "did it change since driver load": volatile ECC
totals and NVLink error counters per link (and summed) over the links found active at start;
the pre-failure signals (aggregate and per-location ECC, retired pages, row remapping, PCIe
replays, fabric, MIG) come from :mod:`agents.gpu_health`.

Each GPU is read on a worker thread of its own, and the sampler waits at most
``timeout_s`` for all of them. A GPU whose reads did not finish in time (a dying GPU can
hang inside the driver) is reported ``unknown`` and skipped until its stuck call returns,
so one hung GPU never stops the heartbeat, and an unexpected exception on one GPU costs
that GPU's sample only (partial failure is data, not a crash).

A GPU none of whose reads answers, sample after sample, is ``unreachable``: every read
failed with an error other than NOT_SUPPORTED (NVML_ERROR_UNKNOWN on everything is, with
GPU_IS_LOST, the classic sign of a GPU that fell off the bus or a wedged driver). Field by
field that is only nulls with an ``error``, which says nothing is wrong with the GPU; so
after ``unreachable_after`` such samples in a row the sample says ``unreachable=True`` (the
controller opens a ``gpu_unreachable`` incident), until one read answers again. One failed
sample is not enough (a driver call can fail during a reset or a GSP retry), and a GPU whose
fields are only NOT_SUPPORTED (vGPU, MIG) never qualifies: not supported is an answer.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml
from pydantic import Field, ValidationError

from agents.gpu_health import (
    GpuTransitions,
    ecc_locations_present,
    read_links_and_fabric,
    read_memory_health,
    trim_for_wire,
)
from trainguard.wire import GpuInfo, GpuSample, HardwareEvent, XidEvent, decode_throttle_reasons

log = logging.getLogger(__name__)

#: Default longest wait for one tick's NVML reads of all GPUs (s).
DEFAULT_TIMEOUT_S = 1.0
#: Samples in a row in which no read of a GPU answered before it is reported unreachable.
#: Five at the default 1 s cadence is one report interval: longer than the second or two a
#: driver reset or a GSP retry makes every call fail, far shorter than a job's NCCL timeout.
DEFAULT_UNREACHABLE_AFTER = 5
#: The inventory at start may take this many sampling timeouts (it asks more questions).
OPEN_TIMEOUT_FACTOR = 5
#: MIG slots asked per GPU at most: NVML says 7 on an A100 or H100; a garbled count
#: (0xFFFFFFFF) must not turn one GPU's inventory into four billion calls.
MAX_MIG_SLOTS = 64
#: The "error code" under which an out-of-range field's warning is remembered (not NVML's).
_OUT_OF_RANGE = -1
#: Above these a sample field is not a reading (NVML's "unknown" sentinels are far above):
#: it is reported null and named in the sample's error, like a value the wire refuses.
PLAUSIBLE_MAX: dict[str, float] = {
    "power_w": 10_000.0,
    "power_limit_w": 10_000.0,
    "temperature_c": 200.0,
    # 10 kW for 300 years; 2^64-1 mJ ("unknown") is 1.8e16 J.
    "energy_j": 1e14,
    # For a board whose maximum NVML did not give; else CLOCK_MARGIN above its maximum.
    "sm_clock_mhz": 10_000.0,
    "mem_clock_mhz": 100_000.0,
}
#: The clock-event mask bits the wire carries: all but bit 63 (NVML's "unknown reason").
THROTTLE_MASK_BITS = 0x7FFF_FFFF_FFFF_FFFF
#: A clock this far above the board's own maximum (``nvmlDeviceGetMaxClockInfo``) is no
#: reading either (0xFFFF, a garbled register), while a few percent of boost above it is.
CLOCK_MARGIN = 1.1
#: At or below these a sample field is not a reading: a powered GPU at 0 °C is a sensor
#: that did not answer (NVML then says 0), not a cold board; a clock of 0 MHz is a clock
#: domain NVML could not read (an idle board still runs its base clock), not a stopped GPU:
#: as a reading it dragged the node's average clock down and read as a throttled GPU.
PLAUSIBLE_MIN_EXCLUSIVE: dict[str, float] = {
    "temperature_c": 0.0,
    "sm_clock_mhz": 0.0,
    "mem_clock_mhz": 0.0,
}


class GpuLostError(Exception):
    """Internal: the driver said NVML_ERROR_GPU_IS_LOST while reading this GPU."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class MigGpuInfo(GpuInfo):
    """A GPU in MIG mode as the agent's own inventory holds it, with its MIG instances.

    A rank on a MIG slice knows only the slice's UUID (``MIG-...``), which no whole GPU has;
    listing the slices here lets the job endpoint tie that rank to this board's power,
    clocks and XIDs instead of keeping CUDA's number (0 in every one-slice pod). Agent-side
    only: both fields are left out of serialization, so a report's ``GpuInfo`` keeps its
    shape for every controller. Read with the rest of the inventory (at start, and when a
    GPU that hung at start answers): a MIG layout changes only by an admin's action.
    """

    #: The UUIDs NVML gives the GPU's MIG instances (``MIG-<8-4-4-4-12>``), in slot order.
    mig_uuids: tuple[str, ...] = Field(default=(), exclude=True)
    #: Why the instances could not all be listed ("" when they were): NO_PERMISSION in a
    #: container without the ``mig/monitor`` capability, NOT_SUPPORTED on some drivers.
    mig_error: str = Field(default="", exclude=True)


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any
    info: GpuInfo
    nvlinks: list[int] = field(default_factory=list)
    #: Links that answered "disabled" at start (a preflight flags them next to active ones).
    nvlinks_down_at_start: list[int] = field(default_factory=list)
    ecc_locations: list[str] = field(default_factory=list)
    #: The first NVML error (other than NOT_SUPPORTED) of the sample being read.
    error: str = ""
    #: How many reads of the sample being read failed with such an error.
    failures: int = 0
    #: How many reads of the sample being read returned a value.
    answered: int = 0
    #: Samples in a row in which reads failed and none answered (see ``unreachable_after``).
    unanswered: int = 0


class _Worker:
    """One daemon thread that runs a GPU's reads, so a hung NVML call blocks only it."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._job: Callable[[], Any] | None = None
        self._done = threading.Event()
        self.result: Any = None
        self.exc: BaseException | None = None
        self.busy_since: float | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> None:
        with self._cond:
            self._job, self.result, self.exc = job, None, None
            self.busy_since = time.monotonic()
            self._done.clear()
            self._cond.notify()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(max(0.0, timeout_s))

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stop:
                    self._cond.wait()
                if self._stop or self._job is None:
                    return
                job: Callable[[], Any] = self._job
                self._job = None
            try:
                self.result = job()
            except BaseException as exc:  # handed to the sampler, which decides
                self.exc = exc
            self.busy_since = None
            self._done.set()


class GpuSampler:
    """Discovers the node's GPUs once, then samples them on demand."""

    def __init__(
        self,
        api: Any,
        *,
        xid_source: Callable[[int], list[XidEvent]] | None = None,
        locked_clock_mhz: Callable[[int], int | None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        unreachable_after: int = DEFAULT_UNREACHABLE_AFTER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self.timeout_s = timeout_s
        self.unreachable_after = max(1, unreachable_after)
        self._clock = clock
        self._workers: dict[int, _Worker] = {}
        #: GPUs whose inventory could not be read at start (they hung or failed).
        self._undiscovered: set[int] = set()
        self._discover_errors: dict[int, BaseException] = {}
        #: Grows when a GPU's inventory changes after ``open`` (the report's identity follows).
        self.inventory_version = 0
        self._transitions = GpuTransitions()
        #: Hardware events (link flaps, PCIe drops, GPUs turning unknown) not yet taken.
        self.events: list[HardwareEvent] = []
        self._xid_source = xid_source
        self._locked_clock_mhz = locked_clock_mhz
        self._on_lost = on_lost
        self._gpus: list[_Gpu] = []
        self._warned: set[tuple[int, str, int]] = set()
        self._reasons = ClockEventReasons(api)
        self.lost: set[int] = set()

    # ------------------------------------------------------------------ discovery

    def open(self) -> list[GpuInfo]:
        """Enumerate GPUs and read their static inventory (names, limits, max clocks).

        Each GPU's inventory is read on its worker; one that does not answer within
        ``OPEN_TIMEOUT_FACTOR`` sampling timeouts keeps a placeholder identity and is
        sampled as unknown until its stuck call returns.
        """
        count = int(self._api.nvmlDeviceGetCount())
        self._gpus = []
        for index in range(count):
            self._workers[index] = worker = _Worker(f"nvml-gpu{index}")
            worker.submit(functools.partial(self._discover, index))
            # Placeholder until the GPU answers: no handle, so nothing is asked of it.
            self._gpus.append(_Gpu(index, None, GpuInfo(index=index, uuid=f"gpu-{index}-unknown")))
        deadline = time.monotonic() + self.timeout_s * OPEN_TIMEOUT_FACTOR
        for i, gpu in enumerate(self._gpus):
            worker = self._workers[gpu.index]
            if worker.wait(deadline - time.monotonic()) and worker.exc is None:
                self._gpus[i] = worker.result
            else:
                self._undiscovered.add(gpu.index)
                if worker.exc is not None:
                    self._discover_errors[gpu.index] = worker.exc
                log.error(
                    "GPU %d: no inventory (%s); it is reported unknown until NVML answers",
                    gpu.index,
                    repr(worker.exc) if worker.exc else "NVML call hung",
                )
        return self.inventory

    def _rediscover(self) -> None:
        """Adopt the inventory of a GPU that hung at start once its reads finish (or retry)."""
        for pos, gpu in enumerate(self._gpus):
            worker = self._workers[gpu.index]
            if gpu.index not in self._undiscovered or worker.busy_since is not None:
                continue
            if isinstance(worker.result, _Gpu) and worker.exc is None:
                self._gpus[pos] = worker.result
                self._undiscovered.discard(gpu.index)
                self._discover_errors.pop(gpu.index, None)
                self.inventory_version += 1
                log.warning("GPU %d answers again: %s", gpu.index, worker.result.info.uuid)
            else:
                if worker.exc is not None:
                    self._discover_errors[gpu.index] = worker.exc
                worker.submit(functools.partial(self._discover, gpu.index))

    def _discover(self, index: int) -> _Gpu:
        # A GPU that fell off the bus fails already here (NVML_ERROR_GPU_IS_LOST).
        handle = self._api.nvmlDeviceGetHandleByIndex(index)
        gpu = _Gpu(index, handle, self._with_mig(index, handle, self._inventory(index, handle)))
        gpu.nvlinks, gpu.nvlinks_down_at_start = self._nvlinks(index, handle)
        gpu.ecc_locations = ecc_locations_present(
            lambda what, fn, *args: self._ask_quietly(index, what, fn, *args), self._api, handle
        )
        return gpu

    def close(self) -> None:
        """Stop the worker threads (one stuck in a hung call ends when the call returns)."""
        for worker in self._workers.values():
            worker.stop()

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

    def _with_mig(self, index: int, handle: Any, info: GpuInfo) -> GpuInfo:
        """``info`` with the GPU's MIG instances when it is in MIG mode (a :class:`MigGpuInfo`).

        Never raises: a board or driver without MIG keeps ``info`` as it is, and a GPU whose
        instances cannot be listed (a non-root container often may not) is kept whole, with
        the reason, so its slices' ranks keep the number they claim.
        """
        api = self._api
        try:
            mode = api.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return info  # no MIG on this board or driver: nothing to list
            return self._mig_refused(index, info, [], f"MIG mode: {exc}")
        except Exception as exc:  # the inventory never fails over MIG
            return self._mig_refused(index, info, [], f"MIG mode: {exc!r}")
        try:
            if int(mode[0]) != pynvml.NVML_DEVICE_MIG_ENABLE:
                return info
        except (TypeError, ValueError, IndexError):
            return self._mig_refused(index, info, [], f"MIG mode: unreadable answer {mode!r}")
        uuids: list[str] = []
        try:
            slots = min(int(api.nvmlDeviceGetMaxMigDeviceCount(handle)), MAX_MIG_SLOTS)
            for slot in range(slots):
                try:
                    mig = api.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError as exc:
                    if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                        continue  # an empty slot: no instance was created there
                    raise
                uuids.append(_text(api.nvmlDeviceGetUUID(mig))[:128])
        except Exception as exc:  # NO_PERMISSION, NOT_SUPPORTED, or anything else
            shown = str(exc) if isinstance(exc, pynvml.NVMLError) else repr(exc)
            return self._mig_refused(index, info, uuids, f"MIG instances: {shown}")
        log.info("GPU %d: MIG mode, %d instance(s): %s", index, len(uuids), ", ".join(uuids) or "-")
        return MigGpuInfo(**info.model_dump(), mig_uuids=tuple(uuids))

    def _mig_refused(self, index: int, info: GpuInfo, uuids: list[str], why: str) -> GpuInfo:
        log.warning(
            "GPU %d: cannot list its MIG instances (%s); ranks on its MIG slices keep the GPU "
            "number they claim (run the agent with the mig/monitor capability or as root)",
            index,
            why,
        )
        return MigGpuInfo(**info.model_dump(), mig_uuids=tuple(uuids), mig_error=why[:512])

    def _nvlinks(self, index: int, handle: Any) -> tuple[list[int], list[int]]:
        """(links up, links that exist but are down) at start."""
        up: list[int] = []
        down: list[int] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = self._api.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError:
                continue  # NOT_SUPPORTED / INVALID_ARGUMENT past the last link
            (up if state == pynvml.NVML_FEATURE_ENABLED else down).append(link)
        return up, down

    def nvlinks_down_at_start(self, index: int) -> list[int]:
        return next((g.nvlinks_down_at_start for g in self._gpus if g.index == index), [])

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
            value = fn(*args)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError from None
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            if not gpu.error:
                gpu.error = f"{what}: {exc}"[:512]
            gpu.failures += 1
            key = (gpu.index, what, int(exc.value))
            if key not in self._warned:
                self._warned.add(key)
                log.warning("GPU %d: %s unavailable (%s); reporting null", gpu.index, what, exc)
            return None
        gpu.answered += 1
        return value

    def take_events(self) -> list[HardwareEvent]:
        events, self.events = self.events, []
        return events

    def sample(self) -> list[GpuSample]:
        """One sample per GPU, read in parallel; never raises for a driver error or hang."""
        now = self._clock()
        if self._undiscovered:
            self._rediscover()
        started: list[_Gpu] = []
        for gpu in self._gpus:
            worker = self._workers[gpu.index]
            if worker.busy_since is None:
                worker.submit(functools.partial(self._sample_one, gpu))
                started.append(gpu)
        deadline = time.monotonic() + self.timeout_s
        out = []
        for gpu in self._gpus:
            worker = self._workers[gpu.index]
            xids = self._xid_source(gpu.index) if self._xid_source else []
            sample = self._collect(gpu, worker, gpu in started, deadline)
            sample.xid_events = xids[-1024:]
            self.events.extend(self._transitions.update(sample, now))
            trim_for_wire(sample)
            out.append(sample)
        return out

    def _collect(self, gpu: _Gpu, worker: _Worker, started: bool, deadline: float) -> GpuSample:
        exc = self._discover_errors.get(gpu.index)
        if gpu.index in self._undiscovered and exc is not None:
            # Its last discovery failed outright (it did not hang); a retry is under way.
            if isinstance(exc, pynvml.NVMLError) and exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                return self._lost(gpu)
            return GpuSample(
                index=gpu.index,
                uuid=gpu.info.uuid,
                unknown=True,
                error=f"no inventory: {_describe(exc)}"[:512],
            )
        if not started or not worker.wait(deadline - time.monotonic()):
            stuck_s = time.monotonic() - (worker.busy_since or time.monotonic())
            return GpuSample(
                index=gpu.index,
                uuid=gpu.info.uuid,
                unknown=True,
                error=f"NVML did not answer within {self.timeout_s:g} s "
                f"(a call has been stuck for {stuck_s:.1f} s)",
            )
        if isinstance(worker.exc, GpuLostError):
            return self._lost(gpu)
        if worker.exc is not None:
            log.error("GPU %d: sampling failed: %r", gpu.index, worker.exc)
            return GpuSample(
                index=gpu.index,
                uuid=gpu.info.uuid,
                unknown=True,
                error=f"sampling failed: {worker.exc!r}"[:512],
            )
        sample: GpuSample = worker.result
        if gpu.index in self.lost:
            self.lost.discard(gpu.index)
            log.warning("GPU %d answers again", gpu.index)
        return sample

    def _lost(self, gpu: _Gpu) -> GpuSample:
        if gpu.index not in self.lost:
            self.lost.add(gpu.index)
            log.error("GPU %d (%s) is lost (NVML_ERROR_GPU_IS_LOST)", gpu.index, gpu.info.uuid)
            if self._on_lost is not None:
                self._on_lost(gpu.index)
        return GpuSample(index=gpu.index, uuid=gpu.info.uuid, lost=True)

    def _sample_one(self, gpu: _Gpu) -> GpuSample:
        """Read one GPU's sample, then judge whether it still answers at all."""
        return self._judge_reachable(gpu, self._read_one(gpu))

    def _judge_reachable(self, gpu: _Gpu, sample: GpuSample) -> GpuSample:
        """Mark ``sample`` unreachable once ``unreachable_after`` samples in a row had failed
        reads and no answered one (see the module note); the first answer clears it."""
        if gpu.answered or not gpu.failures:
            if gpu.unanswered >= self.unreachable_after:
                log.warning("GPU %d answers NVML reads again", gpu.index)
            gpu.unanswered = 0
            return sample
        gpu.unanswered += 1
        if gpu.unanswered < self.unreachable_after:
            return sample
        if gpu.unanswered == self.unreachable_after:
            log.error(
                "GPU %d (%s): no NVML read answered in %d samples in a row (%s); "
                "reporting it unreachable",
                gpu.index,
                gpu.info.uuid,
                gpu.unanswered,
                gpu.error,
            )
        sample.unreachable = True
        sample.error = (
            f"unreachable: no NVML read answered in {self.unreachable_after} samples "
            f"in a row; {gpu.error}"
        )[:512]
        return sample

    def _read_one(self, gpu: _Gpu) -> GpuSample:
        gpu.error, gpu.failures, gpu.answered = "", 0, 0
        api, h, ask = self._api, gpu.handle, self._ask
        power_mw = ask(gpu, "power", api.nvmlDeviceGetPowerUsage, h)
        energy_mj = ask(gpu, "energy", api.nvmlDeviceGetTotalEnergyConsumption, h)
        limit_mw = ask(gpu, "power limit", api.nvmlDeviceGetEnforcedPowerLimit, h)
        temp = ask(gpu, "temperature", api.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        sm = ask(gpu, "sm clock", api.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        mem = ask(gpu, "memory clock", api.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM)
        util = ask(gpu, "utilization", api.nvmlDeviceGetUtilizationRates, h)
        memory = ask(gpu, "memory", api.nvmlDeviceGetMemoryInfo, h)
        mask = ask(gpu, "throttle reasons", self._reasons.read, h)
        # Bit 63 is NVML's ``nvmlClocksThrottleReasonUnknown`` (older headers: "some other
        # unspecified factor"); the wire's mask is a signed 64-bit column, so keeping it would
        # cost the whole mask (reported 0, "out of range") and hide the bits that are known.
        mask = int(mask or 0) & THROTTLE_MASK_BITS
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

        def health_ask(what: str, fn: Callable[..., Any], *args: Any) -> Any:
            return ask(gpu, what, fn, *args)

        pcie = {
            name: ask(gpu, name, fn, h)
            for name, fn in (
                ("pcie_link_gen", api.nvmlDeviceGetCurrPcieLinkGeneration),
                ("pcie_link_width", api.nvmlDeviceGetCurrPcieLinkWidth),
                ("pcie_link_gen_max", api.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_link_width_max", api.nvmlDeviceGetMaxPcieLinkWidth),
            )
        }
        return self._build(
            gpu,
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
            # Not clamped to 100: a percentage above 100 is no reading (0xFFFFFFFF would have
            # read as a fully busy GPU); the wire refuses it and _build reports it null.
            utilization_gpu_pct=float(util.gpu) if util is not None else None,
            utilization_mem_pct=float(util.memory) if util is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            throttle_reasons_mask=mask,
            throttle_reasons=decode_throttle_reasons(mask),
            ecc_corrected_total=_int_or_none(ecc["corrected"]),
            ecc_uncorrected_total=_int_or_none(ecc["uncorrected"]),
            **{k: _int_or_none(v) for k, v in pcie.items()},
            **read_memory_health(health_ask, api, h, gpu.ecc_locations),
            **read_links_and_fabric(health_ask, api, h, gpu.nvlinks, failures=lambda: gpu.failures),
        )

    def _build(self, gpu: _Gpu, **fields: Any) -> GpuSample:
        """The sample, where a value that is no reading costs that field only.

        Two kinds of such value, each asked once: a float above what the hardware can give
        (``PLAUSIBLE_MAX``; NVML's "unknown" sentinels) is refused before validating, and a
        value the wire refuses (an ECC total of 2^64-1, a power of -1 mW) is refused when
        validation names it. Either is reported null (its default), named in the sample's
        ``error`` when it has none yet and in one warning line per (GPU, field), like an
        NVML refusal -- the rest of the sample stands.
        """
        most = dict(PLAUSIBLE_MAX)
        for name, board_max in (
            ("sm_clock_mhz", gpu.info.sm_clock_max_mhz),
            ("mem_clock_mhz", gpu.info.mem_clock_max_mhz),
        ):
            if board_max:
                most[name] = board_max * CLOCK_MARGIN
        # Clocks are ints: they are checked here too (a clock of 0xFFFF MHz used to be
        # reported as a reading), and so is the floor of a temperature (0 °C: no reading).
        implausible = sorted(
            name
            for name, value in fields.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and (
                (name in most and not value <= most[name])
                or (name in PLAUSIBLE_MIN_EXCLUSIVE and not value > PLAUSIBLE_MIN_EXCLUSIVE[name])
            )
        )
        if implausible:
            self._refuse(gpu, fields, implausible)
        for _ in range(4):  # a refused field is replaced by its default, which validates
            try:
                return GpuSample(**fields, error=gpu.error)
            except ValidationError as exc:
                bad = sorted(
                    {str(e["loc"][0]) for e in exc.errors() if e["loc"]} & set(fields) - {"index"}
                )
                if not bad:
                    raise
                self._refuse(gpu, fields, bad)
        return GpuSample(**fields, error=gpu.error)

    def _refuse(self, gpu: _Gpu, fields: dict[str, Any], names: list[str]) -> None:
        """Report ``names`` null: their defaults in ``fields``, the first refusal in
        ``gpu.error``, one warning per (GPU, field)."""
        shown = ", ".join(f"{name}={fields[name]!r}"[:80] for name in names)
        if not gpu.error:
            gpu.error = f"out of range: {shown}"[:512]
        for name in names:
            key = (gpu.index, name, _OUT_OF_RANGE)
            if key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "GPU %d: %s=%r out of range; reporting null", gpu.index, name, fields[name]
                )
            fields[name] = GpuSample.model_fields[name].get_default(call_default_factory=True)


class ClockEventReasons:
    """Reads a GPU's clock-event reasons mask (``nvmlDeviceGetCurrentClocksEventReasons``);
    drivers before r535 only have the older "throttle" name, which is asked instead from the
    first time the new one is missing. Any other NVML error is the caller's."""

    def __init__(self, api: Any) -> None:
        self._api = api
        #: The driver has no ``...ClocksEventReasons``: only ``...ThrottleReasons`` is asked.
        self.uses_throttle_name = False

    def read(self, handle: Any) -> Any:
        if not self.uses_throttle_name:
            try:
                return self._api.nvmlDeviceGetCurrentClocksEventReasons(handle)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                self.uses_throttle_name = True
        return self._api.nvmlDeviceGetCurrentClocksThrottleReasons(handle)


def _describe(exc: BaseException) -> str:
    """NVML's own text for its errors ("Unknown Error"), the repr for anything else."""
    return str(exc) if isinstance(exc, pynvml.NVMLError) else repr(exc)


def _int_or_none(value: Any) -> int | None:
    """An integer, or ``None`` for no answer or one that is not a number (the range is the
    wire's to check, field by field, in ``GpuSampler._build``)."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


__all__ = ["MAX_MIG_SLOTS", "ClockEventReasons", "GpuLostError", "GpuSampler", "MigGpuInfo"]
