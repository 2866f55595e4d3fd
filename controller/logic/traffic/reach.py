"""Which candidate paths of a NIC pair some source port can actually reach under the hash.

Every CRC is linear, so the decisions devices on one path make are linear functions of the
same source-port bits; when two devices read overlapping output bits, some combinations of
choices never happen, whatever the port. Planning over unreachable candidates and then
forcing flows elsewhere piles them up (measured: the busiest link doubled at 4k GPUs), so
the planner, when given a hash model, plans over reachable candidates only.

For one NIC pair we evaluate each device's decision for a window of source ports once and
test every candidate against those vectors: O(devices + candidates·depth) vector ops.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.routes import SRC_DEVICE, CandidateSet
from controller.logic.traffic.topology import Topology

BoolArray = npt.NDArray[np.bool_]

#: Source ports examined per NIC pair; a path reached by 1 in 64 ports is hit ~16 times.
WINDOW = 1024

_Shape = tuple[list[tuple[str, int]], npt.NDArray[np.int64], npt.NDArray[np.int64], object]
_SHAPES: dict[int, _Shape] = {}


def _shape(cs: CandidateSet) -> _Shape:
    """Decision devices and per-candidate (device, branch) tables, shared by every NIC pair
    whose candidates come from the same template (the choices list is the same object)."""
    hit = _SHAPES.get(id(cs.choices))
    if hit is not None and hit[3] is cs.choices:
        return hit
    keys: dict[tuple[str, int], int] = {}
    depth = max((len(ch) for ch in cs.choices), default=0)
    key_idx = np.zeros((len(cs), max(depth, 1)), dtype=np.int64)
    want = np.full((len(cs), max(depth, 1)), -1, dtype=np.int64)
    for c, choices in enumerate(cs.choices):
        for d, (device, idx, n) in enumerate(choices):
            key_idx[c, d] = keys.setdefault((device, n), len(keys))
            want[c, d] = idx
    shape: _Shape = (list(keys), key_idx, want, cs.choices)
    if len(_SHAPES) > 100_000:
        _SHAPES.clear()
    _SHAPES[id(cs.choices)] = shape
    return shape


def reachable(
    topo: Topology, cfg: HashConfig, cs: CandidateSet, src: tuple[int, int], dst: tuple[int, int]
) -> BoolArray:
    """For each candidate of ``cs``: does some port in the first WINDOW of the range hit it?"""
    keys, key_idx, want, _ = _shape(cs)
    if not keys:
        return np.ones(len(cs), dtype=bool)
    sip, dip = topo.nic_ips[src[0]][src[1]], topo.nic_ips[dst[0]][dst[1]]
    src_dev = f"{topo.nodes[src[0]].name}/nic{src[1]}"
    ports = cfg.sport_min + np.arange(min(WINDOW, cfg.sport_max - cfg.sport_min + 1))
    dec = np.empty((len(keys) + 1, ports.shape[0]), dtype=np.int64)
    for k, (device, n) in enumerate(keys):
        host = device == SRC_DEVICE
        dec[k] = cfg.indices(src_dev if host else device, host, sip, dip, ports, n)
    dec[len(keys)] = -1  # padding row matches the -1 padding of ``want``
    key_idx = np.where(want < 0, len(keys), key_idx)
    hits = (dec[key_idx] == want[:, :, None]).all(axis=1)
    ok: BoolArray = hits.any(axis=1)
    return ok


__all__ = ["WINDOW", "reachable"]
