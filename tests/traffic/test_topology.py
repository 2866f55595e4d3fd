from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from controller.logic.traffic.errors import TopologyError
from controller.logic.traffic.fattree import MAX_LINKS, MAX_SWITCHES, FatTreeSpec, build_fat_tree
from controller.logic.traffic.topofile import (
    LabelFabric,
    load_topology,
    topology_from_dict,
    topology_from_labels,
)

GBPS = 1e9 / 8


def test_two_tier_rail_optimized_bonded_counts_and_oversubscription() -> None:
    topo = build_fat_tree(
        FatTreeSpec(
            nodes=32, nics_per_node=8, ports_per_nic=2, nodes_per_leaf=16, oversubscription=2.0
        )
    )
    tiers = topo.summary()["switches_by_tier"]
    # 2 groups x 8 rails x 2 planes leaves; 16 downlinks / 2 = 8 spines
    assert tiers == {"1": 32, "2": 8}
    leaf = "leaf-g001-r3-p1"
    down = sum(
        topo.base_capacity_bytes_per_s[topo.link_index[f"{leaf}->{n}/nic3/p1"]]
        for n in (f"node-{i:05d}" for i in range(16, 32))
    )
    up = sum(topo.base_capacity_bytes_per_s[lk] for _s, lk in topo.up[leaf])
    assert down / up == pytest.approx(2.0)
    # rail k: NIC 3 port 1 of node 20 sits on rail 3, plane 1 of group 1
    assert topo.ports[20][3][1].leaf == leaf


def test_three_tier_has_pods_and_cores() -> None:
    topo = build_fat_tree(
        FatTreeSpec(nodes=32, nics_per_node=2, tiers=3, nodes_per_leaf=4, leaves_per_pod=4)
    )
    assert topo.max_tier == 3
    pods = topo.pods()
    assert len(set(pods.values())) == 4  # 16 leaves / 4 per pod


def test_link_health_and_resolution(traffic_fabric) -> None:
    topo = traffic_fabric
    both = topo.resolve_link("leaf-g000-r0-p0--spine-000")
    assert len(both) == 2
    topo.set_health(both, 0.0)
    assert not topo.alive(both[0])
    assert np.isinf(topo.capacity_ext()[-1])
    with pytest.raises(TopologyError, match="unknown link"):
        topo.resolve_link("nope--spine-000")
    with pytest.raises(TopologyError, match=re.escape("within 0..1")):
        topo.set_health(both, 1.5)


EXPLICIT = {
    "name": "tiny",
    "switches": [
        {"name": "l0", "tier": 1},
        {"name": "l1", "tier": 1},
        {"name": "s0", "tier": 2},
    ],
    "cables": [
        {"lower": "l0", "upper": "s0"},
        {"lower": "l1", "upper": "s0", "capacity_gbps": 400},
    ],
    "nodes": [
        {"name": "a", "nics": [{"ports": [{"leaf": "l0"}]}]},
        {
            "name": "b",
            "nics": [{"ports": [{"leaf": "l1", "capacity_gbps": 100}], "ip": "10.9.9.9"}],
        },
    ],
}


def test_explicit_document_builds() -> None:
    topo = topology_from_dict(EXPLICIT)
    assert topo.base_capacity_bytes_per_s[topo.link_index["l1->s0"]] == 400 * GBPS
    assert topo.base_capacity_bytes_per_s[topo.link_index["b/nic0/p0->l1"]] == 100 * GBPS
    assert topo.nic_ips[1][0] == (10 << 24) | (9 << 16) | (9 << 8) | 9


