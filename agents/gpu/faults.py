"""Scripted faults for the simulated GPU backend, and their one-line spec strings.

A spec is ``key=value`` pairs joined by commas; ``kind`` and ``gpu`` are always required,
``at`` (seconds after ``nvmlInit``) defaults to 0::

    kind=xid,code=79,gpu=3,at=20        XID 79 delivered through the event set at t=20 s
    kind=ecc,gpu=1,at=10,uncorrected=1  ECC counters grow (corrected=N, uncorrected=N)
    kind=thermal,gpu=2,at=5,duration=30 temperature climbs, thermal throttle bits, clocks drop
    kind=lost,gpu=0,at=30               every call on GPU 0 raises NVML_ERROR_GPU_IS_LOST
    kind=hang,gpu=1,at=5,duration=60    every call on GPU 1 blocks (a dying GPU's driver)
    kind=nvml_error,gpu=1,code=999      every call on GPU 1 raises that NVML error code;
                                        calls=N: only the first N calls from ``at`` on (a
                                        transient error), 0 (the default) every call;
                                        duration=S: only for S seconds from ``at`` (a GPU
                                        that comes back); events=1: the event set's wait
                                        fails with it too (a wedged GPU in the set)
    kind=nvlink,gpu=0,link=3,crc=40,replay=2,recovery=1,down=1
                                        link 3's error counters grow; down=1 takes it down
    kind=pcie,gpu=0,width=8,gen=4,replay=12
                                        the PCIe link trains down; the replay counter grows
    kind=remap,gpu=2,correctable=1,uncorrectable=1,pending=1,failed=0
                                        row remapping (Ampere and later boards)
    kind=retire,gpu=2,sbe=2,dbe=1,pending=1
                                        page retirement (boards before Ampere)
    kind=fabric,gpu=0,state=2,status=0  NVSwitch fabric state (1 not started, 2 in progress,
                                        3 completed) and registration status (nvmlReturn_t)
    kind=slowdown,gpu=1,mhz=700,hw=1,brake=0
                                        the busy SM clock is capped at mhz (0: no cap); hw=1
                                        sets HW_SLOWDOWN, brake=1 HW_POWER_BRAKE_SLOWDOWN
    kind=reset,gpu=0,at=40,aggregate=0  a driver reload / GPU reset: the energy counter starts
                                        again from 0 and the volatile ECC counters count only
                                        later errors; aggregate=1 also clears the aggregate
                                        ECC counters (``nvidia-smi --clear-ecc-errors``)

Several specs may be given as a list or joined with ``;``. Parsing is strict: an unknown
key, a missing key or a bad number is an :class:`~agents.errors.AgentConfigError` naming
the offending part, because a typo in a fault script would otherwise silently test nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from agents.errors import AgentConfigError
from trainguard.limits import INT32_MAX

FaultKind = Literal[
    "xid", "ecc", "thermal", "lost", "hang", "nvml_error", "nvlink", "pcie", "remap", "retire",
    "fabric", "slowdown", "reset",
]  # fmt: skip

_KINDS: tuple[FaultKind, ...] = (
    "xid", "ecc", "thermal", "lost", "hang", "nvml_error", "nvlink", "pcie", "remap", "retire",
    "fabric", "slowdown", "reset",
)  # fmt: skip
_COMMON = {"kind", "gpu", "at"}
#: Integer parameters of the kinds that carry them in ``FaultSpec.values`` (key -> default).
_VALUES: dict[str, dict[str, int]] = {
    "nvml_error": {"code": 999, "calls": 0, "events": 0},  # NVML_ERROR_UNKNOWN, every call
    "nvlink": {"link": 0, "crc": 0, "replay": 0, "recovery": 0, "down": 0},
    "pcie": {"width": 0, "gen": 0, "replay": 0},
    "remap": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failed": 0},
    "retire": {"sbe": 0, "dbe": 0, "pending": 0},
    "fabric": {"state": 3, "status": 0},
    "slowdown": {"mhz": 0, "hw": 0, "brake": 0},
    "reset": {"aggregate": 0},
}
_ALLOWED: dict[str, set[str]] = {
    "xid": _COMMON | {"code"},
    "ecc": _COMMON | {"corrected", "uncorrected", "location"},
    "thermal": _COMMON | {"duration"},
    "lost": _COMMON,
    "hang": _COMMON | {"duration"},
    **{kind: _COMMON | set(keys) for kind, keys in _VALUES.items()},
}
_ALLOWED["nvml_error"] |= {"duration"}
#: ECC locations a fault may name (``NVML_MEMORY_LOCATION_*`` without the prefix).
ECC_LOCATIONS = ("dram", "sram", "l1_cache", "l2_cache", "register_file")


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultSpec:
    """One scripted fault. Times are seconds since the simulated driver was initialised."""

    kind: FaultKind
    gpu: int
    at_s: float = 0.0
    #: XID code delivered as the event's ``eventData`` (kind=xid).
    xid_code: int = 0
    #: Counts added to the volatile ECC counters at ``at_s`` (kind=ecc).
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    #: How long a thermal excursion or a hang lasts; ``inf`` means until the agent stops.
    duration_s: float = math.inf
    #: Where the ECC errors happen (kind=ecc), one of :data:`ECC_LOCATIONS`.
    ecc_location: str = "dram"
    #: Integer parameters of the other kinds, e.g. (("link", 3), ("crc", 40)) for nvlink.
    values: tuple[tuple[str, int], ...] = ()

    def value(self, key: str) -> int:
        """A parameter of this fault (its default when the spec did not give it)."""
        return dict(self.values).get(key, _VALUES.get(self.kind, {}).get(key, 0))

    def to_spec(self) -> str:
        """The canonical spec string, so a parsed fault can be logged and re-parsed."""
        parts = [f"kind={self.kind}", f"gpu={self.gpu}", f"at={self.at_s:g}"]
        if self.kind == "xid":
            parts.append(f"code={self.xid_code}")
        elif self.kind == "ecc":
            parts += [f"corrected={self.ecc_corrected}", f"uncorrected={self.ecc_uncorrected}"]
            if self.ecc_location != "dram":
                parts.append(f"location={self.ecc_location}")
        elif self.kind in ("thermal", "hang", "nvml_error") and math.isfinite(self.duration_s):
            parts.append(f"duration={self.duration_s:g}")
        parts += [f"{key}={value}" for key, value in self.values]
        return ",".join(parts)


def _int(spec: str, key: str, raw: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise AgentConfigError(f"fault spec {spec!r}: {key}={raw!r} is not an integer") from None
    if value < minimum:
        raise AgentConfigError(f"fault spec {spec!r}: {key}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise AgentConfigError(f"fault spec {spec!r}: {key}={value} must be <= {maximum}")
    return value


def _seconds(spec: str, key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise AgentConfigError(
            f"fault spec {spec!r}: {key}={raw!r} is not a number of seconds"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise AgentConfigError(f"fault spec {spec!r}: {key}={raw} must be a finite value >= 0")
    return value


def parse_fault_spec(spec: str) -> FaultSpec:
    """Parse one spec string; raises :class:`AgentConfigError` naming the bad part."""
    text = spec.strip()
    if not text:
        raise AgentConfigError("fault spec is empty (expected e.g. 'kind=xid,code=79,gpu=3,at=20')")
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise AgentConfigError(f"fault spec {text!r}: {part.strip()!r} is not key=value")
        if key in fields:
            raise AgentConfigError(f"fault spec {text!r}: {key!r} given twice")
        fields[key] = value
    kind = fields.get("kind")
    if kind is None:
        raise AgentConfigError(f"fault spec {text!r}: missing kind= (one of {', '.join(_KINDS)})")
    if kind not in _ALLOWED:
        raise AgentConfigError(
            f"fault spec {text!r}: unknown kind {kind!r} (one of {', '.join(_KINDS)})"
        )
    unknown = sorted(set(fields) - _ALLOWED[kind])
    if unknown:
        allowed = ", ".join(sorted(_ALLOWED[kind]))
        raise AgentConfigError(
            f"fault spec {text!r}: unknown key {unknown[0]!r} for kind={kind} (allowed: {allowed})"
        )
    if "gpu" not in fields:
        raise AgentConfigError(f"fault spec {text!r}: missing gpu=<index>")
    gpu = _int(text, "gpu", fields["gpu"])
    at_s = _seconds(text, "at", fields.get("at", "0"))
    if kind == "xid":
        if "code" not in fields:
            raise AgentConfigError(f"fault spec {text!r}: kind=xid needs code=<xid number>")
        return FaultSpec(
            kind="xid",
            gpu=gpu,
            at_s=at_s,
            xid_code=_int(text, "code", fields["code"], minimum=1, maximum=INT32_MAX),
        )
    if kind == "ecc":
        corrected = _int(text, "corrected", fields.get("corrected", "0"))
        uncorrected = _int(text, "uncorrected", fields.get("uncorrected", "0"))
        if corrected == 0 and uncorrected == 0:
            corrected = 1  # a bare kind=ecc means "one correctable error", the mildest case
        location = fields.get("location", "dram")
        if location not in ECC_LOCATIONS:
            raise AgentConfigError(
                f"fault spec {text!r}: location={location!r} (one of {', '.join(ECC_LOCATIONS)})"
            )
        return FaultSpec(
            kind="ecc",
            gpu=gpu,
            at_s=at_s,
            ecc_corrected=corrected,
            ecc_uncorrected=uncorrected,
            ecc_location=location,
        )
    if kind in ("thermal", "hang"):
        duration = _seconds(text, "duration", fields["duration"]) if "duration" in fields else None
        return FaultSpec(
            kind="thermal" if kind == "thermal" else "hang",
            gpu=gpu,
            at_s=at_s,
            duration_s=math.inf if duration is None else duration,
        )
    if kind in _VALUES:
        values = tuple(
            (key, _int(text, key, fields[key])) for key in _VALUES[kind] if key in fields
        )
        duration = _seconds(text, "duration", fields["duration"]) if "duration" in fields else None
        return FaultSpec(
            kind=kind,  # type: ignore[arg-type]
            gpu=gpu,
            at_s=at_s,
            values=values,
            duration_s=math.inf if duration is None else duration,
        )
    return FaultSpec(kind="lost", gpu=gpu, at_s=at_s)


def split_fault_specs(raw: str | Iterable[str]) -> list[str]:
    """Accept a list of specs or one string with specs joined by ``;``."""
    items = [raw] if isinstance(raw, str) else list(raw)
    out: list[str] = []
    for item in items:
        out += [piece.strip() for piece in item.split(";") if piece.strip()]
    return out


def parse_fault_specs(raw: str | Iterable[str], *, gpu_count: int | None = None) -> list[FaultSpec]:
    """Parse many specs; with ``gpu_count`` also refuse faults on GPUs that do not exist."""
    faults = [parse_fault_spec(s) for s in split_fault_specs(raw)]
    if gpu_count is not None:
        for fault in faults:
            if fault.gpu >= gpu_count:
                raise AgentConfigError(
                    f"fault spec {fault.to_spec()!r}: gpu={fault.gpu} but only {gpu_count} "
                    f"simulated GPUs (indices 0..{gpu_count - 1})"
                )
    return faults


__all__ = [
    "ECC_LOCATIONS",
    "FaultKind",
    "FaultSpec",
    "parse_fault_spec",
    "parse_fault_specs",
    "split_fault_specs",
]
