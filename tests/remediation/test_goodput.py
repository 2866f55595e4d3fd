"""Goodput accounting on synthetic timelines whose numbers are worked out by hand.

Healthy steps take 1 s, so step counts and seconds line up; ``run_steps`` records steps
``first..last`` back to back, ending at ``t0 + duration``, ``t0 + 2 * duration`` …
"""

from __future__ import annotations

import pytest

from controller.logic.remediation.goodput import GoodputLedger


def run_steps(g: GoodputLedger, first: int, last: int, t0: float, duration: float = 1.0) -> float:
    t = t0
    for step in range(first, last + 1):
        t += duration
        g.record_step(step, t, duration)
    return t


def by_id(snap: dict[str, object]) -> dict[str, dict[str, object]]:
    return {row["incident_id"]: row for row in snap["incidents"]}  # type: ignore[attr-defined,index]


def test_three_faults_straggler_hang_xid() -> None:
    # A small window: if the straggler's slow steps stayed in it, the median would be 2 s.
    g = GoodputLedger("gpt", window=16)
    run_steps(g, 1, 100, 0.0)  # t = 1 … 100

    # Straggler from t=100: steps 101-110 take 2 s; reported at 120, after those steps
    # arrived; protective checkpoint at 110, restart, first step 111 done at 131.
    run_steps(g, 101, 110, 100.0, duration=2.0)  # t = 102 … 120
    g.fault(100.0, "s1", "straggler")
    g.detected(120.0, "s1")
    assert g.median_step_s() == 1.0
    g.restart_started(121.0, "s1", last_step=110, resume_step=110)
    g.resumed(131.0)
    run_steps(g, 111, 150, 130.0)  # t = 131 … 170

    # Hang after step 150: nothing completes; restart from the checkpoint at 140.
    g.fault(170.5, "h1", "hang")
    g.detected(200.0, "h1")
    g.restart_started(202.0, "h1", last_step=150, resume_step=140)
    g.resumed(222.0)
    run_steps(g, 141, 150, 221.0)  # repeats, t = 222 … 231
    run_steps(g, 151, 185, 231.0)  # t = 232 … 266

    # Fatal XID after step 185; restart (smaller) from the checkpoint at 180.
    g.fault(266.5, "x1", "xid")
    g.detected(268.0, "x1")
    g.restart_started(270.0, "x1", last_step=185, resume_step=180)
    g.resumed(300.0)
    run_steps(g, 181, 200, 299.0)  # 181-185 repeated, t = 300 … 319

    snap = g.snapshot()
    rows = by_id(snap)
    assert rows["s1"] == {
        "incident_id": "s1",
        "kind": "straggler",
        "state": "resumed",
        "fault_t": 100.0,
        "detection_s": 20.0,
        "recovery_s": 11.0,
        "restart_s": 10.0,
        "recomputed_steps": 0,
        "recomputed_s": 0.0,
        "outage_s": 31.0,
        "credited_s": 10.0,  # ten slow steps kept, each worth one healthy step
        "lost_s": 21.0,
    }
    h1 = rows["h1"]
    assert (h1["detection_s"], h1["recovery_s"], h1["restart_s"]) == (29.5, 22.0, 20.0)
    assert (h1["recomputed_steps"], h1["recomputed_s"], h1["credited_s"]) == (10, 10.0, 0.0)
    assert h1["lost_s"] == 51.5 + 10.0
    x1 = rows["x1"]
    assert (x1["detection_s"], x1["recovery_s"], x1["restart_s"]) == (1.5, 32.0, 30.0)
    assert (x1["recomputed_steps"], x1["lost_s"]) == (5, 33.5 + 5.0)
    assert snap["wall_s"] == 319.0
    assert snap["lost_s"] == 21.0 + 61.5 + 38.5
    assert snap["productive_s"] == 319.0 - 121.0
    assert snap["ettr"] == pytest.approx(198.0 / 319.0)
    assert (snap["steps"], snap["repeated_steps"], snap["high_water_step"]) == (200, 15, 200)
    assert snap["median_step_s"] == 1.0


def test_second_fault_before_the_first_recovery_finished() -> None:
    g = GoodputLedger("gpt")
    run_steps(g, 1, 50, 0.0)
    g.fault(50.5, "a", "hang")
    g.detected(60.0, "a")
    g.restart_started(62.0, "a", last_step=50, resume_step=40)
    # The new generation dies before its first step; its newest checkpoint is corrupt.
    g.fault(70.0, "b", "xid")
    g.detected(72.0, "b")
    g.restart_started(75.0, "b", last_step=50, resume_step=30)
    assert by_id(g.snapshot(now=80.0))["a"]["state"] == "restarting"
    g.resumed(90.0)
    run_steps(g, 31, 60, 89.0)  # 31-50 repeated, t = 90 … 119

    snap = g.snapshot()
    a, b = by_id(snap)["a"], by_id(snap)["b"]
    # The earlier incident owns the overlapping window; b adds only steps a did not lose.
    assert (a["outage_s"], a["recomputed_steps"], a["lost_s"]) == (39.5, 10, 49.5)
    assert (a["detection_s"], a["recovery_s"], a["restart_s"]) == (9.5, 30.0, 28.0)
    assert (b["outage_s"], b["recomputed_steps"], b["lost_s"]) == (0.0, 10, 10.0)
    assert (b["detection_s"], b["recovery_s"], b["restart_s"]) == (2.0, 18.0, 15.0)
    assert snap["lost_s"] == 59.5 and snap["wall_s"] == 119.0
    assert (snap["steps"], snap["repeated_steps"]) == (60, 20)


