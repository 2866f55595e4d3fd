"""The dashboard, served by a live controller and read by a real headless Chromium.

HTTP tests check what the controller serves (routes, content types, CSP, the built bundle
has no HTML-parsing sink and loads nothing from elsewhere). Browser tests run against one
shared cluster (tests/web/conftest.py: a controller, three simulated agents in-process, a
4-rank job feeding step summaries through the agents' sockets) and look at every page.
Screenshots go to $TRAINGUARD_TEST_OUT (default /tmp/trainguard-dashboard).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls
from tests.web.conftest import BROWSER_TIMEOUT_MS, HOSTILE
from tests.web.conftest import open_page as open_signed_in

pytestmark = pytest.mark.slow

STATIC = resources.files("web").joinpath("static")
ASSETS = {"": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
OUT = Path(os.environ.get("TRAINGUARD_TEST_OUT", "/tmp/trainguard-dashboard"))


def shot(page: Any, name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=False)


def api(cluster: Any, path: str, role: str = "viewer") -> Any:
    live = cluster.live
    r = http_calls.get(f"{live.url}/api/v1{path}", headers=live.headers(role), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def open_page(context: Any, cluster: Any, token: str, route: str = "#/fleet") -> Any:
    return open_signed_in(context, cluster.live, token, route)


# ----------------------------------------------------------------------------- HTTP


def test_root_redirects_and_assets_have_types_and_a_strict_csp(cluster) -> None:
    url = cluster.live.url
    for path in ("/", "/ui"):
        r = http_calls.get(url + path, follow_redirects=False, timeout=10)
        assert r.status_code == 307 and r.headers["location"] == "/ui/", path
    for name, media_type in ASSETS.items():
        r = http_calls.get(f"{url}/ui/{name}", timeout=10)
        assert r.status_code == 200, name
        assert r.headers["content-type"].split(";")[0] == media_type, name
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "connect-src 'self'" in csp and "unsafe" not in csp
        assert r.content == STATIC.joinpath(name or "index.html").read_bytes()
    assert http_calls.get(f"{url}/ui/nope.js", timeout=10).status_code == 404
    assert http_calls.get(f"{url}/api/v1/nodes", timeout=10).status_code == 401
    paths = http_calls.get(f"{url}/openapi.json", timeout=10).json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/ui")]


def test_the_bundle_loads_nothing_from_elsewhere_and_parses_no_html() -> None:
    html = STATIC.joinpath("index.html").read_text()
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert sorted(r for r in refs if not r.startswith("#")) == ["app.css", "app.js"]
    assert "<script>" not in html and "style=" not in html  # nothing inline for the CSP
    script = STATIC.joinpath("app.js").read_text()
    css = STATIC.joinpath("app.css").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    assert "new Function" not in script and "localStorage" not in script
    # No URL to fetch at run time: no absolute http(s)/ws URL, no CSS import or url().
    assert not re.search(r"""["'`](?:https?|wss?):""", script)
    assert not re.search(r"@import|url\(", css)
    assert "uPlot" in script  # the charting library is bundled, not fetched


def test_stream_refuses_without_a_read_role(cluster) -> None:
    url = f"{cluster.live.url}/api/v1/stream"
    assert http_calls.get(url, timeout=5).status_code == 401
    assert http_calls.get(url, headers=cluster.live.headers("agent"), timeout=5).status_code == 403


