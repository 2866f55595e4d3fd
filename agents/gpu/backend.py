"""Choosing the GPU backend: the real ``pynvml`` module or, only when asked, the simulator.

Both are used through the same attribute names (``api.nvmlDeviceGetPowerUsage(h)``), so
the rest of the agent never knows which one it holds. The rule is *never pretend*: a node
whose driver broke must not show up as eight healthy GPUs. So:

``auto``
    NVML when ``nvmlInit`` works. When it does not, the NVIDIA device files decide: a node
    without ``/dev/nvidia*`` has no GPUs and reports zero of them (healthy); a node *with*
    them has GPUs the agent cannot watch, so the backend carries the NVML error, the report
    says so (``NodeIdentity.gpu_error``) and the controller marks the node unhealthy.
``nvml``
    As ``auto``, except that a node without device files is a configuration error (exit 2).
``sim:N``
    N simulated GPUs; the only way to get simulated GPUs. Reports say ``backend: sim``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pynvml

from agents.errors import AgentConfigError, BackendUnavailableError
from agents.gpu.faults import FaultSpec, parse_fault_specs
from agents.gpu.sim import SimNvml

log = logging.getLogger(__name__)

_SIM_RE = re.compile(r"^sim:(\d+)$")
#: Upper bound for simulated GPUs per node (``wire.NodeSample.gpus`` holds at most 64).
MAX_SIM_GPUS = 64
#: Where the NVIDIA driver's device files live (tests point this at a temporary folder).
DEFAULT_DEV_DIR = Path("/dev")


@dataclass(kw_only=True, slots=True)
class GpuBackend:
    """An initialised NVML-like API plus what the report should say about it.

    ``error`` is set when NVML failed on a node that has NVIDIA devices: ``api`` then
    answers zero GPUs and the node reports itself unhealthy with that text.
    """

    api: Any
    kind: Literal["nvml", "sim"]
    driver_version: str = ""
    error: str = ""
    #: With ``error``: the NVML module whose ``nvmlInit`` failed, for :func:`retry_nvml`.
    nvml: Any = None

    def shutdown(self) -> None:
        try:
            self.api.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


class NoGpus:
    """The NVML surface of a node with no usable GPU: zero devices, nothing to watch.

    Used for a node without NVIDIA devices (true: it has none) and for a node whose NVML
    failed (then the backend's ``error`` says why the count is zero).
    """

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return 0

    def nvmlEventSetCreate(self) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)


def nvidia_device_files(dev_dir: Path = DEFAULT_DEV_DIR) -> list[str]:
    """Names of the NVIDIA driver's device files (``nvidia0``, ``nvidiactl``, ...)."""
    try:
        return sorted(p.name for p in dev_dir.iterdir() if p.name.startswith("nvidia"))
    except OSError:
        return []


def parse_gpus_setting(value: str) -> tuple[Literal["auto", "nvml", "sim"], int]:
    """Validate ``auto`` | ``nvml`` | ``sim:N``; returns (mode, N) with N=0 unless sim."""
    text = value.strip().lower()
    if text in ("auto", "nvml"):
        return ("auto" if text == "auto" else "nvml"), 0
    match = _SIM_RE.match(text)
    if not match:
        raise AgentConfigError(f"gpus={value!r}: expected 'auto', 'nvml' or 'sim:N' (e.g. sim:8)")
    count = int(match.group(1))
    if not 1 <= count <= MAX_SIM_GPUS:
        raise AgentConfigError(f"gpus={value!r}: N must be between 1 and {MAX_SIM_GPUS}")
    return "sim", count


def _counted(backend: GpuBackend, *, nvml: Any = None) -> GpuBackend:
    """``backend`` when it can count its GPUs; else one that says why none is watched.

    A driver that initialises but fails ``nvmlDeviceGetCount`` is a failed ``nvmlInit`` on
    a node with GPUs: the node is reported unhealthy (``error``) and, for the real driver
    (``nvml``), NVML is retried. Checked here so that every caller of :func:`open_backend`
    and :func:`retry_nvml` (the agent, ``trainguard preflight --local``) gets it.
    """
    try:
        backend.api.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        error = (
            f"NVML initialised but cannot count the GPUs (nvmlDeviceGetCount: {exc}); "
            "check the driver with nvidia-smi"
        )[:512]
        log.error("%s; reporting this node unhealthy", error)
        backend.shutdown()
        return GpuBackend(api=NoGpus(), kind=backend.kind, error=error, nvml=nvml)
    return backend


def _open_nvml(nvml: Any) -> GpuBackend:
    nvml.nvmlInit()
    try:
        driver = str(nvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        driver = ""
    return _counted(GpuBackend(api=nvml, kind="nvml", driver_version=driver), nvml=nvml)


def _open_sim(
    count: int, *, faults: Sequence[FaultSpec], seed: int, no_permission: bool, identity: str
) -> GpuBackend:
    api = SimNvml(
        gpu_count=count, seed=seed, identity=identity, faults=faults, no_permission=no_permission
    )
    api.nvmlInit()
    # A simulated driver is never initialised again: no ``nvml`` to retry.
    return _counted(
        GpuBackend(api=api, kind="sim", driver_version=api.nvmlSystemGetDriverVersion())
    )


def open_backend(
    gpus: str,
    *,
    fault_specs: Sequence[str] = (),
    seed: int = 0,
    sim_no_permission: bool = False,
    identity: str = "",
    dev_dir: Path = DEFAULT_DEV_DIR,
    nvml: Any = pynvml,
) -> GpuBackend:
    """Initialise the backend named by the ``gpus`` setting (see module docstring).

    ``identity`` (the node name) makes simulated GPU UUIDs unique per simulated node;
    ``nvml`` is the module to initialise (the real ``pynvml``; tests may hand in a
    simulated driver to exercise this choice).
    """
    mode, count = parse_gpus_setting(gpus)
    if mode == "sim":
        faults = parse_fault_specs(fault_specs, gpu_count=count)
        return _open_sim(
            count, faults=faults, seed=seed, no_permission=sim_no_permission, identity=identity
        )
    if fault_specs:
        raise AgentConfigError(
            f"sim_faults: scripted faults need simulated GPUs, but gpus={mode}; set gpus=sim:N"
        )
    try:
        return _open_nvml(nvml)
    except pynvml.NVMLError as exc:
        devices = nvidia_device_files(dev_dir)
        if not devices:
            if mode == "nvml":
                raise BackendUnavailableError(
                    f"gpus=nvml: NVML not available ({exc}) and no NVIDIA device files in "
                    f"{dev_dir}; install the NVIDIA driver, or use gpus=auto on a node "
                    "without GPUs"
                ) from None
            log.info("no NVIDIA device files in %s: this node has no GPUs", dev_dir)
            return GpuBackend(api=NoGpus(), kind="nvml")
        shown = ", ".join(f"{dev_dir / d}" for d in devices[:3])
        more = f" and {len(devices) - 3} more" if len(devices) > 3 else ""
        error = (
            f"NVML failed ({exc}) although NVIDIA devices exist ({shown}{more}); "
            "check the driver with nvidia-smi"
        )
        log.error("%s; reporting this node unhealthy", error)
        return GpuBackend(api=NoGpus(), kind="nvml", error=error[:512], nvml=nvml)


def retry_nvml(backend: GpuBackend) -> GpuBackend | None:
    """Try ``nvmlInit`` again for a backend that failed with GPUs present: the working
    backend once the driver answers (a reloaded module, a finished upgrade), else ``None``."""
    if not backend.error or backend.nvml is None:
        return None
    try:
        retried = _open_nvml(backend.nvml)
    except pynvml.NVMLError as exc:
        log.debug("nvmlInit still fails: %s", exc)
        return None
    return None if retried.error else retried


def next_retry_delay_s(attempt: int, *, first_s: float, max_s: float) -> float:
    """Delay before retry ``attempt`` (0-based): doubling from ``first_s``, capped at ``max_s``."""
    return min(max_s, first_s * 2.0 ** min(attempt, 32))


__all__ = [
    "DEFAULT_DEV_DIR",
    "MAX_SIM_GPUS",
    "GpuBackend",
    "NoGpus",
    "next_retry_delay_s",
    "nvidia_device_files",
    "open_backend",
    "parse_gpus_setting",
    "retry_nvml",
]
