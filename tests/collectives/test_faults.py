"""Fault specs: strict parsing with one-line errors, and deterministic injection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from collectives.errors import FaultSpecError
from collectives.faults import Fault, FaultInjector, injector_from_env, load_faults, parse_faults

FULL_SPEC = [
    {
        "kind": "delay",
        "rank": 1,
        "from_step": 5,
        "to_step": 9,
        "delay_s": 0.05,
        "jitter_s": 0.02,
        "seed": 7,
    },
    {"kind": "slowdown", "rank": [2, 3], "factor": 1.5},
    {
        "kind": "hang",
        "rank": 3,
        "at_step": 7,
        "op": "all_reduce",
        "call": 2,
        "where": "inside",
        "duration_s": 1.5,
    },
    {"kind": "crash", "rank": 1, "at_step": 9, "exit_code": 3},
    {"kind": "crash", "rank": 0, "at_step": 9, "signal": "kill"},
    {"kind": "slow_link", "ranks": [0, 1], "delay_s": 0.02},
    {"kind": "nan", "rank": 0, "at_step": 4},
]


def test_a_full_spec_parses_into_faults() -> None:
    faults = parse_faults({"faults": FULL_SPEC})
    delay, slow, hang, crash, kill, link, nan = faults
    assert (delay.ranks, delay.from_step, delay.to_step, delay.seed) == (frozenset({1}), 5, 9, 7)
    assert slow.ranks == frozenset({2, 3}) and slow.factor == 1.5 and slow.to_step is None
    assert (hang.op, hang.call, hang.where, hang.duration_s) == ("all_reduce", 2, "inside", 1.5)
    assert (hang.from_step, hang.to_step) == (7, 7)
    assert crash.exit_code == 3 and crash.signal is None
    assert kill.signal == 9 and kill.exit_code is None
    assert link.ranks == frozenset({0, 1}) and link.delay_s == 0.02
    assert nan.op == "all_reduce" and nan.call == 1


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"faults": [], "extra": 1}, "only 'faults'"),
        ("nope", "expected a list"),
        ([3], "expected an object"),
        ([{"kind": "explode", "rank": 0}], "'kind' must be one of"),
        ([{"kind": "delay", "rank": 0, "delay_s": 1, "stepp": 3}], "unknown field 'stepp'"),
        ([{"kind": "delay", "delay_s": 1}], "'rank' is required"),
        ([{"kind": "delay", "rank": [], "delay_s": 1}], "'rank' must not be empty"),
        ([{"kind": "delay", "rank": -1, "delay_s": 1}], "'rank' must be an integer >= 0"),
        ([{"kind": "delay", "rank": True, "delay_s": 1}], "'rank' must be an integer"),
        ([{"kind": "delay", "rank": 0}], "'delay_s' is required"),
        ([{"kind": "delay", "rank": 0, "delay_s": -1}], "'delay_s' must be a number >= 0"),
        ([{"kind": "delay", "rank": 0, "delay_s": 1, "at_step": 2, "from_step": 1}], "not both"),
        ([{"kind": "delay", "rank": 0, "delay_s": 1, "from_step": 5, "to_step": 2}], "'to_step'"),
        ([{"kind": "slowdown", "rank": 0}], "'factor' is required"),
        ([{"kind": "slowdown", "rank": 0, "factor": 0.5}], "'factor' must be a number >= 1"),
        ([{"kind": "hang", "rank": 0, "op": "allreduce"}], "unknown op 'allreduce'"),
        ([{"kind": "hang", "rank": 0, "where": "after"}], "'where' must be"),
        ([{"kind": "hang", "rank": 0, "call": 0}], "'call' must be an integer >= 1"),
        ([{"kind": "crash", "rank": 0}], "exactly one of 'exit_code' or 'signal'"),
        ([{"kind": "crash", "rank": 0, "exit_code": 1, "signal": "KILL"}], "exactly one"),
        ([{"kind": "crash", "rank": 0, "exit_code": 300}], "0..255"),
        ([{"kind": "crash", "rank": 0, "signal": "SIGNOPE"}], "unknown signal"),
        ([{"kind": "slow_link", "ranks": [1, 1], "delay_s": 1}], "two different ranks"),
        ([{"kind": "slow_link", "rank": 1, "ranks": [0, 1], "delay_s": 1}], "unknown field 'rank'"),
    ],
)
def test_bad_specs_fail_with_one_line_naming_the_fault(spec: Any, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_faults(spec, "TRAINGUARD_FAULTS")
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message and message.startswith("TRAINGUARD_FAULTS")


def test_env_value_is_json_text_or_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(FULL_SPEC[:2]))
    assert load_faults(str(path)) == load_faults(json.dumps(FULL_SPEC[:2]))
    assert len(load_faults(f"  {path}  ")) == 2
    with pytest.raises(FaultSpecError, match="cannot read fault file"):
        load_faults(str(tmp_path / "missing.json"))
    with pytest.raises(FaultSpecError, match="invalid JSON"):
        load_faults("[{")
    bad = tmp_path / "bad.json"
    bad.write_text('[{"kind": "nan"}]')
    with pytest.raises(FaultSpecError, match=r"bad\.json.*fault #1 \(nan\): 'rank' is required"):
        load_faults(str(bad))


def test_a_fault_can_be_armed_in_one_generation_only() -> None:
    """A restarted job (new ``TRAINGUARD_GENERATION``) must not meet the fault again."""
    spec = json.dumps(
        [
            {"kind": "nan", "rank": 0, "at_step": 4, "generation": 0},
            {"kind": "delay", "rank": 0, "delay_s": 0.1, "generation": 1},
            {"kind": "slowdown", "rank": 0, "factor": 2.0},
        ]
    )

    def kinds(env: dict[str, str]) -> list[str]:
        injector = injector_from_env(0, env)
        return sorted(f.kind for f in injector._faults) if injector is not None else []

    assert kinds({"TRAINGUARD_FAULTS": spec}) == ["nan", "slowdown"]  # unset: generation 0
    assert kinds({"TRAINGUARD_FAULTS": spec, "TRAINGUARD_GENERATION": "0"}) == ["nan", "slowdown"]
    assert kinds({"TRAINGUARD_FAULTS": spec, "TRAINGUARD_GENERATION": "1"}) == ["delay", "slowdown"]
    assert kinds({"TRAINGUARD_FAULTS": spec, "TRAINGUARD_GENERATION": "2"}) == ["slowdown"]
    with pytest.raises(FaultSpecError, match="'generation' must be an integer >= 0"):
        parse_faults([{"kind": "nan", "rank": 0, "generation": -1}])


def test_random_delays_replay_exactly() -> None:
    (fault,) = parse_faults(
        [{"kind": "delay", "rank": 1, "delay_s": 0.1, "jitter_s": 0.05, "seed": 3}]
    )
    draws = [fault.step_delay_s(1, s) for s in range(50)]
    assert draws == [fault.step_delay_s(1, s) for s in range(50)]
    assert all(0.1 <= d <= 0.15 for d in draws)
    assert len(set(draws)) == 50  # a fresh draw per step
    other_seed = Fault(**{**{f: getattr(fault, f) for f in fault.__slots__}, "seed": 4})
    assert other_seed.step_delay_s(1, 0) != draws[0]


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def _injector(rank: int, spec: list[dict[str, Any]]) -> tuple[FaultInjector, Sleeps]:
    inj = FaultInjector(rank, parse_faults(spec))
    sleeps = Sleeps()
    inj.sleep = sleeps
    return inj, sleeps


def test_faults_act_only_on_their_rank_and_steps() -> None:
    spec = [
        {"kind": "delay", "rank": 1, "from_step": 2, "to_step": 3, "delay_s": 0.5},
        {"kind": "slowdown", "rank": 1, "at_step": 5, "factor": 3},
    ]
    inj, sleeps = _injector(1, spec)
    for step in range(6):
        inj.on_step_start(step)
        inj.stretch_compute(step, 0.1)
    assert sleeps.calls == [0.5, 0.5, pytest.approx(0.2)]
    other, other_sleeps = _injector(0, spec)
    for step in range(6):
        other.on_step_start(step)
        other.stretch_compute(step, 0.1)
    assert other_sleeps.calls == []


def test_call_counting_nan_and_hang_inside() -> None:
    spec = [
        {"kind": "nan", "rank": 0, "at_step": 1, "op": "all_reduce", "call": 2},
        {
            "kind": "hang",
            "rank": 0,
            "at_step": 2,
            "op": "broadcast",
            "where": "inside",
            "duration_s": 0.25,
        },
    ]
    inj, sleeps = _injector(0, spec)
    tensors = [torch.ones(3) for _ in range(3)]
    assert [inj.before_call(1, "all_reduce", t) for t in tensors] == [None, None, None]
    assert [bool(t.isnan().all()) for t in tensors] == [False, True, False]
    assert inj.before_call(2, "all_reduce", torch.ones(1)) is None
    hang = inj.before_call(2, "broadcast", torch.ones(1))
    assert hang is not None and hang.where == "inside"
    inj.block(hang)
    assert sleeps.calls == [0.25]
    ints = torch.ones(2, dtype=torch.int64)
    inj2, _ = _injector(0, [{"kind": "nan", "rank": 0, "at_step": 0}])
    inj2.before_call(0, "all_reduce", ints)  # integer tensors cannot hold NaN: left alone
    assert ints.tolist() == [1, 1]


def test_slow_link_applies_to_groups_and_pairs_holding_both_ranks() -> None:
    spec = [{"kind": "slow_link", "ranks": [0, 1], "from_step": 3, "delay_s": 0.05}]
    inj, _ = _injector(1, spec)
    assert inj.link_delay_s(3, frozenset({0, 1, 2})) == 0.05
    assert inj.link_delay_s(3, (0, 1)) == 0.05
    assert inj.link_delay_s(3, frozenset({1, 2})) == 0.0
    assert inj.link_delay_s(2, frozenset({0, 1})) == 0.0
    assert inj.link_delay_s(None, frozenset({0, 1})) == 0.0
    bystander, _ = _injector(2, spec)
    assert bystander.link_delay_s(3, frozenset({0, 1, 2})) == 0.0


def test_faults_can_be_added_at_run_time() -> None:
    inj, sleeps = _injector(0, [])
    inj.on_step_start(0)
    inj.add([{"kind": "delay", "rank": 0, "delay_s": 0.01}])
    inj.on_step_start(1)
    assert sleeps.calls == [0.01]
    with pytest.raises(FaultSpecError):
        inj.add([{"kind": "delay", "rank": 0}])
    inj.clear()
    inj.on_step_start(2)
    assert sleeps.calls == [0.01]
