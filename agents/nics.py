"""The network cards: RDMA ports, Ethernet bonds and GPU-to-NIC PCIe distance, from sysfs.

Everything is read from files under one root (``/sys`` on a node; tests build a tree laid
out as the kernel does), each path from the kernel's own documentation:

* ``class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer}`` and
  ``counters/``, ``hw_counters/`` -- Documentation/ABI/stable/sysfs-class-infiniband.
  ``state`` reads ``4: ACTIVE``, ``phys_state`` ``5: LinkUp``, ``rate`` ``400 Gb/sec (4X NDR)``.
* ``class/infiniband/<dev>/device`` -- a link to the PCI function (same document);
  ``<pci function>/numa_node`` -- Documentation/ABI/testing/sysfs-bus-pci.
* ``class/net/bonding_masters``, ``class/net/<bond>/bonding/{mode,slaves,active_slave}``,
  ``class/net/<slave>/bonding_slave/{mii_status,link_failure_count}`` --
  Documentation/networking/bonding.rst ("Configuring Bonding Manually via Sysfs").
* ``class/net/<if>/{operstate,speed}`` -- Documentation/ABI/testing/sysfs-class-net.
* ``bus/pci/devices/<domain:bus:dev.fn>`` -- links into ``devices/pci<domain>:<bus>/...``,
  whose path is the PCIe tree (Documentation/ABI/testing/sysfs-bus-pci).

A NIC can vanish while the agent runs (a firmware reset, a card falling off the bus): every
read tolerates a missing file, and the device's disappearance is itself an event. A file
that reads as something unusable (bytes that are not text, a u64 counter past the wire's
signed 64-bit range) costs that one field, with one warning line per file, never the
node's sample; a counter unknown for a tick is treated as reset, so no rise or flap is
computed across the gap. The same holds for a garbled ``rate`` (``1.2.3 Gb/sec``), a port
number or ``numa_node`` past the wire's range, and a port whose reading the wire would still
refuse: that port (or field) is left out with one warning, the rest of the sample goes out.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from trainguard import limits
from trainguard.wire import (
    BondMember,
    BondSample,
    HardwareEvent,
    NicInfo,
    NicPortSample,
)

log = logging.getLogger(__name__)

#: Counters reported per port (``counters/`` then ``hw_counters/``); a bounded list keeps a
#: report small (mlx5 exposes ~60 files per port). Missing files are skipped.
PORT_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "port_xmit_wait",
    "port_xmit_data",
    "port_rcv_data",
)
HW_COUNTERS = (
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "rnr_nak_retry_err",
    "req_cqe_error",
    "resp_cqe_error",
)
#: Counters whose rise means the link is going bad (an event past the threshold).
ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_rcv_remote_physical_errors",
    "packet_seq_err",
    "local_ack_timeout_err",
)
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: The kernel prints ``<number> Gb/sec (<width>X <speed>)``: one decimal number, at most one
#: point (``2.5``, ``400``, ``53.125``).
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*Gb/sec")
#: No RDMA port is faster than this (Gb/s); a larger figure is a garbled file, not a link.
MAX_RATE_GBPS = 100_000.0


#: Files already warned about (one line per bad file per process, so a counter stuck at a
#: bad value does not log every tick); bounded so a sysfs full of junk cannot grow it.
_warned_files: set[str] = set()
_WARNED_FILES_MAX = 256


def _unusable(path: Path, why: str) -> None:
    """One warning line the first time ``path`` reads as something unusable."""
    key = str(path)
    if key in _warned_files or len(_warned_files) >= _WARNED_FILES_MAX:
        return
    _warned_files.add(key)
    log.warning("%s: %s; reporting it as unknown", path, why)


def _read(path: Path) -> str | None:
    """The file's text, or ``None``: a missing file is normal (a NIC can vanish), and a file
    that is not text (bytes from a driver bug) costs only its own field, never the sample."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        _unusable(path, "not UTF-8 text")
        return None
    if "\x00" in text:
        _unusable(path, "contains NUL bytes")
        return None
    return text.strip()


