from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.logic.traffic.errors import JobSpecError
from controller.logic.traffic.jobs import (
    JobSpec,
    build_flows,
    node_locality_key,
    ring_crossings,
    ring_order,
    topology_node_order,
)

from .conftest import small_fabric


def test_dp_rings_one_rank_per_node() -> None:
    topo = small_fabric(nics_per_node=8)
    nodes = [n.name for n in topo.nodes][:4]
    job = JobSpec(nodes=nodes, tp=8, grad_bytes=1000, channels=2)
    flows = build_flows(job, topo)
    # 8 DP rings (one per GPU/NIC), 4 cross-node edges each, 2 channels each
    assert len(flows) == 8 * 4 * 2
    assert np.allclose(flows.size_bytes, 2 * 3 / 4 * 1000 / 2)
    # rail-aligned: GPU k talks through NIC k at both ends
    assert (flows.src_nic == flows.dst_nic).all()
    assert {c.kind for c in flows.collectives} == {"dp"}
    assert all(len(c.ranks) == 4 for c in flows.collectives)


def test_intra_node_tp_costs_nothing_and_pipeline_sends_both_ways() -> None:
    topo = small_fabric(nics_per_node=8)
    nodes = [n.name for n in topo.nodes][:4]
    job = JobSpec(
        nodes=nodes, tp=8, pp=2, grad_bytes=1000, pp_bytes=50, tp_bytes=10, qps_per_connection=2
    )
    flows = build_flows(job, topo)
    assert not flows.phase("tp").any()
    pp = flows.phase("pp")
    # stage boundary between node ranks 0->2 and 1->3: 2 dp x 8 tp pairs, both ways, 2 QPs
    assert pp.sum() == 16 * 2 * 2
    assert np.allclose(flows.size_bytes[pp], 25)


def test_channels_spread_over_node_members_when_tp_is_small() -> None:
    topo = small_fabric(nics_per_node=8)
    job = JobSpec(nodes=[n.name for n in topo.nodes][:2], tp=1, channels=8, grad_bytes=1 << 20)
    flows = build_flows(job, topo)
    # one ring of 16 ranks over 2 nodes: 2 node edges x 8 channels, each on its own NIC
    assert len(flows) == 16
    assert sorted(set(flows.src_nic.tolist())) == list(range(8))


def test_job_validation_errors() -> None:
    topo = small_fabric()
    with pytest.raises(JobSpecError, match="not in topology"):
        JobSpec(nodes=["ghost"]).validate(topo)
    with pytest.raises(JobSpecError, match="listed twice"):
        JobSpec(nodes=["node-00000", "node-00000"]).validate(topo)
    with pytest.raises(JobSpecError, match="does not divide"):
        JobSpec(nodes=["node-00000"], tp=3).validate(topo)
    with pytest.raises(JobSpecError, match="channels"):
        JobSpec(nodes=["node-00000"], channels=0).validate(topo)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_ring_order_is_a_permutation_with_minimal_crossings(keys: list[int]) -> None:
    members = list(enumerate(keys))
    order = ring_order(members, key=lambda m: m[1])
    assert sorted(order) == sorted(members)  # every rank exactly once
    distinct = len(set(keys))
    assert ring_crossings(order, key=lambda m: m[1]) == (distinct if distinct > 1 else 0)


def test_topology_node_order_groups_leaves_and_keeps_every_node() -> None:
    topo = small_fabric(nodes=32)
    rng = np.random.default_rng(3)
    nodes = [topo.nodes[i].name for i in rng.permutation(32)]
    order = topology_node_order(topo, nodes)
    assert sorted(order) == sorted(nodes)
    key = lambda n: node_locality_key(topo, n)  # noqa: E731
    assert ring_crossings(order, key) == len({key(n) for n in nodes})
    assert ring_crossings(nodes, key) > ring_crossings(order, key)