def test_stream_starts_with_hello_and_a_full_fleet_snapshot(cluster) -> None:
    live = cluster.live
    events: list[tuple[str, Any]] = []
    with http_calls.stream(
        "GET", f"{live.url}/api/v1/stream", headers=live.headers("viewer"), timeout=10
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                if len(events) == 2:
                    break
    (hello, first), (nodes, snapshot) = events
    assert hello == "hello" and abs(first["t"] - time.time()) < 5
    assert nodes == "nodes" and snapshot["full"] is True
    assert sorted(n["n"] for n in snapshot["data"]) == ["sim-a", "sim-b", "sim-c"]
    assert all(n["sim"] and n["g"] == 4 for n in snapshot["data"])


def test_anonymous_read_has_no_role_and_no_actions(controller_factory) -> None:
    live = controller_factory(allow_anonymous_read=True)
    r = http_calls.get(f"{live.url}/api/v1/whoami", timeout=10)
    assert r.json() == {"name": "anonymous", "role": None}
    r = http_calls.post(f"{live.url}/api/v1/incidents/1/resolve", timeout=10)
    assert r.status_code == 401


def test_viewer_cannot_act_through_the_api(cluster) -> None:
    live = cluster.live
    incidents = api(cluster, "/incidents?state=open")
    for path, body in (
        ("/nodes/sim-b/isolate", {"reason": "viewer tries"}),
        ("/nodes/sim-b/release", {"reason": "viewer tries"}),
        ("/incidents/1/resolve", {}),
        ("/incidents/1/ack", {}),
        ("/nodes/sim-a/commands", {"kind": "job_checkpoint", "job": "llm-pretrain"}),
        ("/jobs/llm-pretrain/restart", {"reason": "viewer tries"}),
        ("/actions/1/approve", {}),
    ):
        r = http_calls.post(
            f"{live.url}/api/v1{path}", json=body, headers=live.headers("viewer"), timeout=10
        )
        assert r.status_code == 403, (path, r.text)
    assert api(cluster, "/incidents?state=open")["count"] == incidents["count"]
    assert api(cluster, "/nodes/sim-b")["isolated_reason"] is None


# ----------------------------------------------------------------------------- browser


ENDED_JOB = "yesterday-run"


def store_ended_job(live: Any, name: str) -> None:
    """Rows of a two-rank job that checkpointed and exited, as a controller leaves them
    once the job left its memory (``job_retention_s``, a day): never in this one's."""
    from controller.db.models import Checkpoint, Job, Rank
    from controller.db.session import make_engine

    then = time.time() - 2 * 86_400
    engine = make_engine(live.settings.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                Job.__table__.insert(),
                [{"name": name, "world_size": 2, "last_step": 40, "first_seen_unix_s": then,
                  "last_seen_unix_s": then + 600}],
            )  # fmt: skip
            conn.execute(
                Rank.__table__.insert(),
                [{"job_name": name, "rank": r, "node_name": "sim-c", "gpu_index": r,
                  "state": "exited", "exit_code": 0, "last_step": 40,
                  "last_seen_unix_s": then + 600} for r in range(2)],
            )  # fmt: skip
            conn.execute(
                Checkpoint.__table__.insert(),
                [{"job_name": name, "rank": 0, "node_name": "sim-c", "step": 40,
                  "kind": "committed", "time_unix_s": then + 590}],
            )  # fmt: skip
    finally:
        engine.dispose()


def test_every_page_renders_real_data_and_a_viewer_sees_no_actions(cluster, dash_browser) -> None:
    from playwright.sync_api import expect

    # A refused token says so and asks again.
    page = open_page(dash_browser, cluster, "not-a-real-token-0123456789")
    expect(page.locator("#banner")).to_contain_text("Token refused (HTTP 401)")
    expect(page.locator("#login")).to_be_visible()
    page.fill("#token", cluster.live.viewer_token)
    page.click("#login button[type=submit]")
    expect(page.locator("#whoami")).to_have_text("test-viewer (viewer)")
    expect(page.locator("#live")).to_have_attribute("data-state", "live")

    # Fleet: one cell per node, with the state as glyph/text and the simulated mark.
    cells = page.locator("#fleet .cell")
    expect(cells).to_have_count(3)
    cell_a = page.locator('#fleet .cell[data-node="sim-a"]')
    expect(cell_a).to_have_attribute("data-state", "healthy")
    expect(cell_a).to_have_class(re.compile(r"\bsim\b"))
    expect(cell_a).to_have_attribute("aria-label", re.compile(r"^sim-a: healthy · simulated"))
    # The hostile label is text in the cell's label, never markup.
    cell_c = page.locator('#fleet .cell[data-node="sim-c"]')
    expect(cell_c).to_have_attribute("aria-label", re.compile(re.escape(f"team={HOSTILE}")))
    page.fill("#fleet-label", "rack=r2")
    expect(page.locator("#fleet .cell:not([hidden])")).to_have_count(1)
    expect(page.locator("#fleet .cell:not([hidden])")).to_have_attribute("data-node", "sim-c")
    assert "label=rack%3Dr2" in page.url  # the filter is part of the URL
    page.fill("#fleet-label", "")
    expect(page.locator("#fleet .cell:not([hidden])")).to_have_count(3)
    page.select_option("#fleet-job", "llm-pretrain")
    expect(page.locator("#fleet .cell:not([hidden])")).to_have_count(2)
    page.select_option("#fleet-job", "")
    shot(page, "fleet")

    # Keyboard: the grid is one tab stop; arrows move, Enter opens the node.
    cell_a.focus()
    page.keyboard.press("ArrowRight")
    expect(page.locator('#fleet .cell[data-node="sim-b"]')).to_be_focused()
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"#/node/sim-b$"))
    expect(page.locator("table.gpus tbody tr")).to_have_count(4)
    # Seven metrics, one uPlot chart each, with the node's four GPUs as series.
    expect(page.locator(".charts .uplot")).to_have_count(7)
    expect(page.locator(".charts figure").first).to_contain_text("GPU 3")
    assert page.locator("button.act").count() == 0
    shot(page, "node")
    page.go_back()
    expect(page).to_have_url(re.compile(r"#/fleet"))
    expect(cells).to_have_count(3)

    page.goto(f"{cluster.live.url}/ui/#/job/llm-pretrain")
    expect(page.locator(".heatmap canvas")).to_have_count(1)
    expect(page.locator(".hm-ranks li")).to_have_count(4)
    expect(page.locator("table.ranks tbody tr")).to_have_count(4)
    expect(page.locator('table.ranks tr[data-rank="2"]')).to_contain_text("dp 2 · (4 peers)")
    expect(page.locator(".job .uplot")).to_have_count(2)  # step time, goodput
    expect(page.locator("table.checkpoints tbody")).to_contain_text("committed", timeout=20_000)
    assert page.locator("button.act").count() == 0
    shot(page, "job")

    # A job that left the controller's memory (job_retention_s) keeps only its rows: the
    # list shows it when asked to, its page as ended, with its stored ranks and checkpoints.
    store_ended_job(cluster.live, ENDED_JOB)
    page.goto(f"{cluster.live.url}/ui/#/jobs")
    expect(page.locator("table.jobs tbody tr")).to_have_count(1)  # memory's: llm-pretrain
    page.check("#jobs-history")
    expect(page).to_have_url(re.compile(r"#/jobs\?history=1$"))
    ended = page.locator(f'table.jobs tr[data-job="{ENDED_JOB}"]')
    expect(ended).to_have_attribute("data-source", "history")
    expect(ended).to_contain_text("ended")
    expect(page.locator("table.jobs tbody tr")).to_have_count(2)
    ended.locator("a").click()
    expect(page.locator(".page.job h2").first).to_have_text(f"Jobs / {ENDED_JOB} ended")
    expect(page.locator(".page.job")).to_contain_text("Ended: the controller no longer holds")
    expect(page.locator("table.ranks tbody tr")).to_have_count(2)
    expect(page.locator("table.checkpoints tbody")).to_contain_text("committed")
    shot(page, "job-ended")

    page.click('nav a[data-nav="incidents"]')
    expect(page.locator(".page.incidents h2")).to_contain_text("Incidents")
    page.click('nav a[data-nav="power"]')
    for domain in ("dc", "row-1", "sim-a", "sim-b", "sim-c"):
        expect(page.locator(f'table.domains tr[data-domain="{domain}"]')).to_contain_text(domain)
    expect(page.locator('table.domains tr[data-domain="sim-a"]')).to_contain_text("4000 W")
    row1 = page.locator('table.domains tr[data-domain="row-1"] td.oversub')
    expect(row1).to_have_text("1.09\u00d7 (+1 server beyond peak)")
    expect(page.locator(".page.power .uplot")).to_have_count(2)  # dc, row-1 draw over time
    shot(page, "power")
    page.click('nav a[data-nav="network"]')
    expect(page.locator(".page.network")).to_contain_text("Plan ")
    expect(page.locator("table.links tbody tr").first).to_have_attribute(
        "data-link", re.compile(".")
    )
    shot(page, "network")
    page.go_back()
    expect(page.locator(".page.power")).to_be_visible()
    # A malformed %-escape in the address is a page not found, shown as such.
    page.goto(f"{cluster.live.url}/ui/#/node/%E0")
    expect(page.locator("#banner")).to_have_text(
        "No such page: #/node/%E0 has a malformed %-escape."
    )
    expect(page.locator("#view")).to_have_class(re.compile(r"\bstale\b"))

    # Dark theme on request, light by default here.
    page.click('nav a[data-nav="fleet"]')
    page.click("#theme")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    expect(cells).to_have_count(3)
    shot(page, "fleet-dark")
    page.click("#theme")

    assert page.locator("main img, main b").count() == 0
    assert page.evaluate("window.__pwned") is None
    token = cluster.live.viewer_token
    assert page.evaluate("sessionStorage.getItem('trainguard.token')") == token
    assert token not in page.url
    assert not page.errors, page.errors
    page.close()


