"""RAPL reading against a fake /sys/class/powercap tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.node_power import NodePowerSampler, RaplReader
from trainguard.wire import GpuSample


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = 262_143_328_850) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def set_energy(path: Path, energy_uj: int) -> None:
    (path / "energy_uj").write_text(f"{energy_uj}\n")


def test_packages_and_dram_are_summed_core_is_not_double_counted(tmp_path: Path) -> None:
    pkg0 = zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    pkg1 = zone(tmp_path, "intel-rapl:1", "package-1", 5_000_000)
    core = zone(tmp_path / "intel-rapl:0", "intel-rapl:0:0", "core", 0)
    dram = zone(tmp_path / "intel-rapl:0", "intel-rapl:0:1", "dram", 0)
    clock = Clock()
    rapl = RaplReader(tmp_path, clock=clock)
    assert rapl.available and sorted(rapl.zone_names) == ["dram", "package-0", "package-1"]
    assert rapl.read_w() is None  # needs two readings
    clock.t += 2.0
    set_energy(pkg0, 1_000_000 + 300_000_000)  # 150 W
    set_energy(pkg1, 5_000_000 + 200_000_000)  # 100 W
    set_energy(dram, 40_000_000)  # 20 W
    set_energy(core, 999_000_000)  # inside package-0 already; must not count
    assert rapl.read_w() == pytest.approx(270.0)


def test_counter_wraparound_is_one_wrap_not_a_negative_power(tmp_path: Path) -> None:
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 999_000_000, max_uj=1_000_000_000)
    clock = Clock()
    rapl = RaplReader(tmp_path, clock=clock)
    rapl.read_w()
    clock.t += 1.0
    set_energy(pkg, 199_000_000)  # wrapped: 1_000_000 to the top + 199_000_000 after it
    assert rapl.read_w() == pytest.approx(200.0)


def test_psys_covers_the_platform_alone(tmp_path: Path) -> None:
    zone(tmp_path, "intel-rapl:0", "package-0", 0)
    psys = zone(tmp_path, "intel-rapl:1", "psys", 0)
    clock = Clock()
    rapl = RaplReader(tmp_path, clock=clock)
    assert rapl.zone_names == ["psys"]
    rapl.read_w()
    clock.t += 4
    set_energy(psys, 400_000_000)
    assert rapl.read_w() == pytest.approx(100.0)


def test_missing_or_unreadable_rapl_falls_back_to_gpu_sum(tmp_path: Path) -> None:
    gpus = [GpuSample(index=0, power_w=300.0), GpuSample(index=1, power_w=250.0)]
    missing = RaplReader(tmp_path / "nope")
    assert not missing.available and "does not exist" in missing.unavailable_reason
    assert NodePowerSampler(missing, base_power_w=400).node_power(gpus) == (950.0, "gpu_sum")
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 0)
    (pkg / "energy_uj").unlink()  # as if root-only: the read fails at discovery
    (pkg / "energy_uj").mkdir()
    assert not RaplReader(tmp_path).available
    no_gpu_power = [GpuSample(index=0, lost=True)]
    assert NodePowerSampler(None).node_power(no_gpu_power) == (None, "none")


def test_node_power_is_rapl_plus_gpus(tmp_path: Path) -> None:
    pkg = zone(tmp_path, "intel-rapl:0", "package-0", 0)
    clock = Clock()
    sampler = NodePowerSampler(RaplReader(tmp_path, clock=clock), base_power_w=999)
    gpus = [GpuSample(index=0, power_w=500.0)]
    assert sampler.node_power(gpus) == (500.0 + 999, "gpu_sum")  # first tick: no RAPL delta yet
    clock.t += 1
    set_energy(pkg, 120_000_000)
    assert sampler.node_power(gpus) == (pytest.approx(620.0), "rapl")
