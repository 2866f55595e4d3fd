"""Universal checkpoints in one process: save TP=2 x DP=2, load TP=1 x DP=3 and others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointCorruptError, Checkpointer, CheckpointStore
from checkpoint._reshard import consolidate, load_resharded
from checkpoint.errors import CheckpointLayoutError, CheckpointNotFoundError, ShardingRuleError
from checkpoint.manifest import rank_data_name, step_dir_name
from checkpoint.rules import ParallelLayout, RuleSpec
from checkpoint.sharding import ShardingSpec
from tests.checkpoint.megatron import (
    PADDED_PER_TP,
    full_state,
    layouts,
    ln_mean,
    rank_state,
    save_sharded,
)


def _load(root: Path, tp: int, dp: int, full: dict[str, torch.Tensor], pad: int) -> int:
    read = 0
    for layout in layouts(tp, dp):
        expected, spec = rank_state(full, layout, pad)
        targets = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
        result = load_resharded(root, targets, sharding=spec)
        read += result.bytes_read
        for name, value in targets.items():
            want = expected[name]
            if name == "model/ln.weight":
                want = ln_mean(full, 4)
            assert torch.equal(value, want), (layout, name)
    return read


@pytest.mark.parametrize(("tp", "dp", "pad"), [(1, 3, 12), (2, 1, 6), (1, 1, 10), (2, 3, 7)])
def test_reshard_tp2_dp2_into_other_layouts(tmp_path: Path, tp: int, dp: int, pad: int) -> None:
    full = full_state()
    save_sharded(tmp_path, 2, 2, full, PADDED_PER_TP)
    _load(tmp_path, tp, dp, full, pad)


def test_consolidated_form_is_the_global_state(tmp_path: Path) -> None:
    full = full_state()
    save_sharded(tmp_path, 2, 2, full, PADDED_PER_TP)
    with CheckpointStore(tmp_path).open_latest() as reader:
        got = dict(consolidate(reader))
    assert set(got) == set(full)
    for name, value in full.items():
        want = ln_mean(full, 4) if name == "model/ln.weight" else value
        assert torch.equal(got[name], want), name


def test_replicas_that_differ_are_reported(tmp_path: Path) -> None:
    full = full_state()
    save_sharded(tmp_path, 2, 2, full, PADDED_PER_TP)
    # Each rank holds a different ln.weight; a spec that claims it is replicated must be
    # caught by convert's replicate-check-equal, not silently resolved to one copy.
    root = tmp_path / "lying"
    engines = []
    for rank, layout in enumerate(layouts(2, 2)):
        state, spec = rank_state(full, layout, PADDED_PER_TP)
        rules = [{"pattern": "*ln.weight", "rule": "replicate"}, *spec.rules.rules]  # type: ignore[union-attr]
        lie = ShardingSpec(
            RuleSpec([*RuleSpec.parse([rules[0]]).rules, *rules[1:]]), layout=layout, zero=spec.zero
        )
        engine = Checkpointer(
            CheckpointConfig(root=root, writer="thread"), rank=rank, world_size=4, sharding=lie
        )
        engine.save(state, step=1)
        engines.append(engine)
    for engine in reversed(engines):
        engine.close()
    with (
        CheckpointStore(root).open_latest() as reader,
        pytest.raises(CheckpointLayoutError, match=r"'model/ln.weight': replicated copies differ"),
    ):
        dict(consolidate(reader))


def test_unmatched_parameter_is_an_error_naming_it(tmp_path: Path) -> None:
    spec = ShardingSpec(
        [{"pattern": "*.weight", "rule": "shard", "dim": 0}], layout=ParallelLayout(tp=2, tp_rank=0)
    )
    engine = Checkpointer(
        CheckpointConfig(root=tmp_path, writer="thread"), rank=0, world_size=2, sharding=spec
    )
    with pytest.raises(ShardingRuleError, match=r"'model/fc.bias' matches no rule"):
        engine.save({"model": {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2)}}, 1)
    engine.close()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([{"pattern": "x", "rule": "concat"}], "rule must be one of"),
        ([{"pattern": "x", "rule": "fused"}], "fused needs 'parts'"),
        ([{"pattern": "x", "rule": "vocab"}], "vocab needs 'size'"),
        ([{"pattern": "x", "rule": "shard", "dim": -1}], "'dim' must be"),
        ([{"pattern": "x", "rule": "shard", "axis": 1}], r"unknown field\(s\) \['axis'\]"),
        ([], "non-empty list"),
        ({"rules": [{"rule": "shard"}]}, "'pattern' must be"),
    ],
)
def test_rule_spec_validation(raw: object, message: str) -> None:
    with pytest.raises(ShardingRuleError, match=message):
        RuleSpec.parse(raw)


def test_validate_names_every_unmatched_tensor() -> None:
    spec = RuleSpec.parse({"rules": [{"pattern": "model/*", "rule": "replicate"}]})
    with pytest.raises(ShardingRuleError, match=r"2 tensor.*optim/a, optim/b"):
        spec.validate(["model/x", "optim/b", "optim/a"])


def test_layout_mismatch_and_missing_tensor_are_named(tmp_path: Path) -> None:
    full = full_state()
    save_sharded(tmp_path, 2, 2, full, PADDED_PER_TP)
    with pytest.raises(CheckpointLayoutError, match=r"'model/out.weight': global shape \[4, 6\]"):
        load_resharded(tmp_path, {"model/out.weight": torch.zeros(4, 7)})
    with pytest.raises(CheckpointLayoutError, match=r"'model/nope': not in checkpoint"):
        load_resharded(tmp_path, {"model/nope": torch.zeros(1)})


def test_corrupt_fragment_names_file_and_tensor(tmp_path: Path) -> None:
    full = full_state()
    save_sharded(tmp_path, 2, 2, full, PADDED_PER_TP)
    reader = CheckpointStore(tmp_path).open(10)
    entry = next(e for e in reader.entries(1) if e.name == "model/out.weight")
    reader.close()
    path = tmp_path / step_dir_name(10) / rank_data_name(1)
    raw = bytearray(path.read_bytes())
    raw[entry.offset] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"rank-00001\.bin: CRC mismatch.*tensor"):
        load_resharded(tmp_path, {"model/out.weight": torch.zeros(4, 6)}, step=10)
    # Asked for "the newest", with nothing older to fall back on: the damage is still named.
    with pytest.raises(CheckpointNotFoundError, match=r"rank-00001\.bin: CRC mismatch.*tensor"):
        load_resharded(tmp_path, {"model/out.weight": torch.zeros(4, 6)})


def _corrupt(root: Path, step: int, rank: int, name: str) -> None:
    reader = CheckpointStore(root).open(step)
    entry = next(e for e in reader.entries(rank) if e.name == name)
    reader.close()
    path = root / step_dir_name(step) / rank_data_name(rank)
    raw = bytearray(path.read_bytes())
    raw[entry.offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_resharded_load_falls_back_past_a_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    older = full_state()
    save_sharded(tmp_path, 2, 2, older, PADDED_PER_TP, step=10)
    newer = {k: v + 1 for k, v in older.items()}
    save_sharded(tmp_path, 2, 2, newer, PADDED_PER_TP, step=20)
    _corrupt(tmp_path, 20, 1, "model/out.weight")

    for layout in layouts(1, 3):
        expected, spec = rank_state(older, layout, 12)
        targets = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
        result = load_resharded(tmp_path, targets, sharding=spec)
        assert result.step == 10
        assert len(result.skipped) == 1 and "CRC mismatch" in result.skipped[0]
        for name, value in targets.items():
            want = ln_mean(older, 4) if name == "model/ln.weight" else expected[name]
            assert torch.equal(value, want), (layout, name)


def test_partial_reads_touch_less_than_the_whole_checkpoint(tmp_path: Path) -> None:
    """Row shards of a big tensor: each of 4 target ranks reads about a quarter."""
    big = torch.randn(4096, 256)  # 4 MiB, several CRC chunks once chunk_bytes is small
    engine = Checkpointer(CheckpointConfig(root=tmp_path, writer="thread", chunk_bytes=64 << 10))
    engine.save({"w": big}, step=1)
    engine.close()

    def spec(tp: int, r: int) -> ShardingSpec:
        return ShardingSpec(
            [{"pattern": "*", "rule": "shard"}], layout=ParallelLayout(tp=tp, tp_rank=r)
        )

    total = 0
    for r in range(4):
        target = torch.empty(1024, 256)
        result = load_resharded(tmp_path, {"w": target}, sharding=spec(4, r))
        assert torch.equal(target, big[r * 1024 : (r + 1) * 1024])
        assert result.bytes_read <= big.numel() * 4 // 4 + 2 * (64 << 10)
        total += result.bytes_read
    assert total < big.numel() * 4 * 1.2


def test_manifest_records_global_mapping(tmp_path: Path) -> None:
    save_sharded(tmp_path, 2, 2, full_state(), PADDED_PER_TP)
    raw = json.loads((tmp_path / step_dir_name(10) / "rank-00001.json").read_text())
    qkv = next(e for e in raw["entries"] if e["name"] == "model/qkv.weight")["global_map"]
    assert qkv["shape"] == [12, 4]
    assert [p["offsets"] for p in qkv["pieces"]] == [[2, 0], [6, 0], [10, 0]]
    assert raw["layout"] == {"tp": 2, "dp": 2}


def test_integer_and_bool_copies_under_average_are_their_rounded_mean(tmp_path: Path) -> None:
    """An ``average`` glob that catches an integer (BatchNorm's ``num_batches_tracked``) or
    a bool tensor: its mean is taken in float64 and rounded to nearest, ties to even (a
    bool: the majority). It used to raise torch's bare RuntimeError ("result type Float
    can't be cast to the desired output type Long") out of reshard and convert."""
    rules = [{"pattern": "count", "rule": "average"}, {"pattern": "flag", "rule": "average"}]
    copies = [
        {"count": torch.tensor([1, 10, 7]), "flag": torch.tensor([True, False, True])},
        {"count": torch.tensor([2, 11, 7]), "flag": torch.tensor([True, True, False])},
    ]
    engines = []
    for rank, state in enumerate(copies):
        layout = ParallelLayout(tp=1, tp_rank=0, dp=2, dp_rank=rank)
        engine = Checkpointer(
            CheckpointConfig(root=tmp_path, writer="thread"),
            rank=rank,
            world_size=2,
            layout={"tp": 1, "dp": 2},
            sharding=ShardingSpec(rules, layout=layout),
        )
        engine.save(state, step=1)
        engines.append(engine)
    for engine in reversed(engines):
        engine.close()
    want = {"count": torch.tensor([2, 10, 7]), "flag": torch.tensor([True, False, False])}
    one = ParallelLayout(tp=1, tp_rank=0, dp=1, dp_rank=0)
    targets = {"count": torch.zeros(3, dtype=torch.int64), "flag": torch.zeros(3, dtype=torch.bool)}
    load_resharded(tmp_path, targets, sharding=ShardingSpec(rules, layout=one))
    assert {k: v.tolist() for k, v in targets.items()} == {k: v.tolist() for k, v in want.items()}
    with CheckpointStore(tmp_path).open_latest() as reader:
        got = dict(consolidate(reader))
    assert {k: got[k].tolist() for k in want} == {k: v.tolist() for k, v in want.items()}
