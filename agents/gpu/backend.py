"""Choosing the GPU backend: the real ``pynvml`` module or the simulated driver.

Both are used through the same attribute names (``api.nvmlDeviceGetPowerUsage(h)``), so
the rest of the agent never knows which one it holds. ``auto`` prefers real NVML and falls
back to ``sim:8`` with one log line, so a laptop demo works; ``nvml`` insists, so a
misconfigured GPU node fails loudly instead of reporting made-up numbers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pynvml

from agents.errors import AgentConfigError, BackendUnavailableError
from agents.gpu.faults import FaultSpec, parse_fault_specs
from agents.gpu.sim import SimNvml

log = logging.getLogger(__name__)

_SIM_RE = re.compile(r"^sim:(\d+)$")
#: Upper bound for simulated GPUs per node (``wire.NodeSample.gpus`` holds at most 64).
MAX_SIM_GPUS = 64
AUTO_FALLBACK_GPUS = 8


@dataclass(kw_only=True, slots=True)
class GpuBackend:
    """An initialised NVML-like API plus what the report should say about it."""

    api: Any
    kind: Literal["nvml", "sim"]
    driver_version: str = ""

    def shutdown(self) -> None:
        try:
            self.api.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


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


def _open_nvml() -> GpuBackend:
    pynvml.nvmlInit()
    try:
        driver = str(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        driver = ""
    return GpuBackend(api=pynvml, kind="nvml", driver_version=driver)


def _open_sim(
    count: int, *, faults: Sequence[FaultSpec], seed: int, no_permission: bool, identity: str
) -> GpuBackend:
    api = SimNvml(
        gpu_count=count, seed=seed, identity=identity, faults=faults, no_permission=no_permission
    )
    api.nvmlInit()
    return GpuBackend(api=api, kind="sim", driver_version=api.nvmlSystemGetDriverVersion())


def open_backend(
    gpus: str,
    *,
    fault_specs: Sequence[str] = (),
    seed: int = 0,
    sim_no_permission: bool = False,
    identity: str = "",
) -> GpuBackend:
    """Initialise the backend named by the ``gpus`` setting (see module docstring).

    ``identity`` (the node name) makes simulated GPU UUIDs unique per simulated node.
    """
    mode, count = parse_gpus_setting(gpus)
    if mode in ("auto", "nvml"):
        try:
            backend = _open_nvml()
        except pynvml.NVMLError as exc:
            if mode == "nvml":
                raise BackendUnavailableError(
                    f"gpus=nvml: NVML not available ({exc}); install the NVIDIA driver "
                    f"or run with gpus=sim:{AUTO_FALLBACK_GPUS}"
                ) from None
            log.warning(
                "NVML not available (%s); using simulated GPUs sim:%d", exc, AUTO_FALLBACK_GPUS
            )
            count = AUTO_FALLBACK_GPUS
        else:
            if fault_specs:
                backend.shutdown()
                raise AgentConfigError(
                    "sim_faults: scripted faults need simulated GPUs, but real NVML is in use; "
                    "set gpus=sim:N"
                )
            return backend
    faults = parse_fault_specs(fault_specs, gpu_count=count)
    return _open_sim(
        count, faults=faults, seed=seed, no_permission=sim_no_permission, identity=identity
    )


__all__ = ["MAX_SIM_GPUS", "GpuBackend", "open_backend", "parse_gpus_setting"]
