"""Link names whose endpoints contain ``--`` themselves (found by the acceptance probe: the
cable of switch ``l--1`` could not be named ``l--1--s0``, the split was at the first ``--``)."""

from __future__ import annotations

from typing import Any

import pytest

from controller.logic.traffic.errors import TopologyError
from controller.logic.traffic.topofile import topology_from_dict


def fabric(leaves: list[str], spines: list[str]) -> dict[str, Any]:
    return {
        "name": "t",
        "port_speed_gbps": 100,
        "switches": [{"name": n, "tier": 1} for n in leaves]
        + [{"name": n, "tier": 2} for n in spines],
        "cables": [{"lower": leaf, "upper": s} for leaf in leaves for s in spines],
        "nodes": [
            {"name": f"n{i}", "nics": [{"ports": [{"leaf": leaf}]}]}
            for i, leaf in enumerate(leaves)
        ],
    }


@pytest.mark.parametrize("spec", ["l--1--s0", "s0--l--1", "l--1<->s0", "s0<->l--1"])
def test_a_switch_named_with_dashes_is_found_at_any_split(spec: str) -> None:
    topo = topology_from_dict(fabric(["l0", "l--1"], ["s0"]))
    names = sorted(topo.link_names[i] for i in topo.resolve_link(spec))
    assert names == ["l--1->s0", "s0->l--1"]


def test_plain_names_still_resolve_and_unknown_ones_are_refused() -> None:
    topo = topology_from_dict(fabric(["l0", "l--1"], ["s0"]))
    assert [topo.link_names[i] for i in topo.resolve_link("l--1->s0")] == ["l--1->s0"]
    assert sorted(topo.link_names[i] for i in topo.resolve_link("l0--s0")) == [
        "l0->s0",
        "s0->l0",
    ]
    with pytest.raises(TopologyError, match="unknown link 'l--1--s9'"):
        topo.resolve_link("l--1--s9")


def test_a_name_that_splits_two_ways_is_refused_as_ambiguous() -> None:
    # Leaves a and a--b, spines c and b--c: "a--b--c" names a<->b--c and a--b<->c.
    topo = topology_from_dict(fabric(["a", "a--b"], ["c", "b--c"]))
    with pytest.raises(TopologyError, match=r"ambiguous link 'a--b--c'.*'a->b' for one"):
        topo.resolve_link("a--b--c")
    assert [topo.link_names[i] for i in topo.resolve_link("a--b->c")] == ["a--b->c"]