def _mutate(path: list[object], value: object) -> dict[str, object]:
    doc = json.loads(json.dumps(EXPLICIT))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["bogus"], 1, "bogus: Extra inputs are not permitted"),
        (["nodes", 0, "nics", 0, "ports", 0, "leaf"], "l9", "nodes.0.nics.0.ports.0.leaf: unknown"),
        (["cables", 0, "upper"], "zz", "cables.0.upper: unknown switch"),
        (["switches", 2, "tier"], 7, "switches.2.tier"),
        (["cables", 1, "capacity_gbps"], -1, "cables.1.capacity_gbps"),
        (["switches", 1, "tier"], 2, "must join tier t to tier t+1"),
        (["nodes", 0, "nics", 0, "ports", 0, "leaf"], "s0", "not a tier-1 switch"),
        (["nodes", 1, "name"], "a", "defined twice"),
        (["nodes", 0, "nics", 0, "ip"], "999.1.1.1", "nodes.0.nics.0.ip"),
        (["cables"], [{"lower": "l0", "upper": "s0"}], "no path to the rest"),
    ],
)
def test_validation_errors_are_one_line_and_name_the_field(path, value, message) -> None:
    with pytest.raises(TopologyError) as err:
        topology_from_dict(_mutate(path, value))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_fat_tree_and_explicit_are_exclusive_and_one_is_needed() -> None:
    with pytest.raises(TopologyError, match="not both"):
        topology_from_dict({**EXPLICIT, "fat_tree": {"nodes": 2}})
    with pytest.raises(TopologyError, match="needs fat_tree"):
        topology_from_dict({"name": "x"})
    with pytest.raises(TopologyError, match=re.escape("fat_tree.tiers")):
        topology_from_dict({"fat_tree": {"nodes": 2, "tiers": 4}})


@pytest.mark.parametrize(
    ("fat_tree", "message"),
    [
        # 16 / 1e-300 uplinks per leaf: the builder used to make spine names for ever.
        (
            {"nodes": 16, "nodes_per_leaf": 4, "oversubscription": 1e-300},
            "fat_tree.oversubscription",
        ),
        ({"nodes": 16, "oversubscription": 5e-324}, "fat_tree.oversubscription"),
        ({"nodes": 4, "nodes_per_leaf": 10**12}, "fat_tree.nodes_per_leaf"),
        ({"nodes": 4, "tiers": 3, "leaves_per_pod": 10**9}, "fat_tree.leaves_per_pod"),
        (
            {"nodes": 64, "tiers": 3, "leaves_per_pod": 4, "core_oversubscription": 1e-300},
            "fat_tree.core_oversubscription",
        ),
        ({"nodes": 2, "nodes_per_leaf": 199_999}, f"the limit is {MAX_SWITCHES}"),
        ({"nodes": 500_000, "nodes_per_leaf": 64}, f"the limit is {MAX_LINKS} links"),
        ({"nodes": 4, "oversubscription": float("nan")}, "fat_tree.oversubscription"),
    ],
)
def test_fat_tree_past_the_size_limit_is_refused_at_once(
    fat_tree: dict[str, object], message: str
) -> None:
    with pytest.raises(TopologyError) as err:
        topology_from_dict({"fat_tree": fat_tree})
    assert message in str(err.value) and "\n" not in str(err.value)
    spec = FatTreeSpec(**{k: v for k, v in fat_tree.items()})  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="fat_tree"):
        build_fat_tree(spec)


def test_fat_tree_size_limit_reaches_the_controller_and_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from controller.errors import BadConfig
    from controller.services.traffic.service import load_fabric
    from trainguard.cli.cmd_plan import app

    huge = tmp_path / "huge.yaml"
    huge.write_text("fat_tree: {nodes: 16, nodes_per_leaf: 4, oversubscription: 1.0e-300}\n")
    with pytest.raises(BadConfig) as err:
        load_fabric(huge)
    assert str(err.value).startswith(f"topology_file {huge}: fat_tree.oversubscription")
    assert "\n" not in str(err.value)
    res = CliRunner().invoke(app, ["simulate", "-t", str(huge)])
    assert res.exit_code == 2, res.output
    out = res.stderr if res.stderr_bytes is not None else res.output
    assert out.count("\n") == 1 and "fat_tree.oversubscription" in out


