from __future__ import annotations

import binascii
import re
import struct
import zlib

import numpy as np
import pytest

from controller.logic.traffic.enforce import enforce, enforce_changed, walk
from controller.logic.traffic.errors import EnforcementError
from controller.logic.traffic.hashing import HASH_FUNCTIONS, HashConfig, hash_one, hash_ports
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Planner, PlannerConfig
from controller.logic.traffic.topology import Topology
from tests.traffic.plan_checks import off_plan, walked

from .conftest import small_fabric


def test_crc_reference_implementations_match_the_standard_library() -> None:
    msg = struct.pack(">IIIBHH", 7, 0x0A000001, 0x0A000102, 17, 50000, 4791)
    assert hash_one("crc32", 7, 0x0A000001, 0x0A000102, 50000, 4791) == zlib.crc32(msg)
    assert hash_one("crc16-ccitt", 7, 0x0A000001, 0x0A000102, 50000, 4791) == binascii.crc_hqx(
        msg, 0xFFFF
    )
    # CRC-16/CCITT-FALSE check value
    assert binascii.crc_hqx(b"123456789", 0xFFFF) == 0x29B1


@pytest.mark.parametrize("function", HASH_FUNCTIONS)
def test_vectorized_hash_equals_the_per_packet_one(function: str) -> None:
    rng = np.random.default_rng(5)
    ports = rng.integers(0, 65536, size=300)
    for seed, sip, dip in [(0, 1, 2), (0xDEADBEEF, 0x0A000001, 0x0A0003FF)]:
        vec = hash_ports(function, seed, sip, dip, ports, 4791)
        ref = [hash_one(function, seed, sip, dip, int(p), 4791) for p in ports]
        assert vec.tolist() == ref


def _planned(topo: Topology, reorder: bool = False) -> object:
    nodes = [topo.nodes[i].name for i in np.random.default_rng(4).permutation(len(topo.nodes))]
    job = JobSpec(nodes=nodes, gpus_per_node=2, tp=2, channels=2, qps_per_connection=2)
    return Planner(topo, PlannerConfig(reorder_ring=reorder)).plan(job)


@pytest.mark.parametrize(
    ("function", "tiers"), [("crc32", 2), ("crc16-ccitt", 2), ("xor16", 2), ("crc32", 3)]
)
def test_chosen_source_port_lands_on_the_planned_path(function: str, tiers: int) -> None:
    topo = small_fabric(nodes=16, tiers=tiers, leaves_per_pod=4)
    plan = _planned(topo)
    cfg = HashConfig(function=function, default_seed=1234)
    enforced, ports = enforce(plan, cfg)  # type: ignore[arg-type]
    assert (ports >= cfg.sport_min).all() and (ports <= cfg.sport_max).all()
    assert off_plan(enforced, cfg, ports) == []
    fl = enforced.flows
    # queue pairs of one NIC pair get distinct ports, so the NIC can tell them apart
    keys = list(zip(fl.src_node, fl.src_nic, fl.dst_node, fl.dst_nic, ports, strict=True))
    assert len(set(keys)) == len(keys)
    moved = int((enforced.choice != plan.choice).sum())  # type: ignore[attr-defined]
    assert enforced.hash_moved_flows == moved


def test_walk_with_a_different_port_can_leave_the_plan() -> None:
    topo = small_fabric(nodes=16)
    plan = _planned(topo)
    cfg = HashConfig()
    enforced, _ports = enforce(plan, cfg)  # type: ignore[arg-type]
    fl = enforced.flows
    cross = [f for f in range(len(fl)) if len(enforced.sets[enforced.set_of[f]]) > 8]
    f = cross[0]
    want = [int(x) for x in enforced.paths()[f] if x != topo.dummy_link]
    others = [
        walk(
            topo,
            cfg,
            (int(fl.src_node[f]), int(fl.src_nic[f])),
            (int(fl.dst_node[f]), int(fl.dst_nic[f])),
            p,
        )
        for p in range(50000, 50040)
    ]
    assert any(o != want for o in others)  # the port really is what steers the flow


def test_enforcement_after_a_failure_avoids_the_down_link() -> None:
    topo = small_fabric(nodes=16)
    planner = Planner(topo, PlannerConfig(reorder_ring=False))
    plan = _planned(topo)
    link = str(plan.stats()["busiest_link"])  # type: ignore[attr-defined]
    new = planner.replan(plan, [(link, 0.0)])  # type: ignore[arg-type]
    cfg = HashConfig()
    enforced, ports = enforce(new, cfg)
    bad = topo.link_index[link]
    assert all(bad not in links for links in walked(enforced, cfg, ports))


