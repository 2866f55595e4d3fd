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

sysfs is not trusted blindly: a counter that goes backwards where the zone states no usable
range (``max_energy_range_uj`` of 0 or less, or a counter already past it), a negative
counter, or a figure no node can draw (past :data:`MAX_PLAUSIBLE_W`: a "wrap" of 1 µJ
backwards reads as 262 kW) gives no RAPL figure for that tick. The node figure then falls
back to the GPU sum, with one warning per kind of trouble, and a negative or absurd wattage
never reaches the report (it used to fail the whole node sample, GPUs and all).
"""

from __future__ import annotations

import logging
import math
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
#: The most CPU package + DRAM (or psys) power a node can draw, in watts. The largest
#: 8-socket servers stay well under 10 kW; a larger figure is a misread counter, not power.
MAX_PLAUSIBLE_W = 20_000.0


@dataclass(slots=True)
class _Zone:
    path: Path
    name: str
    #: The counter's wrap point; 0 or less means the kernel gave no usable range, so a
    #: decrease cannot be read as a wrap.
    max_range_uj: int
    last_uj: int | None = None

    def delta_uj(self, value: int) -> int | None:
        """Energy since the last reading, one wrap allowed; None when a decrease cannot be
        a wrap (no usable range, or either reading already past the stated range)."""
        assert self.last_uj is not None
        delta = value - self.last_uj
        if delta >= 0:
            return delta
        top = self.max_range_uj
        if top <= 0 or self.last_uj > top or value > top:
            return None
        return delta + top


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
        #: Kinds of bad reading already warned about (one line each, not one per tick).
        self._warned: set[str] = set()
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

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message + "; such ticks use the GPU estimate", *args)

    def _restart(self) -> None:
        """Forget every reading: the next call starts a fresh interval."""
        for z in self._zones:
            z.last_uj = None
        self._last_t = None

    def read_w(self) -> float | None:
        """Watts since the previous call; None on the first call, if a read fails, or if the
        counters say something no real node does (see the module docstring)."""
        now = self._clock()
        total_uj = 0
        complete = self._last_t is not None
        try:
            readings = [(_read_int(z.path / "energy_uj"), z) for z in self._zones]
        except (OSError, ValueError) as exc:
            self._warn_once("read", "RAPL read failed (%s)", exc)
            self._restart()
            return None
        bad = [(z, v) for v, z in readings if v < 0]
        if bad:
            zone, value = bad[0]
            self._warn_once("negative", "RAPL zone %s: energy_uj reads %d", zone.name, value)
            self._restart()
            return None
        for value, zone in readings:
            if zone.last_uj is None:
                complete = False
            else:
                delta = zone.delta_uj(value)
                if delta is None:
                    self._warn_once(
                        "backwards",
                        "RAPL zone %s: energy_uj went back from %d to %d and "
                        "max_energy_range_uj (%d) cannot explain it as a wrap",
                        zone.name,
                        zone.last_uj,
                        value,
                        zone.max_range_uj,
                    )
                    complete = False
                else:
                    total_uj += delta
            zone.last_uj = value
        elapsed = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        if not complete or elapsed <= 0:
            return None
        watts = total_uj / 1e6 / elapsed
        if not math.isfinite(watts) or watts > MAX_PLAUSIBLE_W:
            self._warn_once(
                "implausible",
                "RAPL counters give %.0f W over %.3f s (more than %.0f W is no real node)",
                watts,
                elapsed,
                MAX_PLAUSIBLE_W,
            )
            return None
        return watts


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
        if rapl_w is not None and math.isfinite(rapl_w) and rapl_w >= 0:
            return rapl_w + gpu_w, "rapl"
        if readings or self._base_power_w > 0:
            return gpu_w + self._base_power_w, "gpu_sum"
        return None, "none"


__all__ = ["DEFAULT_POWERCAP_DIR", "MAX_PLAUSIBLE_W", "NodePowerSampler", "RaplReader", "Source"]