def test_a_fault_on_an_agent_reaches_the_fleet_cell_and_the_job_heatmap_live(
    cluster, dash_browser
) -> None:
    from playwright.sync_api import expect

    page = open_page(dash_browser, cluster, cluster.live.viewer_token)
    cell_b = page.locator('#fleet .cell[data-node="sim-b"]')
    expect(cell_b).to_have_attribute("data-state", re.compile("healthy|degraded"))
    page.evaluate("window.__same_page = 1")  # gone if the page reloads

    cluster.inject("sim-b", "kind=xid,code=79,gpu=1,at=0")
    expect(cell_b).to_have_attribute("data-state", "unhealthy", timeout=BROWSER_TIMEOUT_MS)
    expect(cell_b).to_have_text("✕")
    expect(cell_b).to_have_attribute("aria-label", re.compile("XID 79"))
    assert page.evaluate("window.__same_page") == 1

    # Rank 3 becomes a straggler: the heatmap shows it slowest, live, then marks it.
    page.goto(f"{cluster.live.url}/ui/#/job/llm-pretrain")
    cluster.slow[3] = 0.25
    try:
        expect(page.locator(".hm-summary")).to_contain_text(
            re.compile(r"Slowest ranks \(worst step / median\): rank 3 "), timeout=20_000
        )
        try:
            expect(page.locator(".hm-ranks li.marked")).to_contain_text("r3", timeout=40_000)
        except AssertionError as exc:
            # What the server holds at that moment, so a failure says which side lags.
            held = [
                (i["id"], i["kind"], i["state"], i.get("ranks"))
                for i in api(cluster, "/incidents?job=llm-pretrain&limit=100")["data"]
            ]
            raise AssertionError(f"rank 3 not marked; the job's incidents: {held}") from exc
    finally:
        cluster.slow.clear()
    shot(page, "job-straggler")
    assert not page.errors, page.errors
    page.close()


