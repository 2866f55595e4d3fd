"""Models of the ECMP / bond hashes switches and NICs apply to a RoCEv2 packet's 5-tuple.

RoCEv2 is UDP to port 4791; the UDP source port carries no meaning for the receiver and is
there for entropy, so a sender that knows the fabric's hash can pick the path of each queue
pair by picking its source port (what C4P does, since NCCL cannot choose a path itself).

A device's decision is ``hash(seed ‖ src_ip ‖ dst_ip ‖ proto ‖ sport ‖ dport) mod n`` over
its n equal-cost next hops ordered by link name. The seed differs per device (switch
vendors seed per box to avoid hash polarization); by default it is derived from the device
name, and it can be set per device when the real seeds are known. Implemented functions:

- ``crc32``: IEEE 802.3 CRC-32 (zlib's), the default on many Broadcom-based switches;
- ``crc16-ccitt``: CRC-16/CCITT (poly 0x1021, init 0xFFFF), another common ASIC choice;
- ``xor16``: XOR of the 16-bit words of the header fields, the cheapest (and most prone
  to polarization: decisions at different tiers may be correlated and unsatisfiable);
- ``linux-l34``: the Linux bonding driver's ``xmit_hash_policy=layer3+4``, the default
  for the bond's choice of port at the sending host.

A seed prefixed to a CRC only XORs a constant into the result, so two devices using the
same output bits make perfectly correlated choices (hash polarization). Switch ASICs avoid
it by taking different bits per device; we model that with a per-device right shift,
derived from the device name unless configured.

CRCs are affine over GF(2), so for messages that differ only in the source port,
``crc(m_p) = crc(m_0) ^ crc(d_p) ^ crc(0)``; a table of ``crc(d_p) ^ crc(0)`` over all
65,536 ports lets us evaluate every source port at once with one XOR.
"""

from __future__ import annotations

import binascii
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.errors import EnforcementError

U32Array = npt.NDArray[np.uint32]
HASH_FUNCTIONS = ("crc32", "crc16-ccitt", "xor16", "linux-l34")
_MAX_SHIFT = {"crc32": 16, "crc16-ccitt": 8, "xor16": 8, "linux-l34": 0}
ROCE_V2_DPORT = 4791
UDP = 17
_FMT = ">IIIBHH"  # seed, src ip, dst ip, protocol, source port, destination port
_SPORT_OFFSET = 13


@dataclass(kw_only=True, slots=True)
class HashConfig:
    function: str = "crc32"
    """Switch ECMP hash, one of HASH_FUNCTIONS."""
    bond_function: str = "linux-l34"
    """Hash the sending host's bond uses to pick a port."""
    default_seed: int = 0
    """Mixed into every device's name-derived seed; set it to match a site-wide seed."""
    seeds: dict[str, int] = field(default_factory=dict)
    """Known per-device seeds (device name → seed), overriding the derived ones."""
    shifts: dict[str, int] = field(default_factory=dict)
    """Known per-device output bit offsets (device name → right shift)."""
    sport_min: int = 49152
    """Lowest UDP source port we may choose (RoCE stacks use the dynamic range)."""
    sport_max: int = 65535
    dport: int = ROCE_V2_DPORT

    def validate(self) -> None:
        for key in ("function", "bond_function"):
            if getattr(self, key) not in HASH_FUNCTIONS:
                raise EnforcementError(
                    f"hash.{key} {getattr(self, key)!r} is not one of {', '.join(HASH_FUNCTIONS)}"
                )
        if not 0 <= self.sport_min <= self.sport_max <= 0xFFFF:
            raise EnforcementError("hash.sport_min..sport_max must lie within 0..65535")

    def seed_of(self, device: str) -> int:
        if device in self.seeds:
            return self.seeds[device] & 0xFFFFFFFF
        return (zlib.crc32(device.encode()) ^ self.default_seed) & 0xFFFFFFFF

    def function_of(self, host: bool) -> str:
        return self.bond_function if host else self.function

    def shift_of(self, device: str, host: bool) -> int:
        if device in self.shifts:
            return self.shifts[device]
        top = _MAX_SHIFT[self.function_of(host)]
        return (zlib.crc32(b"shift:" + device.encode()) % (top + 1)) if top else 0

    def index(self, device: str, host: bool, sip: int, dip: int, sport: int, n: int) -> int:
        """The next-hop index (of n) this device picks for one packet."""
        h = hash_one(self.function_of(host), self.seed_of(device), sip, dip, sport, self.dport)
        return (h >> self.shift_of(device, host)) % n

    def indices(
        self, device: str, host: bool, sip: int, dip: int, sports: npt.NDArray[np.int64], n: int
    ) -> npt.NDArray[np.int64]:
        """:meth:`index` for many source ports at once."""
        h = hash_ports(self.function_of(host), self.seed_of(device), sip, dip, sports, self.dport)
        return ((h >> np.uint32(self.shift_of(device, host))) % np.uint32(n)).astype(np.int64)


