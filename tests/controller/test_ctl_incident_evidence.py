"""Typed health and degraded-GPU evidence (issue 13): what the detectors store fits its model,
and rows stored before the models existed (or damaged ones) still load."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from controller.db.migrate import upgrade
from controller.db.session import make_engine
from controller.loader import load_state
from controller.logic.detection.evidence_kinds import EVIDENCE_BY_KIND, parse_evidence
from controller.logic.detection.incident_evidence import (
    DegradedEvidence,
    EvidenceEvent,
    GpuFaultEvidence,
    HwEvidence,
    IncidentEvidence,
    NodeLostEvidence,
    UntypedEvidence,
    XidEvidence,
)
from controller.services.incidents import IncidentService, IncidentSpec
from controller.state import ClusterState
from controller.store import Store
from tests import http_calls
from tests.controller.db_reads import stored

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
    # A damaged row is kept as stored (untyped: none of its kind's fields is trusted);
    # kinds without a model too. Its JSON is the stored object, a copy of it.
    damaged = {"codes": "not a map", "events": "not a list"}
    straggler = {"rank": 3}  # fits neither straggler shape
    untyped = {"anything": 1, "nested": {"a": [1, 2]}}
    for kind, row in (("gpu_xid", damaged), ("straggler", straggler), ("power_future", untyped)):
        kept = parse_evidence(kind, row)
        assert type(kept) is UntypedEvidence, (kind, kept)
        assert kept.as_json() == kept.model_dump() == row and kept.as_json() is not row
        assert kept.events is None and kept.brief() == {}
    kept = parse_evidence("power_future", untyped)
    kept.as_json()["nested"]["a"].append(3)  # a reader's copy: the kept object is unchanged
    assert kept.as_json() == untyped == {"anything": 1, "nested": {"a": [1, 2]}}
    assert kept == parse_evidence("power_future", untyped) != parse_evidence("x", straggler)
    # A hand-edited row that is not even an object: kept too (the loader must not fail).
    assert parse_evidence("gpu_xid", [1, "x"]).as_json() == [1, "x"]
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
    with http_calls.client(base_url=live.url, timeout=20) as client:
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


def test_memory_holds_evidence_typed_and_the_row_its_json(tmp_path: Path) -> None:
    """Evidence is typed once where it enters memory: the incident service on open, bump and
    resolution, the loader at start. The row stores the same JSON memory's model gives, and
    an odd row (or a kind without a model) is kept as stored, the incident still loaded."""
    url = f"sqlite:///{tmp_path / 'ev.db'}"
    upgrade(url)
    store = Store(make_engine(url))
    state = ClusterState()
    incidents = IncidentService(state, store)

    def row(incident_id: int) -> dict[str, Any]:
        value = stored(url, "SELECT evidence FROM incidents WHERE id = :i", i=incident_id)
        return json.loads(value) if isinstance(value, str) else dict(value)

    def spec(kind: str, evidence: IncidentEvidence) -> IncidentSpec:
        return IncidentSpec(
            kind=kind, severity="warning", summary=kind, dedupe_key=f"{kind}:n1:0", node="n1",
            gpu_index=0, evidence=evidence,
        )  # fmt: skip

    old = parse_evidence("gpu_degraded", OLD_ROWS["gpu_degraded"])
    newer = DegradedEvidence(causes=["throttled"], since_unix_s=20.0)
    other = UntypedEvidence.of({"anything": [1, {"a": 2}]})

    async def scenario() -> None:
        degraded, _ = await incidents.open_or_bump(spec("gpu_degraded", old))
        assert type(degraded.evidence) is DegradedEvidence and degraded.evidence is not old
        assert row(degraded.id) == degraded.evidence.as_json() == OLD_ROWS["gpu_degraded"]
        event = EvidenceEvent(time_unix_s=30.0, cause="throttle")
        await incidents.open_or_bump(
            spec("gpu_degraded", old), events=[event], evidence_update=newer
        )
        merged = degraded.evidence
        assert isinstance(merged, DegradedEvidence) and merged.causes == ["throttled"]
        assert merged.ecc is not None and merged.ecc.rise == 120  # kept from the first
        assert merged.events is not None and [e.time_unix_s for e in merged.events] == [11, 30]
        assert row(degraded.id) == merged.as_json()
        untyped, _ = await incidents.open_or_bump(spec("power_future", other))
        assert type(untyped.evidence) is UntypedEvidence
        assert row(untyped.id) == untyped.evidence.as_json() == {"anything": [1, {"a": 2}]}
        await incidents.resolve(degraded, note="cooled down")
        assert isinstance(degraded.evidence, DegradedEvidence)
        assert degraded.evidence.resolution == "cooled down"
        assert row(degraded.id) == degraded.evidence.as_json()

    try:
        asyncio.run(scenario())
        # Rows the loader reads back: a typed one, one that fits no model, an untyped kind.
        with store.engine.begin() as conn:
            for key, (kind, evidence) in {
                "a": ("application_xid", OLD_ROWS["application_xid"]),
                "b": ("gpu_xid", {"codes": "not a map"}),
                "c": ("gpu_fault", ["not", "an", "object"]),
            }.items():
                conn.execute(
                    text(
                        "INSERT INTO incidents (kind, severity, state, summary, node_name,"
                        " ranks, evidence, dedupe_key, count, opened_unix_s,"
                        " updated_unix_s) VALUES (:k, 'warning', 'open', 'old', 'n1',"
                        " '[]', :e, :d, 1, 1.0, 1.0)"
                    ),
                    {"k": kind, "e": json.dumps(evidence), "d": key},
                )
        loaded = ClusterState()
        with Session(store.engine) as session:
            load_state(session, loaded)
    finally:
        store.close()
    by_key = loaded.incidents_by_key
    assert set(by_key) == {"a", "b", "c", "power_future:n1:0"}  # not the resolved one
    assert isinstance(by_key["a"].evidence, XidEvidence)
    assert by_key["a"].evidence.codes == {"45": 3, "13": 1}
    assert type(by_key["b"].evidence) is UntypedEvidence  # odd: kept, never hidden
    assert by_key["b"].evidence.as_json() == {"codes": "not a map"}
    assert by_key["c"].evidence.as_json() == ["not", "an", "object"]
    assert by_key["power_future:n1:0"].evidence == other


def test_an_incident_whose_stored_evidence_is_not_an_object_can_be_bumped_and_resolved(
    tmp_path: Path,
) -> None:
    """A hand-edited row holding a list loads as it is; merging a bump or a resolution into
    it failed (``list.update``), so such an incident could never be bumped or closed."""
    url = f"sqlite:///{tmp_path / 'ev.db'}"
    upgrade(url)
    store = Store(make_engine(url))
    state = ClusterState()
    incidents = IncidentService(state, store)
    odd = UntypedEvidence.of(["not", "an", "object"])
    spec = IncidentSpec(
        kind="gpu_fault", severity="warning", summary="odd", dedupe_key="odd", node="n1",
        evidence=odd,
    )  # fmt: skip

    async def scenario() -> None:
        incident, _ = await incidents.open_or_bump(spec)
        incident.evidence = odd  # what the loader keeps for such a row
        await incidents.open_or_bump(spec, evidence_update=UntypedEvidence.of({"n": 2}))
        assert incident.evidence.as_json() == {"stored": ["not", "an", "object"], "n": 2}
        await incidents.resolve(incident, note="fixed by hand")
        assert incident.state == "resolved"
        assert incident.evidence.as_json()["resolution"] == "fixed by hand"

    try:
        asyncio.run(scenario())
    finally:
        store.close()