def test_operator_actions_confirm_their_effect_and_change_server_state(
    cluster, dash_browser
) -> None:
    from playwright.sync_api import expect

    page = open_page(dash_browser, cluster, cluster.live.operator_token, "#/node/sim-c")
    expect(page.locator("#whoami")).to_have_text("test-operator (operator)")
    button = page.locator('button[data-action="isolate"]')
    # Cancel changes nothing.
    button.click()
    expect(page.locator("#confirm")).to_be_visible()
    expect(page.locator("#confirm-effect")).to_contain_text("Isolate sim-c: cordon it")
    page.click("#confirm-cancel")
    expect(page.locator("#confirm")).to_be_hidden()
    assert api(cluster, "/nodes/sim-c")["isolated_reason"] is None

    button.click()
    page.fill("#confirm-reason", HOSTILE)
    shot(page, "confirm")
    page.click("#confirm-ok")
    expect(page.locator("dl.facts dd.isolated")).to_have_text(f"yes: {HOSTILE}")
    assert page.locator("main img, main b").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert api(cluster, "/nodes/sim-c")["isolated_reason"] == HOSTILE
    page.click('nav a[data-nav="fleet"]')
    expect(page.locator('#fleet .cell[data-node="sim-c"]')).to_have_attribute(
        "data-state", "cordoned"
    )

    # Return it to service from its page.
    page.goto(f"{cluster.live.url}/ui/#/node/sim-c")
    page.click('button[data-action="release"]')
    page.click("#confirm-ok")
    expect(page.locator('button[data-action="isolate"]')).to_be_visible()
    assert api(cluster, "/nodes/sim-c")["isolated_reason"] is None

    # Checkpoint now: one job_checkpoint command per node of the job.
    page.goto(f"{cluster.live.url}/ui/#/job/llm-pretrain")
    before = {c["id"] for c in api(cluster, "/commands")["data"]}
    page.click('button[data-action="checkpoint"]')
    expect(page.locator("#confirm-effect")).to_contain_text("save a checkpoint")
    page.click("#confirm-ok")
    expect(page.locator("#banner")).to_contain_text("Checkpoint now: done.")
    # Remediation of the faults injected earlier in this module may ask for its own
    # protective checkpoint at any moment; its commands carry the action's request number.
    new = [
        c
        for c in api(cluster, "/commands")["data"]
        if c["id"] not in before and not c["params"].get("request")
    ]
    assert sorted((c["node"], c["kind"], c["params"]["job"]) for c in new) == [
        ("sim-a", "job_checkpoint", "llm-pretrain"),
        ("sim-b", "job_checkpoint", "llm-pretrain"),
    ]

    # Resolve an open incident from its page.
    open_ = api(cluster, "/incidents?state=open")["data"]
    assert open_, "the fault test left an open incident"
    incident = open_[-1]["id"]
    page.goto(f"{cluster.live.url}/ui/#/incident/{incident}")
    expect(page.locator(".page.incident")).to_contain_text("Evidence")
    # The remediation the incident triggered is listed with its outcome.
    expect(page.locator(".page.incident table.actions")).to_contain_text(f"incident:{incident}")
    shot(page, "incident")
    page.click('button[data-action="ack"]')
    expect(page.locator("#confirm-effect")).to_contain_text("it stays open")
    page.click("#confirm-ok")
    expect(page.locator("dd.acked")).to_contain_text("acknowledged by test-operator")
    expect(page.locator('button[data-action="ack"]')).to_have_count(0)
    acked = [a for a in api(cluster, "/actions")["data"] if a["kind"] == "ack_incident"]
    assert [a["target"] for a in acked] == [f"incident:{incident}"]
    assert api(cluster, f"/incidents/{incident}")["state"] == "open"
    page.click('button[data-action="resolve"]')
    expect(page.locator("#confirm-effect")).to_contain_text(f"Mark incident #{incident}")
    page.click("#confirm-ok")
    expect(page.locator(".page.incident h2").first).to_contain_text("resolved")
    assert api(cluster, f"/incidents/{incident}")["state"] == "resolved"
    live = cluster.live
    for target, status in ((incident, 409), (10**9, 404)):
        r = http_calls.post(
            f"{live.url}/api/v1/incidents/{target}/ack", headers=live.headers(), timeout=10
        )
        assert r.status_code == status, r.text
    assert not page.errors, page.errors
    page.close()


