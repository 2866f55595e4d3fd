"""Typed health and degraded-GPU evidence (issue 13): what the detectors store fits its model,
and rows stored before the models existed (or damaged ones) still load."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from controller.db.session import make_engine
from controller.logic.detection.evidence_kinds import EVIDENCE_BY_KIND, parse_evidence
from controller.logic.detection.incident_evidence import (
    DegradedEvidence,
    GpuFaultEvidence,
    HwEvidence,
    NodeLostEvidence,
    XidEvidence,
)

#: Evidence exactly as the detectors wrote it before the models (dict literals), per kind.
OLD_ROWS: dict[str, dict[str, Any]] = {
    "gpu_fault": {
        "reasons": ["XID 79 on GPU 0: GPU has fallen off the bus"],
        "events": [{"time_unix_s": 1.5, "xid": 79}, {"time_unix_s": 2.0, "lost": True}],
        "resolution": "resolved by sre",
    },
    "gpu_watch_failed": {"gpu_error": "NVML_ERROR_DRIVER_NOT_LOADED"},
    "node_lost": {"last_report_unix_s": None},
    "application_xid": {"codes": {"45": 3, "13": 1}, "events": [{"time_unix_s": 1.0, "xid": 45}]},
    "hw_degraded": {"signal": "row_remap_pending", "device": None, "events": []},
    "nic_errors": {"signal": "nic_errors_rising", "device": "mlx5_0"},
    "gpu_degraded": {
        "ecc": {
            "rise": 120,
            "threshold": 100,
            "window_s": 600.0,
            "ecc_corrected_total": 4120,
            "since_unix_s": 10.0,
        },
        "causes": ["120 correctable ECC errors within 600 s"],
        "since_unix_s": 10.0,
        "events": [{"time_unix_s": 11.0, "cause": "ecc", "rise": 120, "ecc_corrected_total": 4120}],
    },
}


@pytest.mark.parametrize("kind", sorted(OLD_ROWS))
def test_rows_stored_before_the_models_load_unchanged(kind: str) -> None:
    parsed = parse_evidence(kind, OLD_ROWS[kind])
    assert isinstance(parsed, EVIDENCE_BY_KIND[kind])
    # Nothing lost or added: the model's JSON is the stored JSON (key order aside).
    assert parsed.as_json() == OLD_ROWS[kind]


def test_typed_fields_and_unknown_keys() -> None:
    fault = parse_evidence("gpu_fault", OLD_ROWS["gpu_fault"])
    assert isinstance(fault, GpuFaultEvidence)
    assert fault.events is not None and fault.events[0].xid == 79 and fault.events[1].lost
    degraded = parse_evidence("gpu_degraded", OLD_ROWS["gpu_degraded"])
    assert isinstance(degraded, DegradedEvidence)
    assert degraded.ecc is not None and degraded.ecc.rise == 120 and degraded.throttle is None
    # A key from a newer controller is kept, not dropped.
    newer = parse_evidence("node_lost", {"last_report_unix_s": 5.0, "agent_version": "9.9"})
    assert isinstance(newer, NodeLostEvidence)
    assert newer.as_json() == {"last_report_unix_s": 5.0, "agent_version": "9.9"}
    # A damaged row stays the dict it is; kinds without a model too.
    damaged = {"codes": "not a map"}
    assert parse_evidence("gpu_xid", damaged) is damaged
    straggler = {"rank": 3}  # fits neither straggler shape
    assert parse_evidence("straggler", straggler) is straggler
    untyped = {"anything": 1}
    assert parse_evidence("power_future", untyped) is untyped
    assert isinstance(parse_evidence("nic_errors", OLD_ROWS["nic_errors"]), HwEvidence)


def _fatal(ctl_report: Any, node: str, seq: int, code: int) -> dict[str, Any]:
    body: dict[str, Any] = ctl_report(
        node, seq, gpu_overrides={0: {"xid_events": [{"code": code}]}}
    )
    for sample in body["samples"]:
        for event in sample["gpus"][0].get("xid_events", []):
            event["time_unix_s"] = sample["time_unix_s"]
    return body


def test_detectors_store_typed_evidence_and_old_rows_are_served(
    live_controller: Any, db_url: str, ctl_report: Any
) -> None:
    live = live_controller
    with httpx.Client(base_url=live.url, timeout=20) as client:
        agent = live.headers("agent")
        assert client.post("/api/v1/reports", json=_fatal(ctl_report, "e1", 0, 79), headers=agent)
        assert client.post("/api/v1/reports", json=_fatal(ctl_report, "e1", 1, 45), headers=agent)
        deadline = time.monotonic() + 10
        while True:
            data = client.get("/api/v1/incidents?state=open", headers=live.headers()).json()
            found = {i["kind"]: i for i in data["data"] if i["node"] == "e1"}
            if {"gpu_fault", "application_xid"} <= set(found) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        fault = parse_evidence("gpu_fault", found["gpu_fault"]["evidence"])
        assert isinstance(fault, GpuFaultEvidence) and "XID 79" in fault.reasons[0]
        xids = parse_evidence("application_xid", found["application_xid"]["evidence"])
        # One per sample that carried it: the incident's count.
        assert isinstance(xids, XidEvidence)
        assert xids.codes == {"45": found["application_xid"]["count"]}

        # A row written by an older controller (and one that fits no model) is served as is.
        engine = make_engine(db_url)
        try:
            with engine.begin() as conn:
                for key, (kind, evidence) in {
                    "old:e1": ("gpu_degraded", OLD_ROWS["gpu_degraded"]),
                    "bad:e1": ("gpu_xid", {"codes": "not a map"}),
                }.items():
                    conn.execute(
                        text(
                            "INSERT INTO incidents (kind, severity, state, summary, node_name,"
                            " ranks, evidence, dedupe_key, count, opened_unix_s,"
                            " updated_unix_s) VALUES (:k, 'warning', 'resolved', 'old', 'e1',"
                            " '[]', :e, :d, 1, 1.0, 1.0)"
                        ),
                        {"k": kind, "e": json.dumps(evidence), "d": key},
                    )
        finally:
            engine.dispose()
        r = client.get("/api/v1/incidents?state=resolved", headers=live.headers())
        assert r.status_code == 200, r.text
        served = {i["kind"]: i for i in r.json()["data"] if i["node"] == "e1"}
        assert served["gpu_degraded"]["evidence"] == OLD_ROWS["gpu_degraded"]
        assert "evidence_error" not in served["gpu_degraded"]  # typed: no error field
        # The damaged row is served, untyped, with the reason (an incident is never hidden).
        assert served["gpu_xid"]["evidence"] == {"codes": "not a map"}
        assert served["gpu_xid"]["evidence_error"].startswith("codes")

        # The published schema types the evidence per kind (what clients generate from).
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        shapes = {
            ref["$ref"].rsplit("/", 1)[-1]
            for ref in schemas["IncidentsPublic"]["properties"]["data"]["items"]["oneOf"]
        }
        assert {"GpuFaultIncidentPublic", "StragglerIncidentPublic", "HangIncidentPublic"} <= shapes
        assert "OtherIncidentPublic" in shapes
        fault = schemas["GpuFaultIncidentPublic"]["properties"]
        assert fault["kind"].get("const", fault["kind"].get("enum")) in ("gpu_fault", ["gpu_fault"])
        assert fault["evidence"]["$ref"].endswith("/GpuFaultEvidence")