def test_straggler_without_restart_costs_its_slowdown() -> None:
    g = GoodputLedger("gpt")
    run_steps(g, 1, 20, 0.0)
    g.fault(20.0, "s", "straggler")
    g.detected(26.0, "s")
    t = run_steps(g, 21, 30, 20.0, duration=1.5)  # t = 21.5 … 35
    open_row = by_id(g.snapshot())["s"]
    assert (open_row["state"], open_row["lost_s"], open_row["recovery_s"]) == (
        "detected",
        5.0,
        None,
    )
    g.closed(t, "s")
    run_steps(g, 31, 35, t)  # healthy again, t = 36 … 40
    snap = g.snapshot()
    assert by_id(snap)["s"]["state"] == "closed"
    assert snap["lost_s"] == 5.0 and snap["ettr"] == pytest.approx(35.0 / 40.0)


def test_events_are_idempotent_and_unknown_incidents_start_at_their_event() -> None:
    g = GoodputLedger("gpt")
    run_steps(g, 1, 10, 0.0)
    g.restart_started(12.0, "op", last_step=10, resume_step=10)  # operator restart, no fault
    g.restart_started(13.0, "op", last_step=10, resume_step=5)  # retried: first one stands
    g.fault(11.0, "op", "late")  # already known: ignored
    g.resumed(20.0)
    g.resumed(25.0)  # nothing pending: no effect
    row = by_id(g.snapshot(now=20.0))["op"]
    assert (row["kind"], row["outage_s"], row["recomputed_steps"]) == ("unknown", 8.0, 0)
    assert row["detection_s"] == 0.0
    with pytest.raises(ValueError, match="duration_s must be >= 0"):
        g.record_step(11, 30.0, -1.0)


def test_memory_is_bounded_per_step() -> None:
    g = GoodputLedger("gpt", window=64)
    run_steps(g, 1, 20_000, 0.0)
    assert len(g._healthy) == 64 and len(g._recent) == 64
    snap = g.snapshot()
    assert snap["ettr"] == 1.0 and snap["incidents"] == []


def test_empty_ledger_snapshot() -> None:
    snap = GoodputLedger("gpt").snapshot()
    assert snap["wall_s"] == 0.0 and snap["ettr"] is None and snap["median_step_s"] is None


def test_a_ledger_replayed_from_restart_rows_charges_what_the_live_one_did() -> None:
    from controller.services.remediation.history import RestartRow, replay

    live = GoodputLedger("gpt")
    t = run_steps(live, 1, 10, 0.0)  # t = 10
    live.fault(8.5, "7", "hang")
    live.detected(9.0, "7")
    live.restart_started(11.0, "7", 10, 6)
    live.resumed(20.0)
    facts = {
        "ledger_id": "7",
        "kind": "hang",
        "fault_unix_s": 8.5,
        "detected_unix_s": 9.0,
        "last_step": 10,
        "resume_step": 6,
        "step_s": 1.0,
        "restart_unix_s": 11.0,
        "resumed_unix_s": 20.0,
    }
    rows = [
        RestartRow(1, "gpt", "incident:7", "succeeded", 11.2, {"goodput": facts}),
        RestartRow(2, "other", "incident:8", "succeeded", 12.0, {"goodput": facts}),
        RestartRow(3, "gpt", "incident:9", "succeeded", 13.0, {"plan": "shrink"}),  # older rows
    ]
    rebuilt = GoodputLedger("gpt")
    rebuilt.started_at(0.0)
    assert replay(rebuilt, rows) == 1
    want, got = live.snapshot(now=t + 10), rebuilt.snapshot(now=t + 10)
    assert got["wall_s"] == want["wall_s"] == 20.0
    assert got["lost_s"] == pytest.approx(want["lost_s"])
    keys = ("incident_id", "kind", "state", "detection_s", "restart_s", "recomputed_steps")
    assert [{k: r[k] for k in keys} for r in got["incidents"]] == [
        {k: r[k] for k in keys} for r in want["incidents"]
    ]


def test_goodput_facts_round_trip_and_a_malformed_row_is_skipped() -> None:
    """The restart step writes ``GoodputFacts.to_params()``; replay parses the same model,
    so a row with a missing or mistyped field is skipped, not half-applied."""
    from controller.logic.remediation.params import GoodputFacts
    from controller.services.remediation.history import RestartRow, replay

    facts = GoodputFacts(
        ledger_id="7",
        kind="hang",
        fault_unix_s=8.5,
        detected_unix_s=9.0,
        last_step=10,
        resume_step=6,
        step_s=None,
    )
    stored = facts.to_params()
    assert "restart_unix_s" not in stored and stored["step_s"] is None  # as given, no more
    later = facts.resumed(restart_unix_s=11.0, resumed_unix_s=20.0).to_params()
    assert GoodputFacts.model_validate(later).resumed_unix_s == 20.0
    broken = dict(later, last_step="ten")
    missing = {k: v for k, v in later.items() if k != "kind"}
    rows = [
        RestartRow(1, "gpt", "incident:7", "succeeded", 11.2, {"goodput": broken}),
        RestartRow(2, "gpt", "incident:8", "succeeded", 11.5, {"goodput": missing}),
        RestartRow(3, "gpt", "incident:9", "succeeded", 12.0, {"goodput": later}),
    ]
    ledger = GoodputLedger("gpt")
    ledger.started_at(0.0)
    assert replay(ledger, rows) == 1
    assert [r["incident_id"] for r in ledger.snapshot(now=30.0)["incidents"]] == ["7"]
