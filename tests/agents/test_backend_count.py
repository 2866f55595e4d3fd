"""A driver that initialises but cannot count its GPUs is a failed backend as soon as
:func:`open_backend` (or :func:`retry_nvml`) returns, for every caller: the agent, and
``trainguard preflight --local``, whose sampler used to meet the NVMLError itself."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from agents.gpu.backend import NoGpus, open_backend, retry_nvml
from agents.gpu.sim import SimNvml
from agents.preflight import evaluate
from agents.sampler import GpuSampler

MESSAGE = (
    "NVML initialised but cannot count the GPUs (nvmlDeviceGetCount: Unknown Error); "
    "check the driver with nvidia-smi"
)


class CountFails(SimNvml):
    """Initialises, then fails ``nvmlDeviceGetCount`` while ``failing``; counts shutdowns."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = True
        self.shutdowns = 0

    def nvmlDeviceGetCount(self) -> int:
        if self.failing:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return super().nvmlDeviceGetCount()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        super().nvmlShutdown()


def test_open_backend_reports_a_driver_that_cannot_count_and_retries_it() -> None:
    driver = CountFails(gpu_count=2, identity="n")
    backend = open_backend("auto", nvml=driver)
    assert (backend.kind, backend.error, backend.nvml) == ("nvml", MESSAGE, driver)
    assert isinstance(backend.api, NoGpus) and driver.shutdowns == 1
    assert retry_nvml(backend) is None and driver.shutdowns == 2  # still cannot count
    driver.failing = False
    fixed = retry_nvml(backend)
    assert fixed is not None and fixed.error == "" and fixed.api is driver


def test_a_simulated_driver_that_cannot_count_is_failed_and_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SimNvml, "nvmlDeviceGetCount", CountFails.nvmlDeviceGetCount)
    monkeypatch.setattr(SimNvml, "failing", True, raising=False)
    backend = open_backend("sim:2")
    assert (backend.kind, backend.error, backend.nvml) == ("sim", MESSAGE, None)
    assert retry_nvml(backend) is None


def test_preflight_s_sampler_opens_the_failed_backend_and_fails_the_nvml_check() -> None:
    # What ``trainguard preflight --local`` does with the backend: open a sampler, evaluate.
    backend = open_backend("auto", nvml=CountFails(gpu_count=2, identity="n"))
    sampler = GpuSampler(backend.api, timeout_s=2)
    try:
        assert sampler.open() == []
        checks = evaluate(backend, sampler.sample(), [])
    finally:
        sampler.close()
    assert [(c.name, c.status, c.reason) for c in checks] == [("nvml", "fail", MESSAGE)]
