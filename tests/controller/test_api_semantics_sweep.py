"""API semantics a schema fuzzer cannot judge: who may call what, what a filter matches,
where a page ends, what an operator action done twice or out of order does, how hostile
text is stored and logged, and that a path parameter never reaches another resource.

The fuzz (test_ctl_schema_fuzz.py) checks "no 5xx, answers match the schema"; each test
here checks an answer's *meaning*, on one in-process controller (SQLite).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controller.logs import JsonFormatter
from tests import http_calls
from tests.waiting import wait_for

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

API = "/api/v1"
#: Values for the path parameters of the write routes: real objects where the controller
#: has them, so a 403 is about the role and not a 404 in disguise.
PATH_VALUES = {"name": "node-a", "node": "node-a", "id": "1", "link": "node-a/nic0/p0->tor-a"}


@pytest.fixture
def client(live_controller: Any) -> Iterator[httpx.Client]:
    with http_calls.client(base_url=live_controller.url, timeout=10) as c:
        yield c


def _actions(client: httpx.Client, live: Any) -> list[dict[str, Any]]:
    r = client.get(f"{API}/actions", params={"limit": 5000}, headers=live.headers("viewer"))
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _report_xid(live: Any, node: str, seq: int, report: Any, code: int = 45) -> None:
    """A report whose GPU 0 saw XID ``code`` (45: an application's, which opens an
    ``application_xid`` incident and starts no remediation)."""
    body = report(node, seq, gpu_overrides={0: {"xid_events": [{"code": code}]}})
    for sample in body["samples"]:
        for event in sample["gpus"][0]["xid_events"]:
            event["time_unix_s"] = sample["time_unix_s"]
    live.report(body)


def _open_incident(client: httpx.Client, live: Any, node: str) -> int:
    def found() -> int | None:
        r = client.get(
            f"{API}/incidents", params={"node": node, "state": "open"}, headers=live.headers()
        )
        data = r.json()["data"]
        return data[0]["id"] if data else None

    return int(wait_for(found))


# ------------------------------------------------------------------------------ roles


def test_every_write_route_refuses_viewers_and_agents_and_changes_nothing(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    """Walks the OpenAPI document, so a write route added later is covered without being
    listed here: a viewer or agent token on any write route is 403, an operator's on the
    agents' report route is 403 (docs/security.md, threat model), and nothing is written."""
    live = live_controller
    live.report(ctl_report("node-a", 0))
    before = client.get(f"{API}/nodes/node-a", headers=live.headers("viewer")).json()
    spec = live.app.openapi()
    writes = [
        (method.upper(), path, op["operationId"])
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        if method in ("post", "put", "patch", "delete")
    ]
    assert len(writes) >= 19, writes  # the routes listed in docs/security.md, at least
    for method, path, operation in writes:
        url = re.sub(r"\{(\w+)(?::path)?\}", lambda m: PATH_VALUES[m.group(1)], path)
        refused = ("viewer", "operator") if operation == "post_report" else ("viewer", "agent")
        for role in refused:
            r = client.request(method, url, json={"reason": "x"}, headers=live.headers(role))
            assert r.status_code == 403, (role, method, url, r.text)
            assert f"role {role!r}" in r.json()["detail"], r.text
        r = client.request(method, url, json={"reason": "x"})
        assert r.status_code == 401, (method, url, r.text)
    assert _actions(client, live) == []
    after = client.get(f"{API}/nodes/node-a", headers=live.headers("viewer")).json()
    assert after["isolated_reason"] is None and before["isolated_reason"] is None
    commands = client.get(f"{API}/commands", headers=live.headers("viewer")).json()
    assert commands["count"] == 0


def test_a_shared_agent_token_reports_only_when_allowed(
    controller_factory: Any, ctl_report: Any
) -> None:
    """docs/security.md: a shared ``agent`` token is 403 unless ``allow_shared_agent_tokens``
    (off by default), and the node it named does not appear."""
    live = controller_factory(allow_shared_agent_tokens=False)
    r = http_calls.post(
        f"{live.url}{API}/reports", json=ctl_report("node-a", 0), headers=live.headers("agent")
    )
    assert r.status_code == 403, r.text
    assert live.read(f"{API}/nodes")["count"] == 0


# ----------------------------------------------------------------- filters and pages


