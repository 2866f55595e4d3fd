"""Node power: RAPL energy counters where the kernel lets us read them, else an estimate.

RAPL (``/sys/class/powercap/intel-rapl:*``; AMD exposes the same tree) counts CPU package
and DRAM energy in µJ. It does not see discrete GPUs, so the node figure is RAPL power plus
the GPUs' own power (source ``rapl``). Where RAPL is missing or unreadable (``energy_uj`` is
root-only since CVE-2020-8694) the agent reports the GPU sum plus the configured
``node_base_power_w`` for everything else (source ``gpu_sum``).

Zones are chosen so nothing is counted twice: a ``psys`` zone already covers the whole
platform; otherwise each top-level ``package-N`` zone plus its ``dram`` sub-zone (package
sub-zones ``core``/``uncore`` lie inside the package figure). Counters wrap at
``max_energy_range_uj``; a decrease is read as one wrap.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainguard.wire import GpuSample

log = logging.getLogger(__name__)

DEFAULT_POWERCAP_DIR = Path("/sys/class/powercap")
_TOP_ZONE = re.compile(r"^intel-rapl:\d+$")
_SUB_ZONE = re.compile(r"^intel-rapl:\d+:\d+$")


@dataclass(slots=True)
class _Zone:
    path: Path
    name: str
    max_range_uj: int
    last_uj: int | None = None


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


class RaplReader:
    """Average power over the interval between two :meth:`read_w` calls."""

    def __init__(
        self,
        root: Path = DEFAULT_POWERCAP_DIR,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = root
        self._clock = clock
        self._zones: list[_Zone] = []
        self._last_t: float | None = None
        self.unavailable_reason = ""
        self._discover()

    @property
    def available(self) -> bool:
        return bool(self._zones)

    @property
    def zone_names(self) -> list[str]:
        return [z.name for z in self._zones]

    def _discover(self) -> None:
        if not self._root.is_dir():
            self.unavailable_reason = f"{self._root} does not exist"
            return
        zones: list[_Zone] = []
        try:
            for top in sorted(p for p in self._root.iterdir() if _TOP_ZONE.match(p.name)):
                zones.append(self._zone(top))
                for sub in sorted(p for p in top.iterdir() if _SUB_ZONE.match(p.name)):
                    if (sub / "name").read_text().strip() == "dram":
                        zones.append(self._zone(sub))
        except (OSError, ValueError) as exc:
            self.unavailable_reason = f"cannot read RAPL zones ({exc})"
            return
        psys = [z for z in zones if z.name == "psys"]
        chosen = psys or [z for z in zones if z.name.startswith("package") or z.name == "dram"]
        if not chosen:
            self.unavailable_reason = f"no package or psys zone under {self._root}"
            return
        self._zones = chosen

    def _zone(self, path: Path) -> _Zone:
        zone = _Zone(
            path, (path / "name").read_text().strip(), _read_int(path / "max_energy_range_uj")
        )
        _read_int(path / "energy_uj")  # fail at discovery, not at every tick, if unreadable
        return zone

    def read_w(self) -> float | None:
        """Watts since the previous call; None on the first call or if a read fails."""
        now = self._clock()
        total_uj = 0
        complete = self._last_t is not None
        try:
            readings = [(_read_int(z.path / "energy_uj"), z) for z in self._zones]
        except (OSError, ValueError) as exc:
            log.warning("RAPL read failed (%s); this tick uses the GPU estimate", exc)
            for z in self._zones:
                z.last_uj = None
            self._last_t = None
            return None
        for value, zone in readings:
            if zone.last_uj is None:
                complete = False
            else:
                delta = value - zone.last_uj
                if delta < 0:
                    delta += zone.max_range_uj
                total_uj += delta
            zone.last_uj = value
        elapsed = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        if not complete or elapsed <= 0:
            return None
        return total_uj / 1e6 / elapsed


Source = Literal["rapl", "gpu_sum", "none"]


class NodePowerSampler:
    """Combines RAPL (when readable) with the GPU sample into one node figure."""

    def __init__(self, rapl: RaplReader | None, *, base_power_w: float = 0.0) -> None:
        self._rapl = rapl if rapl is not None and rapl.available else None
        self._base_power_w = base_power_w
        if rapl is not None and not rapl.available:
            log.info(
                "RAPL unavailable (%s); node power = GPU sum + %.0f W",
                rapl.unavailable_reason,
                base_power_w,
            )

    def node_power(self, gpus: Sequence[GpuSample]) -> tuple[float | None, Source]:
        readings = [g.power_w for g in gpus if g.power_w is not None]
        gpu_w = sum(readings)
        rapl_w = self._rapl.read_w() if self._rapl is not None else None
        if rapl_w is not None:
            return rapl_w + gpu_w, "rapl"
        if readings or self._base_power_w > 0:
            return gpu_w + self._base_power_w, "gpu_sum"
        return None, "none"


__all__ = ["DEFAULT_POWERCAP_DIR", "NodePowerSampler", "RaplReader"]
