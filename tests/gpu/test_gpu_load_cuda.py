"""The ``clocks_load`` preflight check on a real GPU (``make gpu-check``; skipped without CUDA).

The load generator (``collectives/gpu_load.py``) runs as the agent runs it, and the agent's
check reads clocks, clock-event reasons and utilization through the real ``pynvml``. On a
healthy, otherwise idle GPU every check must pass; the reasons (clock reached, samples,
reasons seen) are printed for docs/agent.md (``pytest -s``).

These tests have not run yet: no GPU was available where they were written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
import torch

from agents.clocks_load import LoadSettings, default_load_command, load_targets, run_clocks_load
from agents.gpu.backend import GpuBackend, open_backend
from agents.sampler import GpuSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_LOAD = Path(__file__).resolve().parents[2] / "collectives" / "gpu_load.py"


@pytest.fixture
def nvml() -> Iterator[GpuBackend]:
    backend = open_backend("nvml")
    assert backend.kind == "nvml" and not backend.error, backend.error
    yield backend
    backend.shutdown()


def test_the_generator_loads_the_gpu_named_by_its_uuid(nvml: GpuBackend) -> None:
    uuid = str(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)))
    done = subprocess.run(
        [sys.executable, str(GPU_LOAD), "--gpu", uuid, "--seconds", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("gpu_load:", result)
    assert result["gpu"] == uuid and result["products"] > 0 and result["tflops"] > 0
    assert result["seconds"] >= 3


def test_clocks_load_passes_on_a_healthy_gpu_through_real_nvml(nvml: GpuBackend) -> None:
    sampler = GpuSampler(nvml.api, timeout_s=2.0)
    sampler.open()
    try:
        targets = load_targets(sampler.sample(), sampler.inventory, sampler.handles)
        command = default_load_command()
        assert command is not None and targets
        checks = run_clocks_load(nvml.api, targets, LoadSettings(command=tuple(command), seconds=8))
    finally:
        sampler.close()
    for check in checks:
        print(check.target, check.status, check.reason)
    assert [c.status for c in checks] == ["pass"] * len(targets), [c.reason for c in checks]
