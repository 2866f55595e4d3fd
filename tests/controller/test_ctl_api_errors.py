"""Bad requests get one-line 4xx answers that say what is wrong; never a 5xx."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from tests import http_calls
from trainguard import wire

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def client(live_controller):
    with http_calls.client(base_url=live_controller.url, timeout=10) as c:
        yield c


def test_malformed_report_names_the_field(live_controller, client, ctl_report) -> None:
    body = ctl_report("node-a", 0)
    body["samples"][0]["gpus"][0]["power_w"] = -5
    r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("agent"))
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail == ("body.samples.0.gpus.0.power_w: Input should be greater than or equal to 0")
    assert "\n" not in detail
    assert r.json()["errors"][0]["loc"] == ["body", "samples", 0, "gpus", 0, "power_w"]


def test_missing_field_and_bad_json(live_controller, client, ctl_report) -> None:
    body = ctl_report("node-a", 0)
    del body["agent_instance"]
    r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("agent"))
    assert r.status_code == 422 and r.json()["detail"] == "body.agent_instance: Field required"

    r = client.post(
        "/api/v1/reports",
        content=b"{not json",
        headers={**live_controller.headers("agent"), "Content-Type": "application/json"},
    )
    assert r.status_code in (400, 422)
    assert r.json()["detail"].startswith("body: Invalid JSON")


def test_oversized_report_is_413(live_controller, client) -> None:
    big = b'{"pad": "' + b"x" * (wire.MAX_REPORT_BYTES + 10) + b'"}'
    r = client.post("/api/v1/reports", content=big, headers=live_controller.headers("agent"))
    assert r.status_code == 413 and "larger than" in r.json()["detail"]
    assert "send smaller reports" in r.json()["detail"]  # the agent's hint, on its route only

    def chunks():  # no Content-Length: the cap counts streamed bytes
        for _ in range(5):
            yield b"x" * (wire.MAX_REPORT_BYTES // 4)

    r = client.post("/api/v1/reports", content=chunks(), headers=live_controller.headers("agent"))
    assert r.status_code == 413


def test_authentication_and_roles(live_controller, client, ctl_report) -> None:
    body = ctl_report("node-a", 0)
    assert client.post("/api/v1/reports", json=body).status_code == 401
    r = client.post("/api/v1/reports", json=body, headers={"Authorization": "Bearer nope" * 3})
    assert r.status_code == 401 and "unknown token" in r.json()["detail"]
    r = client.post("/api/v1/reports", json=body, headers={"Authorization": "Basic abc"})
    assert r.status_code == 401
    r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("viewer"))
    assert r.status_code == 403 and "role 'viewer'" in r.json()["detail"]
    # Agents may only post reports.
    assert client.get("/api/v1/nodes", headers=live_controller.headers("agent")).status_code == 403
    assert client.get("/api/v1/nodes").status_code == 401
    # Viewers read, but cannot queue commands.
    assert client.get("/api/v1/nodes", headers=live_controller.headers("viewer")).status_code == 200
    r = client.post(
        "/api/v1/nodes/node-a/commands",
        json={"kind": "reset_power_limit", "gpu_index": 0},
        headers=live_controller.headers("viewer"),
    )
    assert r.status_code == 403
    # Probes need no token.
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    ("authorization", "detail"),
    [
        ("", "missing bearer token (Authorization: Bearer <token>)"),
        ("Bearer", "Authorization header must be 'Bearer <token>'"),
        ("Basic Zm9vOmJhcg==", "Authorization header must be 'Bearer <token>'"),
        ("Token abcdefghijklmnopq", "Authorization header must be 'Bearer <token>'"),
    ],
)
@pytest.mark.parametrize("anonymous", [False, True])
def test_a_present_header_without_a_bearer_token_is_401(
    controller_factory: Any, authorization: str, detail: str, anonymous: bool
) -> None:
    # An empty header is a header: 401 even where anonymous reads are allowed (which are
    # for requests without one), never the 500 it once was.
    live = controller_factory(allow_anonymous_read=anonymous)
    with http_calls.client(base_url=live.url, timeout=10) as c:
        for method, path in (("GET", "/api/v1/nodes"), ("POST", "/api/v1/reports")):
            r = c.request(method, path, headers={"Authorization": authorization})
            assert r.status_code == 401, (method, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json() == {"detail": detail}
    # Trailing blanks (which httpx will not send) are the server's to strip: no token either.
    raw = f"{authorization} ".encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(
            b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: " + raw + b"\r\n\r\n"
        )
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 401 "), head


def test_anonymous_read_when_allowed(controller_factory) -> None:
    live = controller_factory(allow_anonymous_read=True)
    assert http_calls.get(f"{live.url}/api/v1/nodes").status_code == 200
    r = http_calls.post(
        f"{live.url}/api/v1/nodes/x/commands", json={"kind": "unlock_clocks", "gpu_index": 0}
    )
    assert r.status_code == 401


def test_not_found_and_query_validation(live_controller, client) -> None:
    viewer = live_controller.headers("viewer")
    r = client.get("/api/v1/nodes/ghost", headers=viewer)
    assert r.status_code == 404 and r.json() == {"detail": "node 'ghost' not found"}
    assert client.get("/api/v1/jobs/ghost", headers=viewer).status_code == 404
    assert client.get("/api/v1/incidents/999", headers=viewer).status_code == 404
    r = client.get("/api/v1/nodes", params={"limit": 0}, headers=viewer)
    assert r.status_code == 422 and r.json()["detail"].startswith("query.limit:")
    r = client.get("/api/v1/incidents", params={"state": "weird"}, headers=viewer)
    assert r.status_code == 422 and r.json()["detail"].startswith("query.state:")
    assert client.get("/api/v1/nope", headers=viewer).status_code == 404


def test_token_values_never_logged(controller_factory, caplog, ctl_report) -> None:
    live = controller_factory(log_level="debug")
    with caplog.at_level("DEBUG"):
        http_calls.post(
            f"{live.url}/api/v1/reports",
            json=ctl_report("node-z", 0),
            headers=live.headers("agent"),
        )
        http_calls.get(
            f"{live.url}/api/v1/nodes", headers={"Authorization": "Bearer wrong-token-xyz"}
        )
    text = "\n".join(r.getMessage() + json.dumps(getattr(r, "fields", {})) for r in caplog.records)
    for token in (live.agent_token, live.viewer_token, live.operator_token, "wrong-token-xyz"):
        assert token not in text


def test_values_the_database_cannot_store_are_422(live_controller, client, ctl_report) -> None:
    body = ctl_report("node-a", 0)
    body["samples"][1]["gpus"][2]["memory_used_bytes"] = 10**30
    r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("agent"))
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "body.samples.1.gpus.2.memory_used_bytes: "
        "Input should be less than or equal to 9223372036854775807"
    )
    raw = json.dumps(ctl_report("node-a", 0)).replace(
        '"temperature_c": 60.0', '"temperature_c": 1e999'
    )
    r = client.post(
        "/api/v1/reports",
        content=raw,
        headers={**live_controller.headers("agent"), "Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "body.samples.0.gpus.0.temperature_c: Input should be a finite number (and 4 more errors)"
    )
    body = ctl_report("node-a", 0)
    body["node"]["hostname"] = "bad\x00host"
    r = client.post("/api/v1/reports", json=body, headers=live_controller.headers("agent"))
    assert r.status_code == 422 and r.json()["detail"].startswith("body.node.hostname:")
