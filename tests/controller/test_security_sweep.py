"""Acceptance sweep of the controller's security, as a hostile reviewer tests it: which
credential reaches which route (streams and probes included), what a duplicated, oversized
or non-ASCII ``Authorization`` header gets, and that no secret (API tokens, per-node agent
tokens, credentials inside configured URLs) reaches a log line, an audit row, an API
answer, the OpenAPI document or the metrics. The door's body checks are in
test_ctl_security.py; per-node tokens, rotation and revocation in test_ctl_agent_identity.py.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import pytest

from tests import http_calls

#: The live controllers here run on SQLite (nothing here differs by database).
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _raw(port: int, head: bytes) -> tuple[int, bytes]:
    """Status and whole answer to ``head`` sent on a raw socket (its body never sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while True:  # the refusals close the connection; a 200 says how long its body is
            chunk = sock.recv(65536)
            data += chunk
            head_end = data.find(b"\r\n\r\n")
            if not chunk or (head_end >= 0 and _complete(data, head_end + 4)):
                break
    return int(data.split(b" ", 2)[1]), data


def _complete(data: bytes, body_at: int) -> bool:
    for line in data[:body_at].lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(data) - body_at >= int(line.split(b":")[1])
    return False


def _bearer(token: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {token}")


@SQLITE
def test_roles_on_streams_probes_and_credentials(live_controller: Any) -> None:
    """Viewer reads, operator acts, agent only reports: also on the SSE stream and the
    credential routes; probes and /metrics answer without a token (Prometheus scrapes)."""
    live = live_controller
    with http_calls.client(base_url=live.url, timeout=10) as c:
        for path in ("/api/v1/stream", "/api/v1/whoami", "/api/v1/agent-credentials/n1"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=live.headers("agent")).status_code == 403, path
        with c.stream("GET", "/api/v1/stream", headers=live.headers("viewer")) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
        creds = "/api/v1/agent-credentials/n1"
        for method, role in (("GET", "viewer"), ("POST", "viewer"), ("DELETE", "agent")):
            assert c.request(method, creds, headers=live.headers(role)).status_code == 403
        for path in ("/healthz", "/metrics"):
            assert c.get(path).status_code == 200, path


@SQLITE
def test_no_cors_headers_for_any_origin(live_controller: Any) -> None:
    live = live_controller
    origin = {"Origin": "https://evil.example"}
    with http_calls.client(base_url=live.url, timeout=10) as c:
        preflight = c.options(
            "/api/v1/nodes",
            headers={
                **origin,
                "Access-Control-Request-Method": "GET",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        got = c.get("/api/v1/nodes", headers={**origin, **live.headers("viewer")})
    for r in (preflight, got):
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers
    assert got.headers["cache-control"] == "no-store"


@SQLITE
@pytest.mark.parametrize(
    "order", ["unknown-then-valid", "valid-then-unknown", "agent-then-operator"]
)
def test_duplicated_authorization_header_is_refused_before_the_body(
    live_controller: Any, order: str
) -> None:
    """Two ``Authorization`` headers are ambiguous (RFC 6750: 400): the door checked the last
    and the routes the first, so the body of a request whose first token was unknown was
    read and parsed before its 401."""
    live = live_controller
    unknown = "not-a-known-token-0123456789"
    first, second = {
        "unknown-then-valid": (unknown, live.operator_token),
        "valid-then-unknown": (live.operator_token, unknown),
        "agent-then-operator": (live.agent_token, live.operator_token),
    }[order]
    for method, path in (("POST", "/api/v1/nodes/n1/isolate"), ("GET", "/api/v1/nodes")):
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {first}\r\n"
            f"Authorization: Bearer {second}\r\nContent-Type: application/json\r\n"
            + (f"Content-Length: {100 << 20}\r\n" if method == "POST" else "")
            + "\r\n"
        ).encode()
        status, response = _raw(live.port, head)
        assert status == 400, response
        assert b"more than once" in response
        assert first.encode() not in response and second.encode() not in response


@SQLITE
@pytest.mark.parametrize(
    "header",
    [
        b"Bearer " + b"A" * 60_000,  # oversized
        "Bearer s3cr3t-\u00e9\u00e9\u00e9-0123456789".encode(),  # UTF-8, read as Latin-1
        b"Bearer \xff\xfe\x00garbage",
        b"Bearer",
        b"Basic dXNlcjpwYXNz",
    ],
)
def test_odd_authorization_headers_are_4xx_never_5xx(live_controller: Any, header: bytes) -> None:
    head = b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: " + header + b"\r\n\r\n"
    status, response = _raw(live_controller.port, head)
    assert status in (400, 401, 431), response[:300]
    assert header[7:] not in response or len(header) <= 7


@SQLITE
def test_a_valid_token_with_a_unicode_lookalike_is_refused(live_controller: Any) -> None:
    """No normalization: a token with one letter swapped for a look-alike (Cyrillic small a)
    or a full-width copy of the scheme does not authenticate."""
    token = live_controller.viewer_token
    twisted = token.replace("e", "\u0435", 1)
    for header in (f"Bearer {twisted}", f"\uff22earer {token}"):
        head = b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: "
        status, _ = _raw(live_controller.port, head + header.encode() + b"\r\n\r\n")
        assert status == 401


@SQLITE
def test_no_secret_in_logs_answers_audit_openapi_or_metrics(
    controller_factory: Any, caplog: pytest.LogCaptureFixture, ctl_report: Any
) -> None:
    """Every credential the controller knows, used, refused, issued and revoked: none of
    them in a log record, an answer, an action row, the OpenAPI document or /metrics."""
    live = controller_factory(allow_shared_agent_tokens=False)
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    with http_calls.client(base_url=live.url, timeout=10) as c:
        op = live.headers("operator")
        issued = c.post("/api/v1/agent-credentials/n1", headers=op)
        assert issued.status_code == 201
        node_token = issued.json()["token"]
        assert issued.headers["cache-control"] == "no-store"
        node = {"Authorization": f"Bearer {node_token}"}
        calls = [
            c.post("/api/v1/reports", json=ctl_report("n1", 1), headers=node),
            c.post("/api/v1/reports", json=ctl_report("n2", 1), headers=node),  # 403
            c.post("/api/v1/reports", json=ctl_report("n1", 2), headers=live.headers("agent")),
            c.get("/api/v1/nodes", headers=node),  # 403
            c.get("/api/v1/nodes", headers={"Authorization": f"Bearer {node_token}x"}),  # 401
            c.get("/api/v1/whoami", headers=live.headers("viewer")),
            c.delete("/api/v1/agent-credentials/n1", headers=op),
            c.post("/api/v1/reports", json=ctl_report("n1", 3), headers=node),  # revoked: 401
            c.get("/api/v1/agent-credentials/n1", headers=op),
            c.get("/api/v1/actions", headers=op),
            c.get("/api/v1/status", headers=op),
            c.get("/openapi.json"),
            c.get("/metrics"),
        ]
    assert [r.status_code for r in calls[:5]] == [200, 403, 403, 403, 401]
    assert calls[7].status_code == 401
    seen += [r.text for r in calls]
    seen += [str(dict(r.headers)) for r in calls]
    seen += [r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records]
    secrets = (node_token, live.agent_token, live.viewer_token, live.operator_token)
    for text in seen:
        for secret in secrets:
            assert secret not in text, text[:300]
    assert any(a["kind"] == "revoke_agent_tokens" for a in calls[9].json()["data"])


@SQLITE
def test_credentials_in_the_prometheus_url_are_not_shown(
    controller_factory: Any, caplog: pytest.LogCaptureFixture, ctl_report: Any
) -> None:
    """``prometheus_url`` may carry basic-auth credentials (httpx sends them): a Prometheus
    that does not answer was described with the whole URL in the viewer's ``fallback`` and
    in the log."""
    live = controller_factory(prometheus_url="http://alice:s3cretpw@127.0.0.1:1/?key=k3y")
    caplog.set_level(logging.WARNING)
    live.report(ctl_report("n1", 1))
    found = live.read("/api/v1/nodes/n1/history")
    assert found["source"] == "database"
    assert "127.0.0.1:1" in found["fallback"], found["fallback"]
    logged = " ".join(r.getMessage() + str(getattr(r, "fields", "")) for r in caplog.records)
    assert "127.0.0.1:1" in logged
    for secret in ("s3cretpw", "k3y"):
        assert secret not in found["fallback"] and secret not in logged


def test_credentials_in_the_webhook_url_stay_out_of_action_rows() -> None:
    """The ``webhook`` step wrote ``remediation_webhook_url`` whole into the action row
    (``params.url`` and the outcome), which every viewer reads (``GET /api/v1/actions``)."""
    import asyncio
    from types import SimpleNamespace

    from controller.services.remediation.steps.webhook import WebhookStep
    from controller.services.webhook import Webhook

    rows: list[tuple[Any, ...]] = []

    class Recorder:
        async def record(self, *args: Any) -> int:
            rows.append(args)
            return len(rows)

        async def finish(self, *args: Any) -> None:
            rows.append(args)

    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    hook = Webhook(
        "https://bot:s3cretpw@hooks.example/x?token=k3y",
        b"secret",
        retries=0,
        transport=transport,
    )
    ctx: Any = SimpleNamespace(recorder=Recorder(), webhook=hook, actuator=None)
    for dry_run in (True, False):
        rem: Any = SimpleNamespace(
            id=1, job="gpt", node="n1", steps=["webhook"], approved_by=None, dry_run=dry_run
        )
        _, outcome = asyncio.run(WebhookStep().run(ctx, rem, None, None))
        assert "hooks.example" in outcome
    assert rows and "hooks.example" in repr(rows)
    for secret in ("s3cretpw", "k3y"):
        assert secret not in repr(rows)


@pytest.mark.parametrize(
    "server",
    [
        "http://alice:s3cretpw@127.0.0.1:1/?token=k3y",  # unreachable
        "ftp://alice:s3cretpw@127.0.0.1:1/",  # not http(s)
        "http://alice:s3cretpw@127.0.0.1:1:2/",  # no port
    ],
)
def test_cli_errors_do_not_print_the_server_urls_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    """``--server`` may carry basic-auth credentials for a proxy in front of the
    controller: the error line named the URL whole (a CI log keeps it)."""
    from trainguard.cli.app import run

    monkeypatch.setenv("TRAINGUARD_TOKEN", "viewer-token-0123456789")
    code = run(["--server", server, "nodes"], prog_name="trainguard")
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1, err
    assert "alice:***@127.0.0.1:1" in err, err
    assert "s3cretpw" not in err and "k3y" not in err


def test_dev_tokens_file_is_private_even_over_a_leftover(tmp_path: Any) -> None:
    """The temporary file a crashed start left behind (or any file at its name) kept its
    own mode: ``O_CREAT``'s 0600 applies only to a file it creates, so the dev tokens were
    written world-readable."""
    import os
    import stat

    from controller.settings import generate_dev_tokens

    path = tmp_path / "dev-tokens.yaml"
    leftover = path.with_suffix(".tmp")
    leftover.write_text("old\n")
    leftover.chmod(0o644)
    tokens = generate_dev_tokens(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert all(t.token and t.token in path.read_text() for t in tokens)


@SQLITE
def test_anonymous_reads_never_reach_credentials_or_writes(
    controller_factory: Any, ctl_report: Any
) -> None:
    live = controller_factory(allow_anonymous_read=True)
    with http_calls.client(base_url=live.url, timeout=10) as c:
        assert c.get("/api/v1/nodes").status_code == 200
        assert c.get("/api/v1/whoami").json() == {"name": "anonymous", "role": None}
        for method, path in (
            ("GET", "/api/v1/agent-credentials/n1"),
            ("POST", "/api/v1/agent-credentials/n1"),
            ("POST", "/api/v1/nodes/n1/isolate"),
            ("POST", "/api/v1/reports"),
        ):
            assert c.request(method, path, json={}).status_code == 401, (method, path)
        # A header that carries no token is not the absent header anonymous reads allow.
        assert c.get("/api/v1/nodes", headers={"Authorization": ""}).status_code == 401


def test_db_upgrade_line_hides_a_password_given_in_the_query_string() -> None:
    """libpq takes ``?password=`` as well as the user info; ``trainguard db upgrade``
    printed the former whole (a migration Job's log keeps it)."""
    from trainguard.urls import shown_url

    shown = shown_url("postgresql+psycopg://tg@db:5432/tg?password=s3cret&sslmode=require")
    assert "s3cret" not in shown and shown.startswith("postgresql+psycopg://tg@db:5432/tg?")
    assert shown_url("postgresql://tg:s3cret@db/tg") == "postgresql://tg:***@db/tg"
