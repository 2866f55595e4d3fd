"""Links of NICs with errors or flaps lose capacity in the plan (issue 17), pure parts."""

from __future__ import annotations

import numpy as np

from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.nic_links import merge_link_factors, nic_link_factors, nic_links
from controller.logic.traffic.planner import Planner, PlannerConfig
from controller.logic.traffic.topofile import topology_from_dict
from controller.logic.traffic.topology import Topology


def two_rail_bonds() -> Topology:
    """Nodes a, b on leaf A, c on leaf B; each node has two NICs on its leaf."""
    leaf = {"a": "A", "b": "A", "c": "B"}
    return topology_from_dict(
        {
            "name": "rails",
            "port_speed_gbps": 100,
            "switches": [
                {"name": "A", "tier": 1},
                {"name": "B", "tier": 1},
                {"name": "s", "tier": 2},
            ],
            "cables": [{"lower": "A", "upper": "s"}, {"lower": "B", "upper": "s"}],
            "nodes": [
                {
                    "name": n,
                    "nics": [{"ports": [{"leaf": leaf[n]}]}, {"ports": [{"leaf": leaf[n]}]}],
                }
                for n in sorted(leaf)
            ],
        }
    )


def test_a_suspect_nic_degrades_both_directions_of_each_of_its_ports() -> None:
    topo = two_rail_bonds()
    assert nic_links(topo, "b", 1) == ["b/nic1/p0->A", "A->b/nic1/p0"]
    assert nic_links(topo, "zz", 0) == [] and nic_links(topo, "b", 2) == []
    got = nic_link_factors(
        topo, [("b", 1, "nic_errors_rising"), ("b", 1, "nic_port_down"), ("a", 0, "nvlink_down")]
    )
    assert got == [("A->b/nic1/p0", 0.25), ("b/nic1/p0->A", 0.25)]
    assert nic_link_factors(topo, [("c", 0, "nic_gone")]) == [
        ("B->c/nic0/p0", 0.05),
        ("c/nic0/p0->B", 0.05),
    ]
    assert merge_link_factors([("x", 0.1), ("y", 0.9)], [("y", 0.5)]) == [("x", 0.1), ("y", 0.5)]


def test_a_replan_gives_the_suspect_nics_links_the_lower_capacity() -> None:
    topo = two_rail_bonds()
    planner = Planner(topo, PlannerConfig(reorder_ring=False))
    plan = planner.plan(JobSpec(nodes=["a", "b", "c"], gpus_per_node=2, tp=1, grad_bytes=1 << 26))
    changes = nic_link_factors(topo, [("c", 1, "nic_errors_rising")])
    ids = [topo.link_index[name] for name, _ in changes]
    assert plan.loads_bytes[ids].sum() > 0  # rail 1 of c carries the job's traffic
    new = planner.replan(plan, changes)
    assert new.changes == [{"link": name, "health": 0.5} for name, _ in changes]
    assert np.allclose(topo.capacity_ext()[ids], 0.5 * topo.base_capacity_bytes_per_s[ids])
    # The other rail and the other nodes keep their full capacity.
    others = [topo.link_index[n] for n in nic_links(topo, "c", 0) + nic_links(topo, "a", 1)]
    assert np.allclose(topo.capacity_ext()[others], topo.base_capacity_bytes_per_s[others])