def test_filters_match_exactly_not_as_patterns(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    """A filter is a value, not a LIKE pattern: ``node=node%`` or ``node=node_a`` matches no
    ``node-a``; ``kind=%`` matches no kind."""
    live, viewer = live_controller, live_controller.headers("viewer")
    for seq, node in enumerate(("node-a", "node-b")):
        _report_xid(live, node, seq, ctl_report)
    incident = _open_incident(client, live, "node-a")
    _open_incident(client, live, "node-b")
    for node in ("node-a", "node-b"):
        r = client.post(
            f"{API}/nodes/{node}/commands",
            json={"kind": "reset_power_limit", "gpu_index": 0},
            headers=live.headers("operator"),
        )
        assert r.status_code == 201, r.text

    def listed(path: str, **params: Any) -> list[Any]:
        r = client.get(f"{API}{path}", params=params, headers=viewer)
        assert r.status_code == 200, r.text
        return [x["node"] for x in r.json()["data"]]

    assert set(listed("/incidents", node="node-a")) == {"node-a"}
    assert listed("/commands", node="node-a") == ["node-a"]
    for pattern in ("node%", "node_a", "node-_", "%", "_", "node-a%", "node\\-a", "NODE-A"):
        assert listed("/incidents", node=pattern) == [], pattern
        assert listed("/commands", node=pattern) == [], pattern
    assert listed("/incidents", kind="%") == [] and listed("/incidents", kind="application%") == []
    assert listed("/incidents", job="%") == []
    got = client.get(f"{API}/incidents/{incident}", headers=viewer).json()
    assert got["node"] == "node-a"


LISTS = ("/nodes", "/jobs", "/incidents", "/actions", "/commands")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": -1}, "limit"),
        ({"limit": 5001}, "limit"),
        ({"limit": 10**9}, "limit"),
        ({"limit": 10**30}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"limit": "1.5"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"offset": -1}, "offset"),
        ({"offset": 10**9 + 1}, "offset"),
        ({"offset": "x"}, "offset"),
    ],
)
def test_page_bounds_outside_the_documented_range_are_422(
    live_controller: Any, client: httpx.Client, params: dict[str, Any], field: str
) -> None:
    """``limit`` is 1..5000 and ``offset`` 0..10**9 (controller/api/deps.py ``Page``): any
    other value is a one-line 422 naming the parameter, never a clamp to a full table."""
    for path in LISTS:
        r = client.get(f"{API}{path}", params=params, headers=live_controller.headers("viewer"))
        assert r.status_code == 422, (path, params, r.text)
        detail = r.json()["detail"]
        assert detail.startswith(f"query.{field}:") and "\n" not in detail, detail


