"""The domain tree's rows: what goes into ``power_domains`` comes back as the same tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.db.models import PowerDomain
from controller.services.power.persist import from_rows, read_domains_file, to_rows, validate
from power import ConfigError, Priority
from trainguard.textfile import read_text

TREE: dict[str, Any] = {
    "name": "dc1",
    "kind": "datacenter",
    "budget_w": 100_000,
    "policy": {"t2_frac": 0.93, "min_hold_s": 30},
    "children": [
        {
            "name": "row-b",
            "kind": "row",
            "budget_w": 9000,
            "children": [
                {
                    "name": "node-2",
                    "kind": "server",
                    "budget_w": 4200,
                    "children": [
                        {"name": "node-2-gpu1", "kind": "gpu", "budget_w": 400, "gpu_index": 1},
                        {"name": "node-2-gpu0", "kind": "gpu", "budget_w": 400, "gpu_index": 0},
                    ],
                },
                {"name": "node-1", "kind": "server", "budget_w": 4200},
            ],
        },
        {"name": "row-a", "kind": "row", "budget_w": 8000, "policy": {"knob": "power_limit"}},
    ],
}


def test_rows_round_trip_keeps_order_policy_and_priorities() -> None:
    rows = to_rows(TREE, {"node-1": Priority.LOW}, {"train-a": Priority.HIGH})
    assert [r["name"] for r in rows][:3] == ["dc1", "row-b", "node-2"]  # parents first
    gpu = next(r for r in rows if r["name"] == "node-2-gpu1")
    assert gpu["node_name"] == "node-2" and gpu["gpu_index"] == 1
    assert rows[0]["labels"]["job_priorities"] == {"train-a": "high"}  # on the root's row
    raw, priorities, jobs = from_rows([PowerDomain(**r) for r in reversed(rows)])
    assert raw == TREE
    assert priorities == {"node-1": Priority.LOW}
    assert jobs == {"train-a": Priority.HIGH}
    tree, _ = validate(raw)
    assert tree["row-a"].policy.knob.value == "power_limit"
    assert tree["node-2"].policy.t2_frac == 0.93


def test_empty_table_is_no_tree() -> None:
    assert from_rows([]) == (None, {}, {})


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "domains: must be a mapping"),
        ({"name": "r", "kind": "row"}, "domains.budget_w: required"),
        (
            {**TREE, "children": [{"name": "x", "kind": "row", "budget_w": 1, "colour": 1}]},
            "domains.children[0].colour: unknown key",
        ),
    ],
)
def test_validate_names_the_path(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(doc)


def test_domains_file_is_read_once_so_tree_and_stored_document_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file rewritten right after it was read: the validated tree and the raw document
    that gets stored both come from that one read, never one from each version."""
    path = tmp_path / "domains.json"
    path.write_text(json.dumps(TREE))
    reads: list[Path] = []

    def read_then_rewrite(p: str | Path) -> str:
        text = read_text(p)
        reads.append(Path(p))
        path.write_text(json.dumps({**TREE, "budget_w": 1}))  # an operator's next edit
        return text

    monkeypatch.setattr("power.domains.read_text", read_then_rewrite)
    tree, raw = read_domains_file(path)
    assert reads == [path]
    assert tree.root.budget_w == raw["budget_w"] == 100_000


def test_unreadable_domains_file_is_one_config_error(tmp_path: Path) -> None:
    path = tmp_path / "domains.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"domains.yaml: cannot read: not UTF-8 text$"):
        read_domains_file(path)
