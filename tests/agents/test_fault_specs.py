from __future__ import annotations

import math

import pytest

from agents.errors import AgentConfigError
from agents.gpu.faults import parse_fault_spec, parse_fault_specs


def test_examples_from_the_docs_parse() -> None:
    xid = parse_fault_spec("kind=xid,code=79,gpu=3,at=20")
    assert (xid.kind, xid.xid_code, xid.gpu, xid.at_s) == ("xid", 79, 3, 20.0)
    ecc = parse_fault_spec("kind=ecc,gpu=1,at=10,uncorrected=1")
    assert (ecc.ecc_corrected, ecc.ecc_uncorrected) == (0, 1)
    thermal = parse_fault_spec(" kind=thermal , gpu=2, at=5 ")
    assert thermal.duration_s == math.inf
    assert parse_fault_spec("kind=lost,gpu=0,at=30").kind == "lost"
    assert parse_fault_spec("kind=ecc,gpu=0").ecc_corrected == 1  # bare ecc = one corrected
    slow = parse_fault_spec("kind=slowdown,gpu=1,mhz=700,hw=1")
    assert (slow.value("mhz"), slow.value("hw"), slow.value("brake")) == (700, 1, 0)
    specs = (
        "kind=xid,gpu=3,at=20,code=79",
        "kind=thermal,gpu=1,at=2.5,duration=3",
        "kind=slowdown,gpu=0,at=1,mhz=900,brake=1",
    )
    for spec in specs:
        parsed = parse_fault_spec(spec)
        assert parse_fault_spec(parsed.to_spec()) == parsed


def test_semicolon_joined_and_lists_are_accepted() -> None:
    faults = parse_fault_specs(["kind=xid,code=48,gpu=0;kind=lost,gpu=1,at=3", "kind=ecc,gpu=2"])
    assert [f.kind for f in faults] == ["xid", "lost", "ecc"]


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("", "empty"),
        ("kind=xid,gpu=3,at=20", "code="),
        ("kind=xid,code=79,gpu=3,at=20,colour=red", "'colour'"),
        ("kind=ecc,gpu=1,code=3", "'code'"),
        ("kind=meteor,gpu=1", "'meteor'"),
        ("gpu=1,at=2", "missing kind"),
        ("kind=lost,at=2", "missing gpu"),
        ("kind=lost,gpu=one", "gpu='one'"),
        ("kind=lost,gpu=-1", "gpu=-1"),
        ("kind=lost,gpu=1,at=soon", "at='soon'"),
        ("kind=lost,gpu=1,at=-5", "at=-5"),
        ("kind=lost,gpu=1,at=nan", "at=nan"),
        ("kind=lost,gpu", "'gpu' is not key=value"),
        ("kind=lost,gpu=1,gpu=2", "given twice"),
        ("kind=xid,code=0,gpu=1", "code=0"),
    ],
)
def test_bad_specs_fail_in_one_line_naming_the_part(spec: str, names: str) -> None:
    with pytest.raises(AgentConfigError) as exc:
        parse_fault_spec(spec)
    message = str(exc.value)
    assert names in message and "\n" not in message
    assert exc.value.exit_code == 2


def test_fault_on_a_missing_gpu_is_refused() -> None:
    with pytest.raises(AgentConfigError, match="gpu=8 but only 8 simulated GPUs"):
        parse_fault_specs("kind=lost,gpu=8", gpu_count=8)
