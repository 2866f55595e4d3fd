"""The wire contract: compatibility rules that let agents and controllers upgrade apart."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from trainguard import wire


def _report(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "node": {"name": "gpu-node-1", "gpus": [{"index": 0, "uuid": "GPU-0"}]},
        "agent_instance": "a1",
        "seq": 7,
        "sent_unix_s": 1.0,
        "samples": [{"time_unix_s": 1.0, "gpus": [{"index": 0, "power_w": 250.5}]}],
    }
    body.update(extra)
    return body


def test_unknown_fields_are_ignored_so_newer_agents_keep_working() -> None:
    body = _report(future_field={"x": 1})
    body["node"] = {**body["node"], "rack": "r7"}  # type: ignore[dict-item]
    report = wire.Report.model_validate(body)
    assert report.seq == 7
    assert "future_field" not in report.model_dump()


def test_defaults_fill_fields_an_older_agent_does_not_send() -> None:
    report = wire.Report.model_validate(_report())
    assert report.schema_version == wire.SCHEMA_VERSION
    assert report.job.is_empty()
    assert report.samples[0].gpus[0].xid_events == []


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"seq": -1}, "seq"),
        ({"node": {"name": "Bad_Name"}}, "name"),
        ({"samples": [{"time_unix_s": 1, "gpus": [{"index": 0, "power_w": -5}]}]}, "power_w"),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(patch: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        wire.Report.model_validate(_report(**patch))
    assert field in str(err.value)


def test_throttle_mask_decodes_to_nvml_bit_names() -> None:
    mask = 0x4 | 0x40
    assert wire.decode_throttle_reasons(mask) == [
        wire.ThrottleReason.SW_POWER_CAP,
        wire.ThrottleReason.HW_THERMAL_SLOWDOWN,
    ]
    assert wire.decode_throttle_reasons(0) == []


def test_commands_are_a_discriminated_union_by_kind() -> None:
    adapter: TypeAdapter[wire.Command] = TypeAdapter(wire.Command)
    cmd = adapter.validate_python(
        {"kind": "lock_clocks", "id": "c1", "gpu_index": 2, "min_mhz": 210, "max_mhz": 1275}
    )
    assert isinstance(cmd, wire.LockClocks)
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "format_disk", "id": "c2"})
    kinds = {m.model_fields["kind"].default for m in (wire.SetPowerLimit, wire.JobStop)}
    assert kinds <= wire.GPU_COMMAND_KINDS | wire.JOB_COMMAND_KINDS


def test_report_round_trips_through_json() -> None:
    report = wire.Report.model_validate(_report())
    assert wire.Report.model_validate_json(report.model_dump_json()) == report


def test_nan_and_vanished_rank_fields_default_for_older_senders() -> None:
    step = {"job": "j", "rank": 1, "world_size": 2, "step": 3, "step_time_s": 1.0}
    step |= {"compute_time_s": 0.9, "collective_wait_s": 0.1}
    old = wire.StepSummary.model_validate(step)
    assert (old.nonfinite_inputs, old.nonfinite_first_seq, old.nonfinite_first_op) == (0, None, "")
    ev = wire.RankEvent.model_validate({"job": "j", "rank": 1, "kind": "exited", "time_unix_s": 1})
    assert ev.disconnected is False and ev.exit_code is None
    assert wire.LocalRecords.model_validate({"type": "records"}).closing is False
    new = wire.StepSummary.model_validate(
        step | {"nonfinite_inputs": 2, "nonfinite_first_group": "w", "nonfinite_first_seq": 9}
    )
    assert new.nonfinite_inputs == 2 and new.nonfinite_first_seq == 9
    with pytest.raises(ValidationError, match="nonfinite_inputs"):
        wire.StepSummary.model_validate(step | {"nonfinite_inputs": -1})
