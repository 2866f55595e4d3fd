"""Builds a sysfs tree laid out as the Linux kernel does, for the NIC monitor's tests.

The shape follows a real HGX-style node: PCI functions live under
``devices/pci<domain>:<bus>/<root port>/<switch up>/<switch down>/<function>``;
``bus/pci/devices/<bdf>`` and ``class/infiniband/<dev>`` are *relative* symlinks into that
tree (as the kernel makes them), the RDMA device directory sits under its PCI function
(``<function>/infiniband/<dev>``) with a ``device`` link back up, and network interfaces
under ``<function>/net/<if>`` or ``devices/virtual/net/<bond>``. Paths and file formats
are from Documentation/ABI/stable/sysfs-class-infiniband, Documentation/ABI/testing/
sysfs-bus-pci, Documentation/ABI/testing/sysfs-class-net and
Documentation/networking/bonding.rst.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: (sim GPU index, host bridge, PCI chain below it, NUMA node). The sim's GPUs have bus ids
#: 00000000:18:00.0, :28:, :38:, :48: (see agents.gpu.sim).
GPUS = {
    0: ("pci0000:00", ["0000:00:01.0", "0000:10:00.0", "0000:11:00.0", "0000:18:00.0"], 0),
    1: ("pci0000:00", ["0000:00:03.0", "0000:28:00.0"], 0),
    2: ("pci0000:40", ["0000:40:01.0", "0000:38:00.0"], 0),
    3: ("pci0000:80", ["0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:48:00.0"], 1),
}
#: RDMA devices: (host bridge, chain, NUMA node, netdev). mlx5_0 shares GPU 0's switch;
#: mlx5_1 shares GPU 3's.
NICS = {
    "mlx5_0": ("pci0000:00", ["0000:00:01.0", "0000:10:00.0", "0000:11:01.0", "0000:19:00.0"], 0,
               "ibp25s0"),
    "mlx5_1": ("pci0000:80", ["0000:80:01.0", "0000:81:00.0", "0000:82:01.0", "0000:49:00.0"], 1,
               "ibp73s0"),
}  # fmt: skip


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


class SysfsTree:
    def __init__(self, root: Path) -> None:
        self.root = root

    def pci_function(self, host: str, chain: list[str], numa: int) -> Path:
        path = self.root / "devices" / host
        for bdf in chain:
            path = path / bdf
        _write(path / "numa_node", str(numa))
        _link(self.root / "bus" / "pci" / "devices" / chain[-1], path)
        return path

    def build(self) -> SysfsTree:
        for host, chain, numa in GPUS.values():
            self.pci_function(host, chain, numa)
        for name in NICS:
            self.add_nic(name)
        self.add_bond("bond0", ["eno1", "eno2"])
        return self

    # ------------------------------------------------------------------ RDMA

    def add_nic(self, name: str) -> None:
        host, chain, numa, netdev = NICS[name]
        function = self.pci_function(host, chain, numa)
        dev = function / "infiniband" / name
        _link(dev / "device", function)
        (function / "net" / netdev).mkdir(parents=True, exist_ok=True)
        _link(self.root / "class" / "infiniband" / name, dev)
        self.set_port(name, 1, state="4: ACTIVE", phys_state="5: LinkUp")
        _write(dev / "ports" / "1" / "rate", "400 Gb/sec (4X NDR)")
        _write(dev / "ports" / "1" / "link_layer", "InfiniBand")
        for counter in ("symbol_error", "port_rcv_errors", "link_downed", "port_xmit_data",
                        "VL15_dropped"):  # fmt: skip
            self.set_counter(name, 1, counter, 0)
        for counter in ("np_cnp_sent", "rp_cnp_handled", "out_of_sequence", "lifespan"):
            self.set_counter(name, 1, counter, 0, hw=True)

    def port_dir(self, name: str, port: int) -> Path:
        return self.root / "class" / "infiniband" / name / "ports" / str(port)

    def set_port(self, name: str, port: int, *, state: str, phys_state: str) -> None:
        _write(self.port_dir(name, port) / "state", state)
        _write(self.port_dir(name, port) / "phys_state", phys_state)

    def set_counter(self, name: str, port: int, counter: str, value: int, hw: bool = False) -> None:
        folder = "hw_counters" if hw else "counters"
        _write(self.port_dir(name, port) / folder / counter, str(value))

    def remove_nic(self, name: str) -> None:
        """The card falls off the bus: its class link and its PCI function disappear."""
        host, chain, _, _ = NICS[name]
        (self.root / "class" / "infiniband" / name).unlink()
        (self.root / "bus" / "pci" / "devices" / chain[-1]).unlink()
        function = self.root / "devices" / host
        for bdf in chain:
            function = function / bdf
        shutil.rmtree(function)

    # ------------------------------------------------------------------ bonds

    def add_bond(self, bond: str, members: list[str]) -> None:
        net = self.root / "class" / "net"
        virtual = self.root / "devices" / "virtual" / "net" / bond
        _write(virtual / "bonding" / "mode", "802.3ad 4")
        _write(virtual / "bonding" / "slaves", " ".join(members))
        _write(virtual / "bonding" / "active_slave", "")
        _write(virtual / "operstate", "up")
        _link(net / bond, virtual)
        _write(net / "bonding_masters", bond)
        for i, member in enumerate(members):
            host, chain = "pci0000:00", ["0000:00:1c.0", f"0000:0{i + 5}:00.0"]
            function = self.pci_function(host, chain, 0)
            iface = function / "net" / member
            _write(iface / "operstate", "up")
            _write(iface / "speed", "100000")
            self.set_member(member, "up", 0, iface)
            _link(net / member, iface)

    def set_member(self, member: str, mii: str, failures: int, iface: Path | None = None) -> None:
        base = iface if iface is not None else self.root / "class" / "net" / member
        _write(base / "bonding_slave" / "mii_status", mii)
        _write(base / "bonding_slave" / "link_failure_count", str(failures))
        _write(base / "operstate", "up" if mii == "up" else "down")
