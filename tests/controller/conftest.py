"""Controller test fixtures: wire-report builders (plain dicts, as an agent sends), a
Prometheus text reader and a database outage switch. Exposed as fixtures because tests
import no sibling modules."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event


def gpu_sample(index: int, **overrides: Any) -> dict[str, Any]:
    sample: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index:04d}",
        "power_w": 300.0 + index,
        "energy_j": 1000.0,
        "temperature_c": 60.0 + index,
        "sm_clock_mhz": 1800,
        "utilization_gpu_pct": 90.0,
        "memory_used_bytes": 10 << 30,
        "ecc_corrected_total": 0,
        "ecc_uncorrected_total": 0,
    }
    sample.update(overrides)
    return sample


def report(
    node: str,
    seq: int,
    *,
    instance: str = "inst-1",
    gpus: int = 8,
    samples: int = 5,
    t0: float | None = None,
    gpu_overrides: dict[int, dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A report of ``samples`` ticks of ``gpus`` GPUs, 1 s apart."""
    t0 = time.time() - samples if t0 is None else t0
    overrides = gpu_overrides or {}
    body: dict[str, Any] = {
        "node": {
            "name": node,
            "hostname": f"{node}.example",
            "labels": {"rack": "r1"},
            "backend": "sim",
            "agent_version": "0.1.0",
            "gpus": [
                {"index": i, "uuid": f"GPU-{i:04d}", "name": "NVIDIA H100"} for i in range(gpus)
            ],
        },
        "agent_instance": instance,
        "seq": seq,
        "sent_unix_s": time.time(),
        "samples": [
            {
                "time_unix_s": t0 + k,
                "gpus": [gpu_sample(i, **overrides.get(i, {})) for i in range(gpus)],
                "node_power_w": 2600.0,
                "node_power_source": "gpu_sum",
            }
            for k in range(samples)
        ],
    }
    body.update(extra)
    return body


def metric_value(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def ctl_report() -> Callable[..., dict[str, Any]]:
    return report


@pytest.fixture
def ctl_gpu_sample() -> Callable[..., dict[str, Any]]:
    return gpu_sample


@pytest.fixture
def ctl_metric() -> Callable[[str, str], float]:
    return metric_value


class DatabaseOutage:
    """Makes statements whose SQL matches a pattern fail as a lost database would.

    A real SQLAlchemy ``before_cursor_execute`` hook on every engine of the process (the
    live controller's included) raises the driver's own ``OperationalError`` for a matching
    statement, inside the real transaction, which the real database then rolls back.
    """

    def __init__(self) -> None:
        self._pattern: re.Pattern[str] | None = None
        self._values: tuple[str, ...] = ()
        self.hits = 0

    def arm(self, pattern: str, *, values: tuple[str, ...] = ()) -> None:
        """Fail statements matching ``pattern`` (and, with ``values``, only those whose
        parameters show every one of them: one row's write among same-shaped others)."""
        self._pattern = re.compile(pattern, re.IGNORECASE)
        self._values = values

    def disarm(self) -> None:
        self._pattern = None

    def hook(
        self, conn: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, _many: bool
    ) -> None:
        if self._values and not all(v in repr(params) for v in self._values):
            return
        if self._pattern is not None and self._pattern.search(statement):
            self.hits += 1
            raise conn.dialect.loaded_dbapi.OperationalError(
                "server closed the connection unexpectedly (injected by the test)"
            )


@pytest.fixture
def ctl_db_outage() -> Iterator[DatabaseOutage]:
    outage = DatabaseOutage()
    event.listen(Engine, "before_cursor_execute", outage.hook)
    try:
        yield outage
    finally:
        event.remove(Engine, "before_cursor_execute", outage.hook)