def test_load_yaml_and_json_files(tmp_path: Path) -> None:
    y = tmp_path / "fabric.yaml"
    y.write_text("name: f\nfat_tree:\n  nodes: 8\n  nics_per_node: 2\n  nodes_per_leaf: 4\n")
    assert len(load_topology(y).nodes) == 8
    j = tmp_path / "fabric.json"
    j.write_text(json.dumps(EXPLICIT))
    assert load_topology(j).name == "tiny"
    bad = tmp_path / "bad.yaml"
    bad.write_text("fat_tree: [unclosed\n")
    with pytest.raises(TopologyError, match="cannot parse") as info:
        load_topology(bad)
    assert str(info.value) == (
        f"{bad}: cannot parse: expected ',' or ']', but got '<stream end>' at line 2, column 1"
    )
    with pytest.raises(TopologyError, match="No such file"):
        load_topology(tmp_path / "missing.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TopologyError) as info:
        load_topology(binary)
    assert str(info.value) == f"{binary}: not UTF-8 text"
    with pytest.raises(TopologyError) as info:
        load_topology(tmp_path)
    assert str(info.value) == f"{tmp_path}: Is a directory"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["port_speed_gbps"], math.inf, "port_speed_gbps: Input should be a finite number"),
        (["port_speed_gbps"], 1e300, "port_speed_gbps: Input should be less than or equal"),
        (["cables", 0, "capacity_gbps"], math.inf, "cables.0.capacity_gbps: Input should be a fin"),
        (["nodes", 0, "nics", 0, "ports", 0, "capacity_gbps"], math.nan, "ports.0.capacity_gbps"),
    ],
)
def test_infinite_or_absurd_capacities_are_refused(path, value, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TopologyError) as err:
        topology_from_dict(_mutate(path, value))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_infinite_capacities_in_json_and_fat_tree_are_refused(tmp_path: Path) -> None:
    j = tmp_path / "fabric.json"
    doc = _mutate(["cables", 0, "capacity_gbps"], 1)
    j.write_text(json.dumps(doc).replace('"capacity_gbps": 1', '"capacity_gbps": 1e309'))
    with pytest.raises(TopologyError, match=r"cables\.0\.capacity_gbps: Input should be a finite"):
        load_topology(j)
    with pytest.raises(TopologyError, match=r"fat_tree\.port_speed_gbps"):
        topology_from_dict({"fat_tree": {"nodes": 2, "port_speed_gbps": math.inf}})


def test_label_fabric_refuses_infinite_speeds_and_absurd_spines() -> None:
    from controller.errors import BadConfig
    from controller.services.traffic.labels import label_fabric

    p = "topology.trainguard.io/"
    labels = {"n1": {f"{p}nic0": "tor-a", f"{p}port-speed-gbps": "inf"}}
    with pytest.raises(TopologyError, match="port-speed-gbps must be in"):
        topology_from_labels(labels, LabelFabric(spines=2))
    with pytest.raises(TopologyError, match="label fabric"):
        topology_from_labels(labels, LabelFabric(spines=10**12))
    for raw in (
        {"port_speed_gbps": math.inf},
        {"oversubscription": math.inf},
        {"spines": 10**12},
        {"spines": math.inf},
    ):
        with pytest.raises(BadConfig, match=r"^topology_labels: "):
            label_fabric(raw)


def test_labels_give_bonded_two_tier_fabric() -> None:
    p = "topology.trainguard.io/"
    labels = {
        "n1": {f"{p}nic0": "tor-a,tor-b", f"{p}nic1": "tor-a,tor-b", "other": "x"},
        "n2": {f"{p}nic0": "tor-c,tor-d", f"{p}nic1": "tor-c,tor-d", f"{p}port-speed-gbps": "400"},
        "cpu-node": {"kubernetes.io/os": "linux"},
    }
    topo = topology_from_labels(labels, LabelFabric(spines=4, oversubscription=2.0))
    assert [n.name for n in topo.nodes] == ["n1", "n2"]
    assert topo.nic_leaves(1, 0) == ("tor-c", "tor-d")
    # tor-c has two 400G ports below; 2:1 over 4 spines -> 100G per uplink
    assert topo.base_capacity_bytes_per_s[topo.link_index["tor-c->spine-000"]] == 100 * GBPS
    with pytest.raises(TopologyError, match="unknown label"):
        topology_from_labels({"n": {f"{p}nicX": "a"}}, LabelFabric())
    with pytest.raises(TopologyError, match=re.escape("nic0..nic1")):
        topology_from_labels({"n": {f"{p}nic0": "a", f"{p}nic2": "a"}}, LabelFabric())
    with pytest.raises(TopologyError, match="no node carries"):
        topology_from_labels({"n": {}}, LabelFabric())