@pytest.mark.parametrize("function", ["crc32", "xor16"])
def test_incremental_enforcement_after_a_replan_steers_moved_flows_and_keeps_the_rest(
    function: str,
) -> None:
    topo = small_fabric(nodes=16)
    planner = Planner(topo, PlannerConfig(reorder_ring=False))
    cfg = HashConfig(function=function)
    plan, ports = enforce(_planned(topo), cfg)  # type: ignore[arg-type]
    link = str(plan.stats()["busiest_link"])
    new = planner.replan(plan, [(link, 0.0)])
    changed = np.flatnonzero((plan.paths() != new.paths()).any(axis=1))
    assert len(changed) > 0
    result = enforce_changed(new, cfg, ports, changed)
    assert result is not None
    same, sports = result
    keep = np.setdiff1d(np.arange(len(ports)), np.union1d(changed, new.reported))
    assert (sports[keep] == ports[keep]).all()  # untouched flows keep their ports
    assert new.reported_flows == len(new.reported)
    assert not np.isin(new.reported, changed).any()  # re-ported flows kept their paths
    assert (new.paths()[new.reported] == plan.paths()[new.reported]).all()
    assert off_plan(same, cfg, sports) == []
    assert all(topo.link_index[link] not in links for links in walked(same, cfg, sports))
    fl = same.flows
    keys = list(zip(fl.src_node, fl.src_nic, fl.dst_node, fl.dst_nic, sports, strict=True))
    assert len(set(keys)) == len(keys)


def test_bad_hash_config_and_exhausted_port_range() -> None:
    topo = small_fabric(nodes=16)
    plan = _planned(topo)
    with pytest.raises(EnforcementError, match=re.escape("hash.function")):
        enforce(plan, HashConfig(function="md5"))  # type: ignore[arg-type]
    with pytest.raises(EnforcementError, match="sport_min"):
        enforce(plan, HashConfig(sport_min=70000))  # type: ignore[arg-type]
    with pytest.raises(EnforcementError, match="no source port"):
        enforce(plan, HashConfig(sport_min=50000, sport_max=50000))  # type: ignore[arg-type]


def test_reachable_mask_is_sound_and_hash_aware_enforcement_keeps_balance() -> None:
    from controller.logic.traffic.enforce import _find_port
    from controller.logic.traffic.reach import reachable

    topo = small_fabric(nodes=64, nics_per_node=2, nodes_per_leaf=8)
    names = [topo.nodes[i].name for i in np.random.default_rng(9).permutation(64)[:48]]
    job = JobSpec(nodes=names, gpus_per_node=2, tp=2, channels=2, grad_bytes=1 << 28)
    plan = Planner(topo, PlannerConfig(reorder_ring=False)).plan(job)
    cfg = HashConfig()
    fl = plan.flows
    checked = 0
    for f in range(0, len(fl), 11):
        cs = plan.sets[plan.set_of[f]]
        src = (int(fl.src_node[f]), int(fl.src_nic[f]))
        dst = (int(fl.dst_node[f]), int(fl.dst_nic[f]))
        mask = reachable(topo, cfg, cs, src, dst)
        sip, dip = topo.nic_ips[src[0]][src[1]], topo.nic_ips[dst[0]][dst[1]]
        dev = f"{topo.nodes[src[0]].name}/nic{src[1]}"
        for c in np.flatnonzero(mask):
            assert _find_port(cfg, cs.choices[c], dev, sip, dip, 0, set()) >= 0
            checked += 1
        assert not mask.all() or len(cs) < 4  # a linear hash cannot reach every combination
    assert checked > 0
    naive, _ = enforce(plan, cfg, hash_aware=False, repair_budget_s=0)
    aware, ports = enforce(plan, cfg)
    assert aware.max_link_time_s() <= naive.max_link_time_s() * (1 + 1e-9)
    assert aware.max_link_time_s() == pytest.approx(plan.max_link_time_s())
    assert (ports >= 0).all()


def test_walk_refuses_a_port_that_would_circle_back_through_the_nic() -> None:
    """A port whose way up is down still reaches the destination back through its NIC and
    the other port: the bond's hash picks it again at the NIC, and the walk went round for
    ever (found by the topology sweep's random fabrics); now it says so."""
    topo = small_fabric(nodes=8)
    topo.health[topo.link_index["node-00000/nic0/p0->leaf-g000-r0-p0"]] = 0.0
    cfg = HashConfig()
    outcomes = []
    for sport in range(50000, 50032):
        try:
            outcomes.append(len(walk(topo, cfg, (0, 0), (5, 0), sport)) > 0)
        except EnforcementError as exc:
            assert "loops at node-00000/nic0" in str(exc)
            outcomes.append(False)
    assert True in outcomes and False in outcomes  # the other port still carries packets