def test_pages_end_where_the_data_does(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    """An offset past the end is an empty page with the true ``count``; the largest page
    and a page of one hold what they say."""
    live, viewer = live_controller, live_controller.headers("viewer")
    for seq, node in enumerate(("node-a", "node-b", "node-c")):
        live.report(ctl_report(node, seq))
    for path in LISTS:
        whole = client.get(f"{API}{path}", params={"limit": 5000}, headers=viewer).json()
        for offset in (whole["count"], whole["count"] + 1, 10**9):
            r = client.get(f"{API}{path}", params={"offset": offset}, headers=viewer)
            assert r.status_code == 200, r.text
            assert r.json() == {"data": [], "count": whole["count"]}, (path, offset)
    nodes = client.get(f"{API}/nodes", params={"limit": 1, "offset": 1}, headers=viewer).json()
    assert nodes["count"] == 3 and [n["name"] for n in nodes["data"]] == ["node-b"]
    for path, params in (
        ("/nodes/node-a/history", {"points": 9}),
        ("/nodes/node-a/history", {"window_s": 0}),
        ("/nodes/node-a", {"history_s": -1}),
        ("/jobs/j/steps", {"last": 0}),
        ("/jobs/j/checkpoints", {"limit": 5001}),
    ):
        r = client.get(f"{API}{path}", params=params, headers=viewer)
        assert r.status_code == 422, (path, params, r.text)


# -------------------------------------------------------- operator actions, twice or out of order


def test_isolation_twice_and_release_out_of_order_are_409_and_act_once(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    live, operator = live_controller, live_controller.headers("operator")
    live.report(ctl_report("node-a", 0))

    def post(path: str, body: Any = None) -> httpx.Response:
        return client.post(f"{API}{path}", json=body, headers=operator)

    r = post("/nodes/node-a/release", {"reason": "not isolated yet"})
    assert r.status_code == 409 and "already not isolated" in r.json()["detail"], r.text
    r = post("/nodes/node-a/isolate", {"reason": "bad nic"})
    assert r.status_code == 200 and r.json()["isolated"] is True, r.text
    r = post("/nodes/node-a/isolate", {"reason": "again"})
    assert r.status_code == 409 and "already isolated" in r.json()["detail"], r.text
    reason = client.get(f"{API}/nodes/node-a", headers=operator).json()["isolated_reason"]
    assert reason is not None and "again" not in reason  # the first isolation's reason holds
    assert post("/nodes/node-a/release").status_code == 200
    r = post("/nodes/node-a/release")
    assert r.status_code == 409 and "already not isolated" in r.json()["detail"], r.text
    for path in ("/nodes/ghost/isolate", "/nodes/ghost/release"):
        r = post(path, {"reason": "x"})
        assert r.status_code == 404 and "ghost" in r.json()["detail"], r.text
    rows = [(a["kind"], a["status"]) for a in _actions(client, live)]
    assert sorted(rows) == [("isolate_node", "succeeded"), ("release_node", "succeeded")]
    # A row that records what was done is not a dry run: approving it is refused.
    isolated = next(a for a in _actions(client, live) if a["kind"] == "isolate_node")
    r = post(f"/actions/{isolated['id']}/approve")
    assert r.status_code == 409 and "not a dry run" in r.json()["detail"], r.text
    assert client.get(f"{API}/nodes/node-a", headers=operator).json()["isolated_reason"] is None


def test_incidents_resolved_twice_or_acked_after_resolving_are_409(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    live, operator = live_controller, live_controller.headers("operator")
    _report_xid(live, "node-a", 0, ctl_report)
    incident = _open_incident(client, live, "node-a")

    def post(path: str) -> httpx.Response:
        return client.post(f"{API}{path}", headers=operator)

    # Acknowledging is an audit record, each one its own row (who said they are on it).
    for _ in range(2):
        r = post(f"/incidents/{incident}/ack")
        assert r.status_code == 200 and r.json()["incident"] == incident, r.text
    r = post(f"/incidents/{incident}/resolve")
    assert r.status_code == 200 and r.json()["state"] == "resolved", r.text
    r = post(f"/incidents/{incident}/resolve")
    assert r.status_code == 409 and "already resolved" in r.json()["detail"], r.text
    r = post(f"/incidents/{incident}/ack")
    assert r.status_code == 409 and "resolved already" in r.json()["detail"], r.text
    for path in ("/incidents/999999/resolve", "/incidents/999999/ack"):
        assert post(path).status_code == 404
    acks = [a for a in _actions(client, live) if a["kind"] == "ack_incident"]
    assert len(acks) == 2 and {a["target"] for a in acks} == {f"incident:{incident}"}
    resolved = client.get(f"{API}/incidents/{incident}", headers=operator).json()
    assert resolved["state"] == "resolved"


def test_restart_of_an_unknown_job_is_404(live_controller: Any, client: httpx.Client) -> None:
    r = client.post(
        f"{API}/jobs/ghost/restart", json={"reason": "x"}, headers=live_controller.headers()
    )
    assert r.status_code == 404 and r.json() == {"detail": "job 'ghost' not found"}
    assert _actions(client, live_controller) == []


# -------------------------------------------------------------------------- hostile text

FORGED = '\n{"level": "error", "logger": "controller.auth", "msg": "operator token leaked"}\n'
HOSTILE = "bad nic" + FORGED + "\r\x1b[2J\u202edesrever\u200b\u2028end\x7f"


@pytest.fixture
def json_log() -> Iterator[list[str]]:
    """The controller's log lines as its JSON formatter writes them (stderr in production)."""
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(JsonFormatter().format(record))

    handler = Capture(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("controller", "uvicorn.error", "uvicorn.access")]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield lines
    for logger, level in zip(loggers, saved, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_hostile_reasons_are_stored_verbatim_and_cannot_forge_a_log_line(
    live_controller: Any, client: httpx.Client, ctl_report: Any, json_log: list[str]
) -> None:
    live, operator = live_controller, live_controller.headers("operator")
    live.report(ctl_report("node-a", 0))
    r = client.post(f"{API}/nodes/node-a/isolate", json={"reason": HOSTILE}, headers=operator)
    assert r.status_code == 200, r.text
    node = client.get(f"{API}/nodes/node-a", headers=operator).json()
    assert node["isolated_reason"] == HOSTILE  # stored as given: the reader escapes, not us
    [row] = [a for a in _actions(client, live) if a["kind"] == "isolate_node"]
    assert row["params"]["reason"] == HOSTILE
    # The reason is not logged by an isolation by hand; a request path is (the access log):
    # one with an encoded line break and a forged JSON object is still one line.
    forged = "/api/v1/nodes/x%0A%7B%22level%22:%22error%22%7D%0D%E2%80%AE"
    r = client.get(forged, headers=operator)
    assert r.status_code == 404, r.text
    assert any("uvicorn.access" in line and "/api/v1/nodes/x" in line for line in json_log)
    # Every log line the controller wrote meanwhile is one JSON object on one line.
    for line in json_log:
        assert "\n" not in line and "\r" not in line and "\u2028" not in line, line
        assert isinstance(json.loads(line), dict)
    assert not any(json.loads(line).get("level") == "error" for line in json_log), json_log


@pytest.mark.parametrize(
    ("reason", "why"),
    [
        ("x" * 100_000, "at most 500 characters"),
        ("", "at least 1 character"),
        ("nul\x00byte", "must not contain NUL"),
        (7, "should be a valid string"),
    ],
)
def test_reasons_too_long_empty_or_with_nul_are_422(
    live_controller: Any, client: httpx.Client, ctl_report: Any, reason: Any, why: str
) -> None:
    live, operator = live_controller, live_controller.headers("operator")
    live.report(ctl_report("node-a", 0))
    for path in ("/nodes/node-a/isolate", "/jobs/ghost/restart"):
        r = client.post(f"{API}{path}", json={"reason": reason}, headers=operator)
        assert r.status_code == 422, (path, r.text)
        detail = r.json()["detail"]
        assert detail.startswith("body.reason:") and why in detail and len(detail) < 300, detail
    assert client.get(f"{API}/nodes/node-a", headers=operator).json()["isolated_reason"] is None
    assert _actions(client, live) == []


# ----------------------------------------------------------------------- path parameters


@pytest.mark.parametrize(
    "raw",
    [
        "/api/v1/nodes/node-a%2F..%2Fnode-b",
        "/api/v1/nodes/..%2Fnode-b",
        "/api/v1/nodes/node-b%00",
        "/api/v1/nodes/%2e%2e",
        "/api/v1/nodes/node-b%20",
        "/api/v1/nodes/NODE-B",
        "/api/v1/jobs/..%2Fnodes%2Fnode-b",
        "/api/v1/nodes/" + "n" * 254,
        "/api/v1/incidents/0",
        "/api/v1/incidents/-1",
        "/api/v1/incidents/1.0",
        "/api/v1/incidents/abc",
        "/api/v1/incidents/" + str(2**63),
    ],
)
def test_path_parameters_never_reach_another_resource(
    live_controller: Any, ctl_report: Any, raw: str
) -> None:
    """A path parameter is a name, not a path: encoded slashes, dot segments, NULs, case and
    blanks find no other node (404 or 422, with a one-line detail), and nothing is a 5xx."""
    live = live_controller
    live.report(ctl_report("node-b", 0))
    # httpx would normalize the path (dot segments): send the target as written.
    with http_calls.client(base_url=live.url, timeout=10) as c:
        request = c.build_request("GET", live.url, headers=live.headers("viewer"))
        request.url = request.url.copy_with(raw_path=raw.encode())
        r = c.send(request)
    assert r.status_code in (404, 422), (raw, r.status_code, r.text)
    body = r.json()
    assert set(body) <= {"detail", "errors"} and "\n" not in body["detail"], body
    assert "gpus" not in body and "node-b'" not in body["detail"], body


def test_write_routes_with_a_slash_in_the_name_touch_no_other_node(
    live_controller: Any, client: httpx.Client, ctl_report: Any
) -> None:
    live, operator = live_controller, live_controller.headers("operator")
    live.report(ctl_report("node-b", 0))
    for name in ("node-a%2F..%2Fnode-b", "..%2Fnode-b", "node-b%2F"):
        r = client.post(f"{API}/nodes/{name}/isolate", json={"reason": "x"}, headers=operator)
        assert r.status_code in (404, 405, 422), (name, r.text)
    r = client.post(f"{API}/nodes/{'n' * 254}/isolate", json={"reason": "x"}, headers=operator)
    assert r.status_code == 422 and r.json()["detail"].startswith("path.name:"), r.text
    assert client.get(f"{API}/nodes/node-b", headers=operator).json()["isolated_reason"] is None
    assert _actions(client, live) == []
