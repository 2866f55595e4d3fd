"""The declared limits hold at the wire: what a database column cannot store is refused with
the field's path, and the edges themselves are accepted."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from trainguard import limits, wire


def _report(**gpu: Any) -> dict[str, Any]:
    return {
        "node": {"name": "node-a", "labels": {"zone": "a"}},
        "agent_instance": "i-1",
        "seq": 0,
        "sent_unix_s": 1.0,
        "samples": [{"time_unix_s": 1.0, "gpus": [{"index": 0, **gpu}]}],
    }


def _error(body: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as info:
        wire.Report.model_validate_json(json.dumps(body))
    first = info.value.errors()[0]
    return tuple(first["loc"]), first["type"]


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("ecc_corrected_total", limits.INT64_MAX + 1, "less_than_equal"),
        ("ecc_corrected_total", -1, "greater_than_equal"),
        ("sm_clock_mhz", limits.INT32_MAX + 1, "less_than_equal"),
        ("power_w", float("inf"), "finite_number"),
        ("temperature_c", float("nan"), "finite_number"),
        ("uuid", "GPU-\x00", "string_pattern_mismatch"),
        ("uuid", "x" * (limits.LABEL_LEN + 1), "string_too_long"),
        # Finite, but two of them sum to inf in the power policy's domain totals (and an
        # incident's evidence that PostgreSQL's JSON refuses): no GPU draws 1.7e308 W.
        ("power_w", 1.7e308, "less_than_equal"),
        ("power_limit_w", limits.GPU_WATTS_MAX * 1.01, "less_than_equal"),
    ],
)
def test_unstorable_values_are_refused_with_their_path(field: str, value: Any, kind: str) -> None:
    loc, error = _error(_report(**{field: value}))
    assert loc == ("samples", 0, "gpus", 0, field)
    assert error == kind


def test_edges_are_accepted() -> None:
    report = wire.Report.model_validate_json(
        json.dumps(
            _report(
                ecc_corrected_total=limits.INT64_MAX,
                sm_clock_mhz=limits.INT32_MAX,
                uuid="x" * limits.LABEL_LEN,
                temperature_c=-1.7976931348623157e308,
                error="\u00e9\U0001f600",  # a surrogate pair in JSON is one valid character
            )
        )
    )
    gpu = report.samples[0].gpus[0]
    assert gpu.ecc_corrected_total == limits.INT64_MAX
    assert gpu.error == "\u00e9\U0001f600"


def test_index_and_label_limits() -> None:
    assert _error(_report(index=limits.INDEX_MAX + 1))[0] == ("samples", 0, "gpus", 0, "index")
    body = _report()
    body["node"]["labels"] = {"k": "v\x00"}
    assert _error(body)[0] == ("node", "labels", "k")


def test_lone_surrogate_fails_in_python_mode_with_its_path() -> None:
    with pytest.raises(ValidationError) as info:
        wire.Report.model_validate(_report(error="bad \ud800"))
    first = info.value.errors()[0]
    assert first["loc"] == ("samples", 0, "gpus", 0, "error")
    assert first["type"] == "string_unicode"


def test_commands_carry_the_limits() -> None:
    with pytest.raises(ValidationError):
        wire.SetPowerLimit(id="c1", gpu_index=0, limit_w=float("inf"))
    with pytest.raises(ValidationError):
        wire.LockClocks(id="c\x00", gpu_index=0, min_mhz=0, max_mhz=1)
    with pytest.raises(ValidationError):
        wire.LockClocks(id="c1", gpu_index=0, min_mhz=0, max_mhz=limits.INT32_MAX + 1)


def test_a_servers_power_past_any_server_is_refused() -> None:
    body = _report(power_w=limits.GPU_WATTS_MAX)  # the edge is a reading
    body["samples"][0]["node_power_w"] = 1.7e308
    assert _error(body) == (("samples", 0, "node_power_w"), "less_than_equal")
    body["samples"][0]["node_power_w"] = limits.NODE_WATTS_MAX
    wire.Report.model_validate_json(json.dumps(body))
