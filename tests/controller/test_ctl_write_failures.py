"""Detector and periodic writes that fail change nothing (issue 14), on SQLite and PostgreSQL.

The database is made unavailable for one kind of statement (``ctl_db_outage``: a real
SQLAlchemy hook raising the driver's ``OperationalError`` inside the real transaction) while
a detector opens or bumps an incident, the health detector marks a silent node lost or a
node back, or the command service expires a command. Each time the API (memory) still shows
exactly what the database holds, the failure is counted, and once the database answers
again the next report or tick records the same condition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controller.db.session import make_engine
from tests import http_calls
from tests.controller.db_reads import stored as _stored
from tests.controller.db_reads import stored_rows as _rows
from tests.traffic.fabrics import lab_fabric_file
from tests.waiting import wait_for


def _post(client: httpx.Client, live: Any, path: str, body: Any, role: str = "operator") -> Any:
    return client.post(path, json=body, headers=live.headers(role))


def _node(client: httpx.Client, live: Any, name: str) -> dict[str, Any]:
    r = client.get(f"/api/v1/nodes/{name}", headers=live.headers())
    assert r.status_code == 200, r.text
    return dict(r.json())


def _open(client: httpx.Client, live: Any, node: str) -> list[dict[str, Any]]:
    r = client.get("/api/v1/incidents?state=open", headers=live.headers())
    assert r.status_code == 200, r.text
    return [i for i in r.json()["data"] if i["node"] == node]


def _fatal(ctl_report: Callable[..., dict[str, Any]], node: str, seq: int) -> dict[str, Any]:
    """A report whose GPU 0 shows XID 79 (fallen off the bus) once."""
    body = ctl_report(node, seq, gpu_overrides={0: {"xid_events": [{"code": 79}]}})
    for sample in body["samples"]:
        for event in sample["gpus"][0].get("xid_events", []):
            event["time_unix_s"] = sample["time_unix_s"]
    return body


def _agrees(client: httpx.Client, live: Any, db_url: str, node: str) -> dict[str, Any]:
    """Assert the API's node and GPU 0 health and open incidents equal the database's."""
    shown = _node(client, live, node)
    gpu0 = next(g for g in shown["gpus"] if g["index"] == 0)
    assert shown["health"] == _stored(db_url, "SELECT health FROM nodes WHERE name = :n", n=node)
    stored_gpu = _stored(
        db_url, 'SELECT health FROM gpus WHERE node_name = :n AND "index" = 0', n=node
    )
    assert gpu0["health"] == stored_gpu
    incidents = _open(client, live, node)
    stored_open = _stored(
        db_url,
        "SELECT count(*) FROM incidents WHERE node_name = :n AND state = 'open'",
        n=node,
    )
    assert len(incidents) == stored_open
    for incident in incidents:
        count = _stored(db_url, "SELECT count FROM incidents WHERE id = :i", i=incident["id"])
        assert incident["count"] == count
    return shown


#: ``node_lost_after_s`` of the node-lost tests: a node silent this long is lost, so a test
#: waits it out (and a tick or two: ``HealthDetector.tick_interval_s`` is a quarter of it).
LOST_AFTER_S = 1.0


def _back_within(limit_s: float, back: Callable[[int], None], seq: int, tries: int = 5) -> None:
    """Run ``back(seq)`` (a report that brings a node back, then the checks that it is back)
    until a run passes. A failed run that took ``limit_s`` or longer is run again with the
    next ``seq``: the node may rightly have fallen silent again while a loaded machine was
    slow to check it. A failed run that was quicker fails the test."""
    for attempt in range(tries):
        started = time.monotonic()
        try:
            back(seq + attempt)
            return
        except AssertionError:
            if time.monotonic() - started < limit_s or attempt == tries - 1:
                raise


def test_incident_open_and_bump_that_fail_change_nothing(
    live_controller, db_url, ctl_report, ctl_db_outage, ctl_metric
) -> None:
    live = live_controller
    incidents = live.controller.incidents
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert _post(client, live, "/api/v1/reports", ctl_report("w1", 0), "agent").is_success

        # Open: the report is stored (200), the fault is not, so nothing shows it.
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        r = _post(client, live, "/api/v1/reports", _fatal(ctl_report, "w1", 1), "agent")
        assert r.status_code == 200, r.text
        wait_for(lambda: incidents.write_failures["open"] >= 1)
        shown = _agrees(client, live, db_url, "w1")
        assert shown["health"] == "healthy" and _open(client, live, "w1") == []
        # Counted where an operator sees it.
        scraped = client.get("/metrics").text
        assert ctl_metric(scraped, "trainguard_incident_write_failures_total") >= 1
        ctl_db_outage.disarm()

        # The next report carrying the fault records it, with its node and GPU.
        r = _post(client, live, "/api/v1/reports", _fatal(ctl_report, "w1", 2), "agent")
        assert r.status_code == 200, r.text
        wait_for(lambda: bool(_open(client, live, "w1")))
        shown = _agrees(client, live, db_url, "w1")
        assert shown["health"] == "unhealthy"
        (fault,) = _open(client, live, "w1")
        assert fault["kind"] == "gpu_fault"
        count = fault["count"]

        # Bump: not stored, so the count shown is the stored one.
        ctl_db_outage.arm(r"^\s*UPDATE incidents")
        r = _post(client, live, "/api/v1/reports", _fatal(ctl_report, "w1", 3), "agent")
        assert r.status_code == 200, r.text
        wait_for(lambda: incidents.write_failures["bump"] >= 1)
        _agrees(client, live, db_url, "w1")
        assert _open(client, live, "w1")[0]["count"] == count
        ctl_db_outage.disarm()
        r = _post(client, live, "/api/v1/reports", _fatal(ctl_report, "w1", 4), "agent")
        assert r.status_code == 200, r.text
        wait_for(lambda: _open(client, live, "w1")[0]["count"] > count)
        _agrees(client, live, db_url, "w1")


def test_gpu_watch_failure_that_is_not_stored_is_tried_again(
    live_controller, db_url, ctl_report, ctl_db_outage
) -> None:
    live = live_controller
    with http_calls.client(base_url=live.url, timeout=20) as client:
        broken = ctl_report("w2", 0)
        broken["node"]["gpu_error"] = "NVML_ERROR_DRIVER_NOT_LOADED"
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        assert _post(client, live, "/api/v1/reports", broken, "agent").status_code == 200
        wait_for(lambda: live.controller.incidents.write_failures["open"] >= 1)
        assert _agrees(client, live, db_url, "w2")["health"] == "healthy"
        ctl_db_outage.disarm()
        broken = ctl_report("w2", 1)
        broken["node"]["gpu_error"] = "NVML_ERROR_DRIVER_NOT_LOADED"
        assert _post(client, live, "/api/v1/reports", broken, "agent").status_code == 200
        wait_for(lambda: _node(client, live, "w2")["health"] == "unhealthy")
        assert [i["kind"] for i in _open(client, live, "w2")] == ["gpu_watch_failed"]
        _agrees(client, live, db_url, "w2")

        # Resolving it (NVML works again) fails: still unhealthy, still open, both places.
        ctl_db_outage.arm(r"^\s*UPDATE incidents")
        assert _post(client, live, "/api/v1/reports", ctl_report("w2", 2), "agent").is_success
        wait_for(lambda: live.controller.incidents.write_failures["resolve"] >= 1)
        assert _agrees(client, live, db_url, "w2")["health"] == "unhealthy"
        ctl_db_outage.disarm()
        assert _post(client, live, "/api/v1/reports", ctl_report("w2", 3), "agent").is_success
        wait_for(lambda: _node(client, live, "w2")["health"] == "healthy")
        assert _open(client, live, "w2") == []
        _agrees(client, live, db_url, "w2")


def test_node_lost_and_back_that_fail_change_nothing(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    live = controller_factory(node_lost_after_s=LOST_AFTER_S, ingest_flush_interval_s=0.0)
    failures = live.controller.incidents.write_failures
    with http_calls.client(base_url=live.url, timeout=20) as client:
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        assert _post(client, live, "/api/v1/reports", ctl_report("w3", 0), "agent").is_success
        # Silent while the database cannot take the incident: every tick fails, the node
        # stays as stored (healthy), never "lost" in the API alone.
        wait_for(lambda: failures["open"] >= 2)
        assert _agrees(client, live, db_url, "w3")["health"] == "healthy"
        ctl_db_outage.disarm()
        wait_for(lambda: _node(client, live, "w3")["health"] == "lost")
        assert [i["kind"] for i in _open(client, live, "w3")] == ["node_lost"]
        _agrees(client, live, db_url, "w3")

        # Back: the resolution fails, so the node is still lost in both places ...
        ctl_db_outage.arm(r"^\s*UPDATE incidents")
        assert _post(client, live, "/api/v1/reports", ctl_report("w3", 1), "agent").is_success
        wait_for(lambda: failures["resolve"] >= 1)
        assert _agrees(client, live, db_url, "w3")["health"] == "lost"
        ctl_db_outage.disarm()

        # ... and its next report brings it back.
        def back(seq: int) -> None:
            r = _post(client, live, "/api/v1/reports", ctl_report("w3", seq), "agent")
            assert r.is_success
            wait_for(lambda: _node(client, live, "w3")["health"] == "healthy")
            assert _open(client, live, "w3") == []
            _agrees(client, live, db_url, "w3")

        _back_within(LOST_AFTER_S, back, 2)


def test_node_back_without_an_open_incident_that_fails_changes_nothing(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    """A lost node whose ``node_lost`` an operator resolved while it was still silent comes
    back with no incident to write with: its node row alone is written, then shown."""
    live = controller_factory(node_lost_after_s=LOST_AFTER_S, ingest_flush_interval_s=0.0)
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert _post(client, live, "/api/v1/reports", ctl_report("w9", 0), "agent").is_success
        wait_for(lambda: _node(client, live, "w9")["health"] == "lost")
        (lost,) = _open(client, live, "w9")
        r = _post(client, live, f"/api/v1/incidents/{lost['id']}/resolve", None)
        assert r.status_code == 200, r.text
        assert _agrees(client, live, db_url, "w9")["health"] == "lost"

        # The report is stored (its node row says "lost"); the detector's row saying
        # "healthy" is refused: the node stays lost in both places.
        ctl_db_outage.arm(r"^\s*INSERT INTO nodes", values=("'w9'", "'healthy'"))
        assert _post(client, live, "/api/v1/reports", ctl_report("w9", 1), "agent").is_success
        wait_for(lambda: ctl_db_outage.hits >= 1)
        time.sleep(0.2)  # let the detector's failure settle; nothing may change after it
        assert _agrees(client, live, db_url, "w9")["health"] == "lost"
        ctl_db_outage.disarm()

        def back(seq: int) -> None:
            r = _post(client, live, "/api/v1/reports", ctl_report("w9", seq), "agent")
            assert r.is_success
            wait_for(lambda: _node(client, live, "w9")["health"] == "healthy")
            assert _agrees(client, live, db_url, "w9")["health"] == "healthy"

        _back_within(LOST_AFTER_S, back, 2)


def test_ecc_counter_reset_that_fails_changes_nothing(
    live_controller, db_url, ctl_report, ctl_db_outage
) -> None:
    """An uncorrectable-ECC counter reset (no fault) is the baseline the next fault is
    judged against, also after a restart: written, then kept in memory, so a write that
    fails leaves the old baseline in both."""
    live = live_controller
    gpu = live.controller.state.nodes

    def post(seq: int, value: int) -> None:
        body = ctl_report("w10", seq, gpus=2, gpu_overrides={0: {"ecc_uncorrected_total": value}})
        assert _post(client, live, "/api/v1/reports", body, "agent").is_success

    def stored() -> Any:
        return _stored(
            db_url,
            "SELECT ecc_uncorrected_total FROM gpus WHERE node_name = 'w10' AND \"index\" = 0",
        )

    def baseline() -> int:
        value = stored()
        assert gpu["w10"].gpus[0].ecc_uncorrected_total == value
        return int(value)

    with http_calls.client(base_url=live.url, timeout=20) as client:
        post(0, 7)  # the first value: queued with the next group commit
        wait_for(lambda: gpu["w10"].gpus[0].ecc_uncorrected_total == 7 and stored() == 7)
        assert baseline() == 7
        ctl_db_outage.arm(r"^\s*INSERT INTO gpus", values=("'w10'",))
        post(1, 2)  # a driver reload reset the counter: no fault
        wait_for(lambda: ctl_db_outage.hits >= 1)
        time.sleep(0.2)
        assert baseline() == 7
        ctl_db_outage.disarm()
        post(2, 2)
        wait_for(lambda: gpu["w10"].gpus[0].ecc_uncorrected_total == 2)
        assert baseline() == 2
        assert _open(client, live, "w10") == []  # neither value was a fault


def test_command_expiry_that_fails_changes_nothing(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    live = controller_factory(command_expire_after_s=0.4, ingest_flush_interval_s=0.0)
    state = live.controller.state
    with http_calls.client(base_url=live.url, timeout=20) as client:
        assert _post(client, live, "/api/v1/reports", ctl_report("w4", 0), "agent").is_success
        command = {"kind": "set_power_limit", "gpu_index": 0, "limit_w": 400}
        r = _post(client, live, "/api/v1/nodes/w4/commands", command)
        assert r.status_code == 201, r.text
        command_id = r.json()["id"]

        def stored() -> Any:
            return _stored(db_url, "SELECT status FROM commands WHERE id = :i", i=command_id)

        ctl_db_outage.arm(r"^\s*INSERT INTO commands")
        wait_for(lambda: ctl_db_outage.hits >= 3)  # several expiry ticks, each refused
        assert state.commands[command_id].status == stored() == "pending"
        ctl_db_outage.disarm()
        wait_for(lambda: stored() == "expired")
        wait_for(lambda: state.commands[command_id].status == "expired")
        listed = client.get("/api/v1/commands?node=w4", headers=live.headers()).json()
        assert [c["status"] for c in listed["data"]] == ["expired"]
        # An expired command is never handed to the agent; its reports still store.
        reply = _post(client, live, "/api/v1/reports", ctl_report("w4", 1), "agent")
        assert reply.status_code == 200 and reply.json()["commands"] == []


def test_traffic_plan_and_link_writes_that_fail_change_nothing(
    controller_factory, db_url, ctl_db_outage, tmp_path
) -> None:
    live = controller_factory(
        topology_file=lab_fabric_file(tmp_path, "tf"), ingest_flush_interval_s=0.0
    )
    with http_calls.client(base_url=live.url, timeout=30) as client:
        for k in range(4):
            ranks = [2 * k, 2 * k + 1]
            steps = [
                {"job": "llm", "rank": r, "world_size": 8, "step": 0, "compute_time_s": 1.0,
                 "collective_wait_s": 0.05, "step_time_s": 1.05, "gpu_index": i}
                for i, r in enumerate(ranks)
            ]  # fmt: skip
            gpus = [{"index": i, "uuid": f"tf-{k}-g{i}"} for i in (0, 1)]
            body = {
                "node": {"name": f"tf-{k}", "gpus": gpus},
                "agent_instance": "i1", "seq": 0, "sent_unix_s": time.time(),
                "job": {"steps": steps}, "samples": [],
            }  # fmt: skip
            assert _post(client, live, "/api/v1/reports", body, "agent").status_code == 200

        def plans() -> list[dict[str, Any]]:
            r = client.get("/api/v1/plans", headers=live.headers())
            assert r.status_code == 200, r.text
            return list(r.json()["data"])

        request = {"job": "llm", "layout": {"tp": 1, "channels": 2}}
        ctl_db_outage.arm(r"^\s*INSERT INTO traffic_plans")
        r = _post(client, live, "/api/v1/plans", request)
        assert r.status_code == 503, r.text
        assert plans() == [] and _stored(db_url, "SELECT count(*) FROM traffic_plans") == 0
        ctl_db_outage.disarm()
        r = _post(client, live, "/api/v1/plans", request)
        assert r.status_code == 201, r.text
        plan_id = r.json()["plan_id"]

        def version_shown() -> int:
            return int(
                client.get(f"/api/v1/plans/{plan_id}", headers=live.headers()).json()["version"]
            )

        def version_stored() -> int:
            return int(
                _stored(
                    db_url, "SELECT max(version) FROM traffic_plans WHERE plan_id = :p", p=plan_id
                )
            )

        assert version_shown() == version_stored() == 1

        # A link marked down re-plans: the new version and the link state are one write.
        ctl_db_outage.arm(r"^\s*INSERT INTO traffic_links")
        r = _post(client, live, "/api/v1/topology/links/tor-a--spine-0/state", {"state": "down"})
        assert r.status_code == 503, r.text
        assert version_shown() == version_stored() == 1
        assert _stored(db_url, "SELECT count(*) FROM traffic_links") == 0
        ctl_db_outage.disarm()
        r = _post(client, live, "/api/v1/topology/links/tor-a--spine-0/state", {"state": "down"})
        assert r.status_code == 200, r.text
        assert version_shown() == version_stored() == 2
        assert _stored(db_url, "SELECT link FROM traffic_links") == "tor-a--spine-0"


def test_job_finding_whose_incident_write_fails_is_recorded_at_a_later_tick(
    controller_factory, db_url, ctl_db_outage, ctl_metric
) -> None:
    """A rank's crash is reported once and found once by the C4D trackers: the incident
    write that fails holds the finding, and a later tick records it, with no new report."""
    # The held finding's retries back off from one job tick (doubling): at 0.2 s ticks the
    # second try and the one after the outage come within a second instead of ~3 s.
    live = controller_factory(job_tick_interval_s=0.2)
    (jobs,) = [t for t in live.controller.tickers if type(t).__name__ == "JobDetector"]
    crash = {
        "job": "llm", "rank": 6, "kind": "exited", "exit_code": 1,
        "time_unix_s": time.time(), "world_size": 8,
    }  # fmt: skip
    body = {
        "node": {"name": "w6", "gpus": [{"index": 0, "uuid": "w6-g0"}]},
        "agent_instance": "i1", "seq": 0, "sent_unix_s": time.time(), "samples": [],
        "job": {"rank_events": [crash]},
    }  # fmt: skip
    with http_calls.client(base_url=live.url, timeout=20) as client:

        def crashes() -> list[dict[str, Any]]:
            r = client.get("/api/v1/incidents?kind=rank_crash", headers=live.headers())
            assert r.status_code == 200, r.text
            return list(r.json()["data"])

        def stored() -> int:
            return int(_stored(db_url, "SELECT count(*) FROM incidents WHERE kind = 'rank_crash'"))

        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        assert _post(client, live, "/api/v1/reports", body, "agent").status_code == 200
        wait_for(lambda: jobs.held_counts["held"] >= 1)
        wait_for(lambda: live.controller.incidents.write_failures["open"] >= 2)  # tried again
        assert crashes() == [] and stored() == 0
        scraped = client.get("/metrics").text
        assert ctl_metric(scraped, "trainguard_job_findings_waiting") == 1
        ctl_db_outage.disarm()

        # No new report: the held finding is recorded by a later tick, once.
        wait_for(lambda: bool(crashes()))
        (incident,) = crashes()
        assert incident["job"] == "llm" and incident["ranks"] == [6] and stored() == 1
        scraped = client.get("/metrics").text
        assert ctl_metric(scraped, 'trainguard_job_findings_held_total{outcome="recorded"}') == 1
        assert ctl_metric(scraped, "trainguard_job_findings_waiting") == 0
        assert jobs.held == {} and jobs.held_counts["dropped"] == 0


def test_degraded_gpu_open_and_held_bump_that_fail_change_nothing(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    """A correctable-ECC burst whose open fails is not shown and opens with the burst's
    next sample; a held-back bump whose write fails is kept and written by a later tick,
    with no new report, to the count the reports added up to."""
    # Bumps are held for 0.5 s instead of 2 s: the test waits for the held bump's write
    # to fail and for a later tick to write it; how long they are held is not the point.
    live = controller_factory(
        degraded_ecc_rise=50, degraded_ecc_window_s=60.0, degraded_bump_interval_s=0.5
    )
    failures = live.controller.incidents.write_failures
    clock = [time.time() - 3600.0]
    seq = [0]

    def post(values: list[int]) -> None:
        body = ctl_report("w7", seq[0], gpus=2, samples=len(values), t0=clock[0])
        for sample, value in zip(body["samples"], values, strict=True):
            sample["gpus"][1]["ecc_corrected_total"] = value
        seq[0] += 1
        clock[0] += len(values)
        assert _post(client, live, "/api/v1/reports", body, "agent").status_code == 200

    def degraded() -> list[dict[str, Any]]:
        r = client.get("/api/v1/incidents?kind=gpu_degraded", headers=live.headers())
        assert r.status_code == 200, r.text
        return list(r.json()["data"])

    def stored_count() -> Any:
        return _stored(db_url, "SELECT max(count) FROM incidents WHERE kind = 'gpu_degraded'")

    with http_calls.client(base_url=live.url, timeout=20) as client:
        post([1000, 1000])  # the baseline
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        post([1030, 1060])
        wait_for(lambda: failures["open"] >= 1)
        assert degraded() == [] and stored_count() is None
        ctl_db_outage.disarm()
        post([1080])  # still a burst: the open is tried again
        (opened,) = wait_for(degraded)
        assert opened["count"] == stored_count() == 1

        ctl_db_outage.arm(r"^\s*UPDATE incidents")
        for value in (1200, 1300, 1400):
            post([value])
        wait_for(lambda: failures["bump"] >= 1)
        (shown,) = degraded()
        assert shown["count"] == stored_count()  # as stored: the failed bump is not shown
        ctl_db_outage.disarm()
        # No new report: a tick writes what was held, all three readings of it.
        wait_for(lambda: degraded()[0]["count"] == 4, timeout_s=20.0)
        assert stored_count() == 4


def test_agent_token_rotation_that_fails_changes_nothing(
    controller_factory, db_url, ctl_report, ctl_db_outage
) -> None:
    """A rotation the database refuses hands out no token, starts no grace period for the
    node's current one (listed and stored as unexpiring), and the next rotation works."""
    live = controller_factory(allow_shared_agent_tokens=False, agent_token_grace_s=3600)
    path = "/api/v1/agent-credentials/w8"
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as client:

        def report(token: str, seq: int) -> int:
            auth = {"Authorization": f"Bearer {token}"}
            r = client.post("/api/v1/reports", json=ctl_report("w8", seq), headers=auth)
            return r.status_code

        def agrees() -> list[float | None]:
            listed = sorted(
                (c["created_unix_s"], c["expires_unix_s"]) for c in client.get(path).json()["data"]
            )
            stored = _rows(
                db_url,
                "SELECT created_unix_s, expires_unix_s FROM agent_credentials"
                " WHERE node_name = 'w8' ORDER BY created_unix_s",
            )
            assert listed == stored
            return [expires for _, expires in listed]

        first = client.post(path)
        assert first.status_code == 201, first.text
        token = first.json()["token"]
        assert report(token, 0) == 200
        for table in ("INSERT INTO agent_credentials", "UPDATE agent_credentials"):
            ctl_db_outage.arm(rf"^\s*{table}")
            r = client.post(path)
            assert r.status_code == 503, r.text
            assert "token" not in r.json()
            ctl_db_outage.disarm()
            assert agrees() == [None]
        assert report(token, 1) == 200
        second = client.post(path)
        assert second.status_code == 201, second.text
        expires = agrees()
        assert expires[0] is not None and expires[1] is None  # the first one in its grace
        assert report(second.json()["token"], 2) == 200 and report(token, 3) == 200


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_held_job_findings_are_bounded_in_number_and_time(db_url, ctl_db_outage) -> None:
    """The detector alone, on a real store: at most ``MAX_HELD_FINDINGS`` are held (more
    are dropped and counted), retried with backoff, and dropped after ``HELD_FINDING_TTL_S``."""
    from controller.db.migrate import upgrade
    from controller.services.commands import CommandService
    from controller.services.detection import jobs as detection_jobs
    from controller.services.incidents import IncidentService
    from controller.state import ClusterState
    from controller.store import Store
    from controller.writer import GroupCommitWriter
    from trainguard.wire import JobRecords, RankEvent

    upgrade(db_url)
    store = Store(make_engine(db_url))
    state = ClusterState()
    incidents = IncidentService(state, store)
    writer = GroupCommitWriter(store, state.row_for, flush_interval_s=0.0, max_rows=100)
    detector = detection_jobs.JobDetector(
        state, incidents, CommandService(state, writer, expire_after_s=60.0)
    )
    limit = detection_jobs.MAX_HELD_FINDINGS
    for j in range(limit + 4):  # one crash in each of that many jobs: one finding each
        crash = RankEvent(job=f"j{j}", rank=0, kind="exited", exit_code=1, time_unix_s=1.0)
        detector.trackers.observe("n1", JobRecords(rank_events=[crash]), 0.0)

    async def scenario() -> None:
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        await detector.tick(0.0)
        assert detector.held_counts == {"held": limit, "recorded": 0, "dropped": 4}
        assert detector.waiting == sum(len(q) for q in detector.held.values()) == limit
        tried = incidents.write_failures["open"]
        await detector.tick(0.5)  # before the first backoff (1 s) ends: nothing is tried
        assert incidents.write_failures["open"] == tried
        await detector.tick(1.0)  # every held one tried once more
        assert incidents.write_failures["open"] == tried + limit
        await detector.tick(2.0)  # the next try waits 2 s
        assert incidents.write_failures["open"] == tried + limit
        ctl_db_outage.disarm()
        await detector.tick(3.0)
        assert detector.held == {} and detector.held_counts["recorded"] == limit
        assert detector.waiting == 0
        assert len(state.incidents) == limit

        # Given up once it has failed for longer than the TTL.
        crash = RankEvent(job="late", rank=0, kind="exited", exit_code=1, time_unix_s=1.0)
        detector.trackers.observe("n1", JobRecords(rank_events=[crash]), 10.0)
        ctl_db_outage.arm(r"^\s*INSERT INTO incidents")
        await detector.tick(10.0)
        assert detector.waiting == sum(len(q) for q in detector.held.values()) == 1
        await detector.tick(11.0 + detection_jobs.HELD_FINDING_TTL_S)
        ctl_db_outage.disarm()
        assert detector.held == {} and detector.held_counts["dropped"] == 5
        assert detector.waiting == 0
        await detector.tick(12.0 + detection_jobs.HELD_FINDING_TTL_S)
        assert len(state.incidents) == limit  # dropped is dropped

    try:
        asyncio.run(scenario())
    finally:
        store.close()


# The operator's isolation and its action row: test_ctl_isolation_writes.py (one transaction).