def _put_policy(cluster: Any, policy: dict[str, Any]) -> None:
    live = cluster.live
    r = http_calls.put(
        f"{live.url}/api/v1/remediation/policy", json=policy, headers=live.headers(), timeout=10
    )
    assert r.status_code == 200, r.text


def test_an_operator_restarts_a_job_and_approves_dry_runs_a_viewer_cannot(
    cluster, dash_browser
) -> None:
    """Restart and approve go through the remediation engine's steps to the actuator: the
    recording one (tests/remediation/recording.py), the engine's boundary kept with state,
    since the cluster's job is threads that no real actuator launched."""
    from playwright.sync_api import expect

    from controller.actuators.base import JobPolicy, Placement
    from tests.remediation.recording import RecordingActuator
    from tests.remediation.test_engine import open_incident
    from tests.waiting import wait_for

    live = cluster.live
    engine = live.controller.remediation
    actuator = RecordingActuator(
        placements={
            "llm-pretrain": Placement(
                job="llm-pretrain", nodes=("sim-a", "sim-b"), ranks_per_node=2
            )
        },
        pools={"llm-pretrain": ["sim-a", "sim-b", "sim-c"]},
    )
    engine.actuator = actuator
    page = open_page(dash_browser, cluster, live.operator_token, "#/job/llm-pretrain")
    try:
        page.click('button[data-action="restart"]')
        effect = page.locator("#confirm-effect")
        expect(effect).to_contain_text("Restart llm-pretrain now: stop all 4 ranks")
        expect(effect).to_contain_text("Progress since that checkpoint is lost")
        page.fill("#confirm-reason", "loss spike")
        shot(page, "confirm-restart")
        page.click("#confirm-ok")
        expect(page.locator("#banner")).to_contain_text("Restart job: done.")
        [placement] = actuator.restarts()
        assert placement.job == "llm-pretrain" and placement.generation == 1
        [row] = [
            a
            for a in api(cluster, "/actions?limit=500")["data"]
            if a["kind"] == "restart_job" and a["trigger"] == "operator:test-operator"
        ]
        assert row["status"] == "succeeded" and row["target"] == "llm-pretrain"
        expect(page.locator(f'table.actions tr[data-action-id="{row["id"]}"]')).to_contain_text(
            "operator:test-operator"
        )

        # The policy in dry run: a fatal XID under rank 0 is only recorded. (The circuit
        # breaker opened: on three nodes, the default 25 % allows no isolation at all.)
        _put_policy(cluster, {"dry_run": True, "guards": {"max_isolated_fraction": 1.0}})
        wait_for(lambda: engine.jobs["llm-pretrain"].awaiting_resume is None, timeout_s=20)
        cluster.inject("sim-a", "kind=xid,code=79,gpu=2,at=0")

        def dry_runs() -> dict[str, dict[str, Any]]:
            rows = api(cluster, "/actions?limit=500")["data"]
            found = {
                a["kind"]: a
                for a in rows
                if a["status"] == "dry_run"
                and (a["kind"], a["target"])
                in (("isolate_node", "sim-a"), ("restart_job", "llm-pretrain"))
            }
            return found if len(found) == 2 else {}

        found = wait_for(dry_runs, timeout_s=30)
        isolate, restart = found["isolate_node"], found["restart_job"]
        assert api(cluster, "/nodes/sim-a")["isolated_reason"] is None
        assert len(actuator.restarts()) == 1

        # A viewer sees the dry runs and no button to approve them.
        viewer = open_page(dash_browser, cluster, live.viewer_token, "#/node/sim-a")
        expect(viewer.locator(f'tr[data-action-id="{isolate["id"]}"]')).to_contain_text("dry_run")
        assert viewer.locator('button[data-action="approve"]').count() == 0
        viewer.close()

        page.goto(f"{live.url}/ui/#/node/sim-a")
        iso_row = page.locator(f'table.actions tr[data-action-id="{isolate["id"]}"]')
        iso_row.locator('button[data-action="approve"]').click()
        expect(effect).to_contain_text(f"Carry out dry run #{isolate['id']} now: isolate sim-a")
        page.click("#confirm-ok")
        expect(iso_row).to_contain_text("approved")
        expect(iso_row.locator('button[data-action="approve"]')).to_have_count(0)
        reason = f"approved dry run #{isolate['id']} by test-operator"
        expect(page.locator("dl.facts dd.isolated")).to_have_text(f"yes: {reason}")
        assert api(cluster, "/nodes/sim-a")["isolated_reason"] == reason

        page.goto(f"{live.url}/ui/#/job/llm-pretrain")
        rs_row = page.locator(f'table.actions tr[data-action-id="{restart["id"]}"]')
        rs_row.locator('button[data-action="approve"]').click()
        expect(effect).to_contain_text("restart job llm-pretrain through the actuator")
        page.click("#confirm-ok")
        expect(rs_row).to_contain_text("approved")
        assert len(actuator.restarts()) == 2
        assert "sim-a" not in actuator.restarts()[-1].nodes  # the approved isolation holds
        approvals = [
            a for a in api(cluster, "/actions?limit=500")["data"] if a["kind"] == "approve_action"
        ]
        assert sorted(a["target"] for a in approvals) == sorted(
            [f"action:{isolate['id']}", f"action:{restart['id']}"]
        )
        shot(page, "approved")

        # A job's own policy asks for a dry run: its plan waits as one ``approval`` row,
        # approved as a whole (RemediationEngine.approve), with the controller's policy live.
        _put_policy(cluster, {"guards": {"max_isolated_fraction": 1.0}})
        wait_for(lambda: engine.jobs["llm-pretrain"].awaiting_resume is None, timeout_s=20)
        actuator.policies["llm-pretrain"] = JobPolicy(dry_run=True, steps=("restart",))
        open_incident(live, "gpu_fault", job="llm-pretrain", severity="critical")

        def plans() -> list[dict[str, Any]]:
            rows = api(cluster, "/actions?limit=500")["data"]
            return [a for a in rows if a["kind"] == "approval"]

        plan = wait_for(plans)[0]
        page.goto(f"{live.url}/ui/#/job/llm-pretrain")
        plan_row = page.locator(f'table.actions tr[data-action-id="{plan["id"]}"]')
        plan_row.locator('button[data-action="approve"]').click()
        expect(effect).to_contain_text(
            f"Run the plan job llm-pretrain's own policy held back (#{plan['id']}) now"
        )
        page.click("#confirm-ok")
        expect(plan_row).to_have_attribute("data-status", "succeeded")
        expect(plan_row).to_contain_text("approved by test-operator")
        wait_for(lambda: len(actuator.restarts()) == 3)
        assert not page.errors, page.errors
    finally:
        page.close()
        engine.actuator = None
        _put_policy(cluster, {})
        http_calls.post(
            f"{live.url}/api/v1/nodes/sim-a/release", headers=live.headers(), timeout=10
        )