def _read_names(path: Path) -> list[str]:
    """The interface names a sysfs list file holds (``bonding_masters``, ``slaves``), as the
    file system spells them: a name may be any bytes (see :func:`wire_name`), and read as
    UTF-8 text one odd name cost the whole list (a bond reported with no members at all,
    its healthy members' ``bond_member_down`` never seen). Missing or unreadable: none."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    return [os.fsdecode(name) for name in data.split() if b"\x00" not in name]


def _read_int(path: Path, high: int = limits.INT64_MAX) -> int | None:
    """An integer file up to ``high``, else ``None``. Hardware counters are unsigned 64-bit:
    a value past 2^63-1 (one near its wrap, or 2^64-1, which drivers print for "not
    available") does not fit the wire's signed 64-bit column, so it is unknown, not an
    error for the whole port."""
    text = _read(path)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    if value > high:
        _unusable(path, f"value {value} is past {high} (a counter near its wrap, or unset)")
        return None
    return value


#: Logical port states in which the port passes traffic. The kernel prints ``state`` as
#: ``<n>: <name>`` from ``enum ib_port_state`` (drivers/infiniband/core/sysfs.c): 0 NOP,
#: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER, anything else UNKNOWN. ACTIVE_DEFER
#: is ACTIVE with a state change the subnet manager deferred: up, not a port that went down.
UP_STATES = frozenset({"ACTIVE", "ACTIVE_DEFER"})


def port_is_up(state: str) -> bool:
    """The port (``NicPortSample.state``, the kernel's name) passes traffic."""
    return state in UP_STATES


def wire_name(name: str, limit: int = 64) -> str:
    """A device, interface or bond name as the wire can carry it. Linux lets a netdev name
    hold any byte but ``/``, ``:`` and white space; Python reads the bytes that are not
    UTF-8 as lone surrogates, which the wire refuses (the port, the bond or the node's whole
    NIC inventory used to be left out for one odd name). They are spelled ``\\xNN``."""
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text[:limit]


def _device_order(root: Path, name: str) -> tuple[bool, list[tuple[int, str]]]:
    """Physical functions first, then SR-IOV virtual functions (``device/physfn``), each in
    natural order (``mlx5_2`` before ``mlx5_10``): with hundreds of VFs a report's port cap
    must cut VFs, never a physical port (sorted as text, ``mlx5_7`` came after
    ``mlx5_699``)."""
    is_vf = (root / name / "device" / "physfn").exists()
    parts = re.split(r"(\d+)", name)
    return is_vf, [(int(t), "") if t.isdigit() else (-1, t) for t in parts if t]


def _state_name(text: str | None) -> str:
    """``4: ACTIVE`` -> ``ACTIVE`` (the kernel prints the number and the name)."""
    if not text:
        return ""
    return text.split(":", 1)[-1].strip()


def parse_rate_gbps(text: str | None, path: Path | None = None) -> float | None:
    """``400 Gb/sec (4X NDR)`` -> 400.0; ``None`` for an empty or missing file, and for one
    that is not one number of Gb/s (``1.2.3 Gb/sec``, ``. Gb/sec``, ``inf``, a figure past
    :data:`MAX_RATE_GBPS`): a garbled rate costs only the rate, never the port or the
    node's sample. ``path`` names the file in the one warning it gets."""
    if not text:
        return None
    match = _RATE.match(text)
    rate = float(match.group(1)) if match else None
    if rate is None or not math.isfinite(rate) or rate > MAX_RATE_GBPS:
        _unusable(path or Path("rate"), f"{text[:40]!r} is not a rate in Gb/sec")
        return None
    return rate


def sysfs_bdf(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` -> sysfs ``0000:18:00.0`` (4-digit domain, lower case)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    return f"{int(domain, 16):04x}:{rest}" if domain else rest


def _pci_chain(root: Path, device_link: Path) -> tuple[str, list[str]] | None:
    """(host bridge, [PCI functions from the root port down to the device])."""
    try:
        real = Path(os.path.realpath(device_link))
    except OSError:
        return None
    parts = real.parts
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            chain = [p for p in parts[i + 1 :] if _BDF.match(p)]
            return part, chain
    return None


def affinity_level(
    a: tuple[str, list[str]] | None,
    b: tuple[str, list[str]] | None,
    numa_a: int | None,
    numa_b: int | None,
) -> str:
    """nvidia-smi ``topo -m`` level between two PCI devices (see ``wire.NicInfo``).

    PIX when at most one switch port on each side separates them below their deepest
    common bridge, PXB when more; PHB when they meet only at the host bridge; NODE when
    the host bridges differ but the NUMA node is the same; SYS otherwise (or unknown).
    """
    if a is None or b is None:
        return "SYS"
    (host_a, chain_a), (host_b, chain_b) = a, b
    if host_a != host_b:
        same_numa = numa_a is not None and numa_a >= 0 and numa_a == numa_b
        return "NODE" if same_numa else "SYS"
    common = 0
    for x, y in zip(chain_a[:-1], chain_b[:-1], strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    between = (len(chain_a) - 1 - common) + (len(chain_b) - 1 - common)
    return "PIX" if between <= 2 else "PXB"


@dataclass(slots=True)
class _CounterWindow:
    """Values of one counter over the last ``window_s`` seconds, to see a rate rise."""

    points: deque[tuple[float, int]] = field(default_factory=deque)
    rising: bool = False


class NicMonitor:
    """Reads RDMA ports and bonds each tick and turns changes into events.

    Events: ``nic_port_down``/``nic_port_up`` when a port's state changes, also when the
    ``link_downed`` counter rose between two ticks (a flap too short for a poll to see),
    ``nic_gone``/``nic_back`` when a device directory disappears or returns,
    ``nic_errors_rising`` when an error counter grows by ``error_threshold`` or more within
    ``window_s`` (once per episode), ``bond_member_down``/``bond_member_up``.
    """

    def __init__(
        self, root: Path = Path("/sys"), *, error_threshold: int = 10, window_s: float = 60.0
    ) -> None:
        self.root = root
        self.error_threshold = error_threshold
        self.window_s = window_s
        self._ib = root / "class" / "infiniband"
        self._net = root / "class" / "net"
        self._ports: dict[tuple[str, int], NicPortSample] = {}
        self._devices: set[str] = set()
        self._looked = False
        self._windows: dict[tuple[str, int, str], _CounterWindow] = {}
        self._members: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ inventory

    def devices(self) -> list[str]:
        """RDMA devices, physical functions first (see :func:`_device_order`)."""
        try:
            names = [p.name for p in self._ib.iterdir()]
        except OSError:
            return []
        return sorted(names, key=lambda n: _device_order(self._ib, n))

    def ports(self, device: str) -> list[int]:
        try:
            names = [p.name for p in (self._ib / device / "ports").iterdir()]
        except OSError:
            return []
        # ASCII digits only, and a port number the wire can carry (a junk directory name
        # would otherwise fail the whole node's sample, or the agent's start).
        ports = [int(n) for n in names if n.isascii() and n.isdigit() and len(n) < 10]
        return sorted(p for p in ports if p <= limits.INDEX_MAX)

    def inventory(self, gpu_bus_ids: Mapping[int, str]) -> list[NicInfo]:
        """Every RDMA port with its PCI function and its PCIe distance to each GPU."""
        gpus = {}
        for index, bus_id in gpu_bus_ids.items():
            link = self.root / "bus" / "pci" / "devices" / sysfs_bdf(bus_id)
            gpus[index] = (_pci_chain(self.root, link), _numa_node(link / "numa_node"))
        out = []
        for device in self.devices():
            dev_link = self._ib / device / "device"
            chain = _pci_chain(self.root, dev_link)
            numa = _numa_node(dev_link / "numa_node")
            try:
                netdevs = sorted(p.name for p in (dev_link / "net").iterdir())
            except OSError:
                netdevs = []
            for port in self.ports(device):
                base = self._ib / device / "ports" / str(port)
                out.append(
                    NicInfo(
                        device=wire_name(device),
                        port=port,
                        link_layer=(_read(base / "link_layer") or "")[:32],
                        pci_bus_id=chain[1][-1] if chain and chain[1] else "",
                        netdev=wire_name(netdevs[0]) if netdevs else "",
                        numa_node=numa,
                        gpu_affinity={
                            index: affinity_level(chain, g_chain, numa, g_numa)
                            for index, (g_chain, g_numa) in gpus.items()
                        },
                    )
                )
        return out

    # ------------------------------------------------------------------ sampling

    def read_port(self, device: str, port: int) -> NicPortSample | None:
        base = self._ib / device / "ports" / str(port)
        state = _read(base / "state")
        if state is None:
            return None
        counters: dict[str, int] = {}
        for folder, names in (("counters", PORT_COUNTERS), ("hw_counters", HW_COUNTERS)):
            for name in names:
                value = _read_int(base / folder / name)
                if value is not None and value >= 0:
                    counters[name] = value
        try:
            return NicPortSample(
                device=wire_name(device),
                port=port,
                state=_state_name(state)[:32],
                phys_state=_state_name(_read(base / "phys_state"))[:32],
                rate_gbps=parse_rate_gbps(_read(base / "rate"), base / "rate"),
                link_layer=(_read(base / "link_layer") or "")[:32],
                counters=counters,
            )
        except ValidationError as exc:
            # Whatever else the wire refuses costs this port, not the node's sample.
            _unusable(base, f"refused by the wire ({str(exc).splitlines()[0]})")
            return None

    def read_all(self) -> list[NicPortSample]:
        """Every port now, without touching the event state (safe from any thread)."""
        ports = []
        for device in self.devices():
            for port in self.ports(device):
                sample = self.read_port(device, port)
                if sample is not None:
                    ports.append(sample)
        return ports

    def sample(self, now_unix_s: float) -> tuple[list[NicPortSample], list[HardwareEvent]]:
        events: list[HardwareEvent] = []
        ports: list[NicPortSample] = []
        ordered = self.devices()
        present = set(ordered)
        for device in sorted(self._devices - present):
            events.append(
                HardwareEvent(
                    kind="nic_gone",
                    time_unix_s=now_unix_s,
                    device=wire_name(device),
                    detail=wire_name(f"{device} disappeared from {self._ib}", 512),
                )
            )
            for key in [k for k in self._ports if k[0] == device]:
                del self._ports[key]
        for device in sorted(present - self._devices):
            if self._looked:  # not the first look: it came (back)
                events.append(
                    HardwareEvent(
                        kind="nic_back",
                        time_unix_s=now_unix_s,
                        device=wire_name(device),
                        detail=wire_name(f"{device} appeared", 512),
                    )
                )
        self._devices = present
        self._looked = True
        read: set[tuple[str, int]] = set()
        for device in ordered:  # physical functions first: the report's port cap cuts VFs
            for port in self.ports(device):
                sample = self.read_port(device, port)
                if sample is None:
                    continue
                events += self._port_events(device, sample, now_unix_s)
                self._ports[(device, port)] = sample
                read.add((device, port))
                ports.append(sample)
        self._forget_unread(read)
        return ports, events

    def _forget_unread(self, read: set[tuple[str, int]]) -> None:
        """A port not read this tick (its NIC gone, its directory or ``state`` missing) has
        unknown counters: like a counter unknown for a tick, that is a reset, so neither an
        error rise nor a ``link_downed`` flap is computed across the gap when it returns (an
        HCA keeps its counters in firmware: back after a driver rebind they read higher,
        and used to raise ``nic_errors_rising`` for the whole gap). Its last state is kept,
        so a port that returns DOWN is still reported down."""
        for window in [k for k in self._windows if (k[0], k[1]) not in read]:
            del self._windows[window]
        for port, before in self._ports.items():
            if port not in read and before.counters:
                self._ports[port] = before.model_copy(update={"counters": {}})

    def _port_events(self, device: str, sample: NicPortSample, now: float) -> list[HardwareEvent]:
        """Events of one port; ``device`` is the name in sysfs, the key of the port's state
        (``sample.device`` is its wire spelling, which can differ: see :func:`wire_name`)."""
        events: list[HardwareEvent] = []
        before = self._ports.get((device, sample.port))

        def event(kind: str, detail: str, counter: str = "", delta: int | None = None) -> None:
            events.append(
                HardwareEvent(
                    kind=kind,
                    time_unix_s=now,
                    device=sample.device,
                    port=sample.port,
                    counter=counter,
                    delta=delta,
                    detail=detail,
                )
            )

        name = f"{sample.device} port {sample.port}"
        if before is not None:
            was_up, is_up = port_is_up(before.state), port_is_up(sample.state)
            # Only two known readings make a delta: a counter unknown on either side (past
            # 2^63-1, unset, unreadable) is no evidence of a flap.
            now_downs, then_downs = (
                sample.counters.get("link_downed"),
                before.counters.get("link_downed"),
            )
            downs = 0 if now_downs is None or then_downs is None else now_downs - then_downs
            if was_up and not is_up:
                event("nic_port_down", f"{name} {sample.state} ({sample.phys_state})")
            elif is_up and not was_up:
                event("nic_port_up", f"{name} {sample.state} at {sample.rate_gbps or 0:g} Gb/s")
            elif downs > 0:
                event(
                    "nic_port_down",
                    f"{name} went down {downs} time(s) and came back between two reads",
                    "link_downed",
                    downs,
                )
        for counter in ERROR_COUNTERS:
            value = sample.counters.get(counter)
            if value is None:
                # Unknown this tick (missing, unreadable, or a u64 past the wire's range,
                # about to wrap): treated as a reset, so the next known value starts a new
                # window instead of being compared across the gap (no false rise).
                self._windows.pop((device, sample.port, counter), None)
                continue
            rose = self._rise((device, sample.port, counter), value, now)
            if rose is not None:
                rise, span_s = rose
                event(
                    "nic_errors_rising",
                    f"{name}: {counter} +{rise} in {span_s:.0f} s",
                    counter,
                    rise,
                )
        return events

    def _rise(self, key: tuple[str, int, str], value: int, now: float) -> tuple[int, float] | None:
        """(rise, seconds) when counter ``key`` (device, port, name) just passed the
        threshold within the window."""
        window = self._windows.setdefault(key, _CounterWindow())
        points = window.points
        if points and value < points[-1][1]:
            points.clear()  # counter reset (driver reload, port counters cleared)
        # ``now`` is the wall clock: a point stamped after it means the clock was stepped
        # back (an NTP correction). Such points can never age out of the window, so the
        # window would grow until a slow trickle passed the threshold: they are dropped,
        # and the rise is counted afresh from this reading.
        while points and points[-1][0] > now:
            points.pop()
        points.append((now, value))
        while len(points) > 1 and points[1][0] <= now - self.window_s:
            points.popleft()
        rise = value - points[0][1]
        if rise >= self.error_threshold and not window.rising:
            window.rising = True
            return rise, now - points[0][0]
        if rise < self.error_threshold:
            window.rising = False
        return None

    # ------------------------------------------------------------------ bonds

    def bonds(self, now_unix_s: float) -> tuple[list[BondSample], list[HardwareEvent]]:
        out, events = [], []
        for bond in _read_names(self._net / "bonding_masters"):
            base = self._net / bond / "bonding"
            members = []
            for slave in _read_names(base / "slaves"):
                node = self._net / slave
                mii = _read(node / "bonding_slave" / "mii_status") or ""
                members.append(
                    BondMember(
                        name=wire_name(slave),
                        mii_status=mii[:16],
                        operstate=(_read(node / "operstate") or "")[:16],
                        speed_mbps=_in_int32(_read_int(node / "speed", limits.INT32_MAX)),
                        link_failure_count=_nonneg(
                            _read_int(node / "bonding_slave" / "link_failure_count")
                        ),
                    )
                )
                before = self._members.get((bond, slave))
                self._members[(bond, slave)] = mii
                if before is not None and before != mii and mii in ("up", "down"):
                    events.append(
                        HardwareEvent(
                            kind=f"bond_member_{mii}",
                            time_unix_s=now_unix_s,
                            device=wire_name(bond),
                            detail=wire_name(f"{slave} of {bond} is {mii}", 512),
                        )
                    )
            out.append(
                BondSample(
                    name=wire_name(bond),
                    mode=(_read(base / "mode") or "")[:64],
                    active_slave=wire_name(" ".join(_read_names(base / "active_slave"))),
                    members=members[:32],
                )
            )
        return out, events


def _numa_node(path: Path) -> int | None:
    """``numa_node``: -1 (none) up to the wire's index range, else unknown."""
    value = _read_int(path, limits.INDEX_MAX)
    return value if value is None or value >= -1 else None


def _nonneg(value: int | None) -> int | None:
    return value if value is None or value >= 0 else None


def _in_int32(value: int | None) -> int | None:
    return value if value is None or value >= limits.INT32_MIN else None


__all__ = [
    "ERROR_COUNTERS",
    "HW_COUNTERS",
    "MAX_RATE_GBPS",
    "PORT_COUNTERS",
    "UP_STATES",
    "NicMonitor",
    "affinity_level",
    "parse_rate_gbps",
    "port_is_up",
    "sysfs_bdf",
]
