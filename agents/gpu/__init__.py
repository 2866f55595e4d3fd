"""GPU backends: real NVML (the ``pynvml`` module) and a simulated NVML with the same names."""

from agents.gpu.backend import GpuBackend, open_backend, parse_gpus_setting
from agents.gpu.faults import FaultSpec, parse_fault_spec, parse_fault_specs
from agents.gpu.sim import SimNvml

__all__ = [
    "FaultSpec",
    "GpuBackend",
    "SimNvml",
    "open_backend",
    "parse_fault_spec",
    "parse_fault_specs",
    "parse_gpus_setting",
]