def test_a_stalled_stream_is_shown_as_behind_and_catches_up(cluster, dash_browser) -> None:
    """The controller's event loop stalls for 12 s (what a long pause or an overloaded
    controller does to the stream); an operator's isolation waits in its queue meanwhile."""
    from playwright.sync_api import expect

    live = cluster.live
    page = open_page(dash_browser, cluster, live.viewer_token)
    live_state = page.locator("#live")
    cell = page.locator('#fleet .cell[data-node="sim-c"]')
    expect(live_state).to_have_attribute("data-state", "live")
    expect(cell).not_to_have_attribute("data-state", "cordoned")
    loop = live._server.servers[0].get_loop()
    loop.call_soon_threadsafe(time.sleep, 12.0)
    answers: list[int] = []

    def isolate() -> None:
        r = http_calls.post(
            f"{live.url}/api/v1/nodes/sim-c/isolate",
            json={"reason": "while the stream stalled"},
            headers=live.headers(),
            timeout=60,
        )
        answers.append(r.status_code)

    worker = threading.Thread(target=isolate)
    worker.start()
    try:
        expect(live_state).to_have_attribute("data-state", "behind", timeout=BROWSER_TIMEOUT_MS)
        expect(page.locator("#banner")).to_contain_text("Live updates are behind (no update for")
        expect(cell).not_to_have_attribute("data-state", "cordoned")
        shot(page, "behind")
        expect(live_state).to_have_attribute("data-state", "live", timeout=20_000)
        expect(page.locator("#banner")).to_be_hidden()
        expect(cell).to_have_attribute("data-state", "cordoned")  # caught up, no reload
        worker.join(timeout=30)
        assert answers == [200]

        # A burst larger than a subscriber's queue within one feed tick: the server drops
        # what the tab could not take and sends a snapshot saying how much; the page says
        # so, shows the snapshot, then is live again.
        from controller.services.dashboard import QUEUE_MAX

        feed = live.controller.services.dashboard
        burst = b'event: changed\ndata: {"t":%f,"topics":["jobs"]}\n\n' % time.time()
        loop.call_soon_threadsafe(lambda: [feed._broadcast(burst) for _ in range(QUEUE_MAX + 6)])
        expect(live_state).to_contain_text(
            re.compile(r"behind \(\d+ updates missed; caught up from a snapshot\)")
        )
        expect(page.locator("#banner")).to_contain_text("updates missed")
        expect(live_state).to_have_attribute("data-state", "live", timeout=BROWSER_TIMEOUT_MS)
        expect(cell).to_have_attribute("data-state", "cordoned")
        assert not page.errors, page.errors
    finally:
        worker.join(timeout=30)
        page.close()
        http_calls.post(
            f"{live.url}/api/v1/nodes/sim-c/release", headers=live.headers(), timeout=10
        )


