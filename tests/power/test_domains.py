"""Domain trees: strict validation with one-line errors naming the path, and aggregation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from power.domains import MAX_DOMAINS, DomainKind, Reading, load_domains, parse_domains
from power.errors import ConfigError

GOOD = """
name: dc1
kind: datacenter
budget_w: 100000
policy: {t2_frac: 0.93}
children:
  - name: row-a
    kind: row
    budget_w: 20000
    children:
      - name: rack-1
        kind: rack
        budget_w: 12000
        policy: {min_hold_s: 5}
        children:
          - {name: node-1, kind: server, budget_w: 6500,
             children: [{name: node-1-gpu0, kind: gpu, budget_w: 400, gpu_index: 0}]}
          - {name: node-2, kind: server, budget_w: 6500}
"""


def test_load_yaml_inherits_policy_overrides(tmp_path: Path) -> None:
    p = tmp_path / "domains.yaml"
    p.write_text(GOOD)
    tree = load_domains(p)
    assert tree.root.kind is DomainKind.DATACENTER
    assert [s.name for s in tree.servers()] == ["node-1", "node-2"]
    assert tree["node-1"].policy.t2_frac == 0.93  # inherited from dc1
    assert tree["node-1"].policy.min_hold_s == 5  # from rack-1
    assert tree["row-a"].policy.min_hold_s == 60  # default untouched above rack-1
    assert tree.gpu_domain("node-1", 0) is tree["node-1-gpu0"]
    assert [d.name for d in tree["node-1-gpu0"].ancestors()] == [
        "node-1-gpu0",
        "node-1",
        "rack-1",
        "row-a",
        "dc1",
    ]


def test_load_json(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"name": "r", "kind": "row", "budget_w": 10}))
    assert load_domains(p).root.budget_w == 10.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "domains: must be a mapping"),
        ({"name": "r", "kind": "row"}, "domains.budget_w: required"),
        ({"name": "r", "kind": "row", "budget_w": -5}, "domains.budget_w: must be a positive"),
        ({"name": "r", "kind": "row", "budget_w": True}, "domains.budget_w: must be a positive"),
        ({"name": "R_1", "kind": "row", "budget_w": 1}, "domains.name: must be a lowercase"),
        ({"name": "r", "kind": "pod", "budget_w": 1}, "domains.kind: must be one of"),
        ({"name": "r", "kind": "row", "budget_w": 1, "colour": 1}, "domains.colour: unknown key"),
        (
            {
                "name": "r",
                "kind": "row",
                "budget_w": 1,
                "children": [{"name": "x", "kind": "datacenter", "budget_w": 1}],
            },
            "domains.children[0].kind: a datacenter cannot sit under a row",
        ),
        (
            {
                "name": "r",
                "kind": "row",
                "budget_w": 1,
                "children": [{"name": "r", "kind": "rack", "budget_w": 1}],
            },
            "domains.children[0].name: duplicate domain name 'r' (also at domains)",
        ),
        (
            {"name": "r", "kind": "row", "budget_w": 1, "policy": {"t9": 1}},
            "domains.policy.t9: unknown policy field",
        ),
        (
            {"name": "r", "kind": "row", "budget_w": 1, "policy": {"t1_frac": 0.95}},
            "domains.policy: thresholds must satisfy",
        ),
        (
            {"name": "r", "kind": "row", "budget_w": 1, "policy": {"knob": "volts"}},
            "domains.policy.knob: must be one of",
        ),
        (
            {
                "name": "r",
                "kind": "row",
                "budget_w": 1,
                "policy": {"clock_overrides_mhz": {"a100": {"lp_t1": "fast"}}},
            },
            "clock_overrides_mhz.a100.lp_t1: must be a positive integer",
        ),
        (
            {
                "name": "r",
                "kind": "row",
                "budget_w": 1,
                "children": [{"name": "g", "kind": "gpu", "budget_w": 1, "gpu_index": 0}],
            },
            "domains.children[0].kind: a gpu domain must sit directly under a server",
        ),
        (
            {
                "name": "s",
                "kind": "server",
                "budget_w": 1,
                "children": [{"name": "g", "kind": "gpu", "budget_w": 1}],
            },
            "domains.children[0].gpu_index: a gpu domain needs",
        ),
    ],
)
def test_validation_errors_are_one_line_and_name_the_path(raw: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_domains(raw)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_bad_files_give_one_line_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read"):
        load_domains(missing)
    broken = tmp_path / "b.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as info:
        load_domains(broken)
    assert str(info.value) == (
        f"{broken}: not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1"
    )
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError) as info:
        load_domains(binary)
    assert str(info.value) == f"{binary}: cannot read: not UTF-8 text"


def test_aggregation_sums_children_and_prefers_a_fresh_meter(tmp_path: Path) -> None:
    p = tmp_path / "domains.yaml"
    p.write_text(GOOD)
    tree = load_domains(p)
    r = {
        "node-1": Reading(3000.0, 100.0),
        "node-2": Reading(2000.0, 99.0),
        "node-1-gpu0": Reading(300.0, 100.0),
    }
    agg = tree.aggregate(r, now_s=100.0, stale_after_s=10.0)
    assert agg["rack-1"].power_w == 5000.0 and agg["rack-1"].complete
    assert agg["dc1"].power_w == 5000.0 and agg["dc1"].complete
    r["row-a"] = Reading(5600.0, 100.0)  # the PDU sees switches and fans too
    agg = tree.aggregate(r, now_s=100.0, stale_after_s=10.0)
    assert agg["row-a"].power_w == 5600.0 and agg["dc1"].power_w == 5600.0
    # node-2 goes stale: its rack sums only fresh parts and says it is a lower bound.
    del r["row-a"]
    agg = tree.aggregate(r, now_s=109.5, stale_after_s=10.0)
    assert agg["rack-1"].power_w == 3000.0 and not agg["rack-1"].complete
    assert not agg["dc1"].complete


def _wide(servers: int) -> dict[str, object]:
    return {
        "name": "row-a",
        "kind": "row",
        "budget_w": 1000,
        "children": [{"name": f"n{i}", "kind": "server", "budget_w": 10} for i in range(servers)],
    }


def test_tree_larger_than_the_domain_limit_is_refused_with_one_line() -> None:
    assert len(parse_domains(_wide(MAX_DOMAINS - 1)).by_name) == MAX_DOMAINS
    with pytest.raises(ConfigError) as err:
        parse_domains(_wide(20_000))
    assert str(err.value) == (
        f"domains.children[{MAX_DOMAINS - 1}]: the tree has more than {MAX_DOMAINS} domains "
        "(the limit)"
    )
