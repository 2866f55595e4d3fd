"""Clock caps per GPU model, and the fallback when the model is not in the table.

POLCA published its caps for the A100 only: 1275 MHz for low priority at T1, 1110 MHz for
low priority at T2 and 1305 MHz for high priority at T2. For the other models we keep the
*same position within the supported SM clock range* (A100: 210-1410 MHz), i.e. T1 at
88.75%, low-priority T2 at 75% and high-priority T2 at 91.25% of the way from the lowest to
the highest supported clock, rounded to the 15 MHz steps NVIDIA's clock tables use. The
brake is the lowest supported clock. Ranges and power limits are from NVIDIA's product
pages and ``nvidia-smi -q -d SUPPORTED_CLOCKS,POWER`` listings as commonly reported; the
rows marked ``assumed`` are not confirmed and should be overridden per domain
(``clock_overrides_mhz``) once measured on the real part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from power.config import Level, Priority

#: A100's published POLCA caps expressed as fractions of its 210-1410 MHz range.
RANGE_FRACTIONS: dict[str, float] = {
    "lp_t1": (1275 - 210) / (1410 - 210),
    "lp_t2": (1110 - 210) / (1410 - 210),
    "hp_t2": (1305 - 210) / (1410 - 210),
    "brake": 0.0,
}
#: When only the maximum clock is known: A100's lowest/highest ratio (210 / 1410).
MIN_CLOCK_FRACTION_OF_MAX = 210 / 1410
CLOCK_STEP_MHZ = 15


@dataclass(kw_only=True, slots=True, frozen=True)
class ClockProfile:
    key: str
    min_mhz: int
    max_mhz: int
    tdp_w: float | None
    power_limit_min_w: float | None
    caps_mhz: Mapping[str, int]
    source: str
    clocks_usable: bool = True
    """False when the range is assumed only to derive power limits (clocks unknown)."""

    def cap_for(self, level: Level, priority: Priority) -> int | None:
        """The SM clock ceiling a GPU of ``priority`` gets at ``level`` (None: uncapped)."""
        key = cap_key(level, priority)
        return None if key is None else self.caps_mhz[key]


def cap_key(level: Level, priority: Priority) -> str | None:
    if level is Level.BRAKE:
        return "brake"
    if priority is Priority.LOW:
        if level is Level.T1:
            return "lp_t1"
        if level >= Level.T2_LP:
            return "lp_t2"
        return None
    return "hp_t2" if level is Level.T2_HP else None


def caps_from_range(min_mhz: int, max_mhz: int) -> dict[str, int]:
    span = max_mhz - min_mhz
    out = {}
    for key, frac in RANGE_FRACTIONS.items():
        mhz = min_mhz + frac * span
        if key != "brake":
            mhz = round(mhz / CLOCK_STEP_MHZ) * CLOCK_STEP_MHZ
        out[key] = int(min(max(mhz, min_mhz), max_mhz))
    return out


def _row(key: str, lo: int, hi: int, tdp: float, pl_min: float, source: str) -> ClockProfile:
    caps = (
        {"lp_t1": 1275, "lp_t2": 1110, "hp_t2": 1305, "brake": 210}
        if key == "a100"
        else (caps_from_range(lo, hi))
    )
    return ClockProfile(
        key=key,
        min_mhz=lo,
        max_mhz=hi,
        tdp_w=tdp,
        power_limit_min_w=pl_min,
        caps_mhz=caps,
        source=source,
    )


#: Matched by substring of the NVML name, most specific first.
CLOCK_TABLE: dict[str, ClockProfile] = {
    "b200": _row(
        "b200",
        600,
        1965,
        1000.0,
        200.0,
        "assumed: boost clock per public reports, "
        "minimum clock and minimum power limit not published",
    ),
    "h200": _row(
        "h200",
        345,
        1980,
        700.0,
        200.0,
        "H200 SXM: GH100 clock range as H100 SXM; minimum power limit assumed equal to H100's",
    ),
    "h100": _row(
        "h100",
        345,
        1980,
        700.0,
        200.0,
        "H100 SXM5: 1980 MHz boost, 345 MHz lowest supported clock, 200-700 W power limit range",
    ),
    "a100": _row(
        "a100",
        210,
        1410,
        400.0,
        100.0,
        "A100 SXM4: 1410 MHz boost, 210 MHz lowest; caps from POLCA",
    ),
    "l40s": _row(
        "l40s",
        210,
        2520,
        350.0,
        100.0,
        "L40S: 2520 MHz boost, 350 W TDP; minimum power limit assumed",
    ),
}


def clock_profile(
    model_name: str,
    *,
    sm_clock_max_mhz: int | None = None,
    sm_clock_min_mhz: int | None = None,
    power_limit_max_w: float | None = None,
    power_limit_min_w: float | None = None,
    overrides: Mapping[str, Mapping[str, int]] | None = None,
) -> ClockProfile | None:
    """The caps for a GPU, from the table or from its reported range; None if unknowable.

    Reported power-limit bounds win over the table's (a PCIe A100 has a 250-300 W ceiling,
    not the SXM part's 400 W). Per-domain overrides win over both.
    """
    name = model_name.lower()
    profile: ClockProfile | None = None
    for key, row in CLOCK_TABLE.items():
        if key in name:
            profile = row
            break
    if sm_clock_min_mhz and sm_clock_max_mhz and sm_clock_min_mhz > sm_clock_max_mhz:
        # An inverted clock range (a driver glitch): no lock fits it, so clocks are not used
        # for this GPU; power limits still are (no command is tried, so no false incident).
        sm_clock_min_mhz = sm_clock_max_mhz = None
        if profile is not None:
            profile = dataclasses.replace(
                profile,
                source=profile.source + "; reported clock range inverted: clocks not used",
                clocks_usable=False,
            )
    elif profile is not None and (sm_clock_max_mhz or sm_clock_min_mhz):
        profile = _within_reported(profile, sm_clock_min_mhz, sm_clock_max_mhz)
    if profile is None and not sm_clock_max_mhz:
        if not power_limit_max_w:
            return None
        a100 = CLOCK_TABLE["a100"]
        profile = ClockProfile(
            key="unknown",
            min_mhz=a100.min_mhz,
            max_mhz=a100.max_mhz,
            tdp_w=power_limit_max_w,
            power_limit_min_w=power_limit_min_w,
            caps_mhz=caps_from_range(210, 1410),
            source="clock range unknown: power limits only, caps placed like the A100's",
            clocks_usable=False,
        )
    if profile is None:
        assert sm_clock_max_mhz
        lo = sm_clock_min_mhz or round(sm_clock_max_mhz * MIN_CLOCK_FRACTION_OF_MAX)
        profile = ClockProfile(
            key="unknown",
            min_mhz=lo,
            max_mhz=sm_clock_max_mhz,
            tdp_w=power_limit_max_w,
            power_limit_min_w=power_limit_min_w,
            caps_mhz=caps_from_range(lo, sm_clock_max_mhz),
            source="fractions of the reported supported range (model not in table)",
        )
    if power_limit_max_w or power_limit_min_w:
        profile = ClockProfile(
            key=profile.key,
            min_mhz=profile.min_mhz,
            max_mhz=profile.max_mhz,
            tdp_w=power_limit_max_w or profile.tdp_w,
            power_limit_min_w=power_limit_min_w or profile.power_limit_min_w,
            caps_mhz=profile.caps_mhz,
            source=profile.source,
            clocks_usable=profile.clocks_usable,
        )
    extra = (overrides or {}).get(profile.key)
    if extra:
        profile = ClockProfile(
            key=profile.key,
            min_mhz=profile.min_mhz,
            max_mhz=profile.max_mhz,
            tdp_w=profile.tdp_w,
            power_limit_min_w=profile.power_limit_min_w,
            caps_mhz=_clamped({**profile.caps_mhz, **extra}, profile.min_mhz, profile.max_mhz),
            source=profile.source + "; domain override (clamped to the GPU's clock range)",
            clocks_usable=profile.clocks_usable,
        )
    return profile


def _clamped(caps: Mapping[str, int], lo: int, hi: int) -> dict[str, int]:
    return {key: min(max(int(mhz), lo), hi) for key, mhz in caps.items()}


def _within_reported(profile: ClockProfile, lo: int | None, hi: int | None) -> ClockProfile:
    """A table row narrowed to the clock range the GPU reports (an H100 PCIe tops out at
    1755 MHz, not the SXM row's 1980): the row's caps are clamped into it, so no lock is
    ever above the GPU's maximum or below its minimum."""
    new_lo = lo or profile.min_mhz
    new_hi = hi or profile.max_mhz
    if new_lo > new_hi:  # one reported bound lies outside the row's range: trust it
        if hi:
            new_lo = new_hi
        else:
            new_hi = new_lo
    if (new_lo, new_hi) == (profile.min_mhz, profile.max_mhz):
        return profile
    # The A100's caps are POLCA's measured values: clamped. The other rows are positions in
    # the range: placed again in the range the GPU reports.
    caps = profile.caps_mhz if profile.key == "a100" else caps_from_range(new_lo, new_hi)
    return dataclasses.replace(
        profile,
        min_mhz=new_lo,
        max_mhz=new_hi,
        caps_mhz=_clamped(caps, new_lo, new_hi),
        source=profile.source + f"; within the reported {new_lo}-{new_hi} MHz",
    )