def test_the_controller_going_away_is_shown_and_recovered_from(cluster, dash_browser) -> None:
    from playwright.sync_api import expect

    page = open_page(dash_browser, cluster, cluster.live.viewer_token)
    live_state = page.locator("#live")
    expect(live_state).to_have_attribute("data-state", "live")
    expect(page.locator("#fleet .cell")).to_have_count(3)
    cluster.live.stop()
    expect(live_state).to_have_attribute("data-state", "disconnected", timeout=20_000)
    expect(page.locator("#banner")).to_contain_text("Controller unreachable")
    expect(page.locator("#view")).to_have_class(re.compile(r"\bstale\b"))
    expect(page.locator("#fleet .cell")).to_have_count(3)  # the last data stays
    shot(page, "disconnected")
    cluster.live.start()  # same port, same database
    expect(live_state).to_have_attribute("data-state", "live", timeout=30_000)
    expect(page.locator("#banner")).to_be_hidden()
    expect(page.locator("#view")).not_to_have_class(re.compile(r"\bstale\b"))
    expect(page.locator("#fleet .cell")).to_have_count(3)
    page.close()


def test_a_hangs_flight_recorder_divergence_is_drawn_per_rank(cluster, dash_browser) -> None:
    """The evidence shape comes from the controller's own code (``flight_evidence`` over a
    real ``Divergence``); only this one incident's reply is substituted in the browser, since
    a live hang with Flight Recorder dumps needs a real stuck torch job (tests/collectives)."""
    from playwright.sync_api import expect

    from controller.schemas import INCIDENT_ADAPTER
    from controller.services.flight_evidence import flight_evidence
    from controller.state import IncidentState
    from trainguard import wire

    def entry(seq: int) -> dict[str, Any]:
        return {
            "record_id": seq, "pg_id": 0, "process_group": ["0", "default"],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "nccl:all_reduce", "input_sizes": [[4]], "output_sizes": [[4]],
            "state": "scheduled", "time_created_ns": seq,
        }  # fmt: skip

    def dump(rank: int, last: int) -> Any:
        return wire.FlightRecorderDump.model_validate(
            {
                "job": "llm-pretrain", "rank": rank, "enabled": True,
                "entries": [entry(s) for s in range(1, last + 1)],
                "pg_ranks": {"0": [0, 1, 2, 3]},
            }
        )  # fmt: skip

    hang = IncidentState(
        id=9999, kind="hang", severity="critical", state="open", summary="rank 3 never entered",
        dedupe_key="x", opened_unix_s=time.time(), updated_unix_s=time.time(),
        job="llm-pretrain", ranks=[3],
    )  # fmt: skip
    evidence = flight_evidence(
        {0: dump(0, 5), 1: dump(1, 5), 2: dump(2, 5), 3: dump(3, 4)}, {0, 1, 2, 3}, hang
    )
    assert evidence.divergences, evidence
    # The reply as the API serializes it: the hang's typed evidence (its stuck call, as the
    # detector wrote it) with the Flight Recorder's reading merged in, through the schema.
    stuck = {
        "group": "0",
        "seq": 5,
        "op": "all_reduce",
        "elapsed_s": 30.0,
        "entered": [0, 1, 2],
        "passed": [],
        "absent": [3],
        "confidence": 1.0,
    }
    fields = {
        "id": 9999, "kind": "hang", "severity": "critical", "state": "open",
        "summary": "rank 3 never entered", "node": None, "gpu_index": None,
        "job": "llm-pretrain", "ranks": [3],
        "evidence": {**stuck, "flight_recorder": evidence.as_json()},
        "count": 1, "opened_unix_s": time.time(), "updated_unix_s": time.time(),
        "resolved_unix_s": None,
    }  # fmt: skip
    body = INCIDENT_ADAPTER.dump_python(INCIDENT_ADAPTER.validate_python(fields), mode="json")
    assert "evidence_error" not in body  # the typed hang shape, not the untyped one
    # A stored row whose evidence fits no model: served untyped with the reason.
    damaged = {**fields, "id": 9998, "evidence": {"seq": "x"}, "evidence_error": "seq: bad"}
    odd = INCIDENT_ADAPTER.dump_python(INCIDENT_ADAPTER.validate_python(damaged), mode="json")
    page = dash_browser.new_page()
    page.route("**/api/v1/incidents/9999", lambda route: route.fulfill(json=body))
    page.route("**/api/v1/incidents/9998", lambda route: route.fulfill(json=odd))
    page.goto(f"{cluster.live.url}/ui/#/incident/9999")
    page.fill("#token", cluster.live.viewer_token)
    page.click("#login button[type=submit]")
    figure = page.locator("figure.flight-recorder")
    expect(figure).to_contain_text("never entered it")
    expect(figure.locator(".fr-ranks li.fr-in")).to_have_count(3)
    expect(figure.locator(".fr-ranks li.fr-out")).to_have_count(1)
    expect(figure.locator(".fr-ranks li.fr-out")).to_have_attribute(
        "title", "rank 3: never entered"
    )
    expect(page.locator(".page.incident .evidence-error")).to_have_count(0)
    page.goto(f"{cluster.live.url}/ui/#/incident/9998")
    expect(page.locator(".page.incident .evidence-error")).to_contain_text("seq: bad")
    expect(page.locator(".page.incident")).to_contain_text("Evidence")
    page.close()