def _crc16(data: bytes) -> int:
    return binascii.crc_hqx(data, 0xFFFF)


def _message(seed: int, sip: int, dip: int, sport: int, dport: int, proto: int = UDP) -> bytes:
    return struct.pack(_FMT, seed & 0xFFFFFFFF, sip, dip, proto, sport, dport)


def hash_one(function: str, seed: int, sip: int, dip: int, sport: int, dport: int) -> int:
    """The reference (one packet) implementation of every hash function."""
    if function == "crc32":
        return zlib.crc32(_message(seed, sip, dip, sport, dport))
    if function == "crc16-ccitt":
        return _crc16(_message(seed, sip, dip, sport, dport))
    if function == "xor16":
        words = struct.unpack(">HHHHHH", struct.pack(">III", seed & 0xFFFFFFFF, sip, dip))
        h = UDP ^ sport ^ dport
        for w in words:
            h ^= w
        return h
    if function == "linux-l34":
        return _linux_l34(sip, dip, sport, dport)
    raise EnforcementError(f"unknown hash function {function!r}")


def _linux_l34(sip: int, dip: int, sport: int, dport: int) -> int:
    h = ((sport << 16) | dport) ^ sip ^ dip
    h ^= h >> 16
    h ^= h >> 8
    return h >> 1


_DELTA: dict[str, U32Array] = {}


def _delta_table(function: str) -> U32Array:
    """crc(d_p) ^ crc(0) for every source port p (d_p: all-zero message but the port)."""
    table = _DELTA.get(function)
    if table is None:
        crc = zlib.crc32 if function == "crc32" else _crc16
        zero = bytes(struct.calcsize(_FMT))
        base = crc(zero)
        buf = bytearray(zero)
        out = np.empty(1 << 16, dtype=np.uint32)
        for p in range(1 << 16):
            buf[_SPORT_OFFSET] = p >> 8
            buf[_SPORT_OFFSET + 1] = p & 0xFF
            out[p] = crc(bytes(buf)) ^ base
        table = _DELTA[function] = out
    return table


def hash_ports(
    function: str, seed: int, sip: int, dip: int, sports: npt.NDArray[np.int64], dport: int
) -> U32Array:
    """``hash_one`` for many source ports at once (same seed, addresses and dport)."""
    if function == "xor16":
        const = hash_one("xor16", seed, sip, dip, 0, dport)
        return (np.uint32(const) ^ sports.astype(np.uint32)).astype(np.uint32)
    if function == "linux-l34":
        h = ((sports.astype(np.uint64) << np.uint64(16)) | np.uint64(dport)) ^ np.uint64(sip ^ dip)
        h ^= h >> np.uint64(16)
        h ^= h >> np.uint64(8)
        return (h >> np.uint64(1)).astype(np.uint32)
    if function in ("crc32", "crc16-ccitt"):
        base = hash_one(function, seed, sip, dip, 0, dport)
        return (np.uint32(base) ^ _delta_table(function)[sports]).astype(np.uint32)
    raise EnforcementError(f"unknown hash function {function!r}")


__all__ = ["HASH_FUNCTIONS", "ROCE_V2_DPORT", "HashConfig", "hash_one", "hash_ports"]
