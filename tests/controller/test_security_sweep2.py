"""Second security sweep of the API (tokens, roles, audit): issuing an agent token leaves an
audit row (revoking already did), an open event stream ends when its credential stops
being valid, every mutating route (listed from the app itself) refuses a read-only or
agent token, and tokens are taken only from the ``Authorization`` header: not from a query
string, not when absurdly long (refused before any TokenReview), with the scheme's case
free. What test_security_sweep.py and test_ctl_security.py cover is not repeated here.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from typing import Any

import httpx
import pytest
from fastapi.routing import iter_route_contexts

from tests import http_calls
from tests.actuators.fake_kube import FakeKube
from tests.controller.test_security_sweep import _raw

#: The live controllers here run on SQLite unless a test says otherwise.
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Hang guard only: how long a stream that should end may go on.
STREAM_GUARD_S = 30.0


def _actions(client: httpx.Client, kind: str) -> list[dict[str, Any]]:
    rows = client.get("/api/v1/actions", params={"limit": 5000}).json()["data"]
    return [a for a in rows if a["kind"] == kind]


def test_issuing_an_agent_token_is_audited_like_revoking(
    controller_factory: Any, ctl_db_outage: Any
) -> None:
    """Who issued a node's token, and when, was nowhere in the actions history (only the
    credential row's ``created_by``); now each issue is an ``issue_agent_token`` row shaped
    like ``revoke_agent_tokens``, finished ``failed`` when the database refused the token,
    and holding neither the token nor its digest."""
    live = controller_factory(allow_shared_agent_tokens=False)
    path = "/api/v1/agent-credentials/n1"
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as c:
        tokens = [c.post(path).json()["token"] for _ in range(2)]  # issue, then rotate
        ctl_db_outage.arm(r"^\s*INSERT INTO agent_credentials")
        refused = c.post(path)
        ctl_db_outage.disarm()
        assert refused.status_code == 503 and "token" not in refused.json()
        assert c.delete(path).status_code == 200
        issued = _actions(c, "issue_agent_token")
        (revoked,) = _actions(c, "revoke_agent_tokens")
        everything = c.get("/api/v1/actions", params={"limit": 5000}).text
    assert [a["status"] for a in sorted(issued, key=lambda a: a["id"])] == [
        "succeeded",
        "succeeded",
        "failed",
    ]
    for row in issued:
        assert row.keys() == revoked.keys()
        assert (row["target"], row["trigger"]) == (revoked["target"], revoked["trigger"])
        assert row["trigger"] == "operator:test-operator" and row["params"]["node"] == "n1"
        assert row["finished_unix_s"] is not None
    for token in tokens:
        assert token not in everything
        assert hashlib.sha256(token.encode()).hexdigest() not in everything


def _events(response: httpx.Response) -> Any:
    """The stream's event names, one by one (a hang guard ends a stream that never does)."""
    deadline = time.monotonic() + STREAM_GUARD_S
    for line in response.iter_lines():
        assert time.monotonic() < deadline, "the stream went on"
        if line.startswith("event: "):
            yield line.removeprefix("event: ")


@SQLITE
@pytest.mark.parametrize("ending", ["revoked", "expired"])
def test_an_open_stream_ends_when_its_credential_does(live_controller: Any, ending: str) -> None:
    """The role was checked once, when the stream opened: a viewer whose credential was
    revoked (or ran out) went on receiving every update for as long as it stayed connected.

    No credential the controller serves today both reads and can be revoked at run time
    (per-node and service-account tokens are agents); the stream asks the same lookups a
    new request does, so one kept elsewhere (``Authenticator.add_lookup``) stands in."""
    live = live_controller
    token = f"revocable-{secrets.token_hex(16)}"
    digest = hashlib.sha256(token.encode()).digest()
    valid_until = [float("inf")]

    def lookup(presented: bytes) -> Any:
        from controller.auth import Principal

        if presented == digest and time.time() < valid_until[0]:
            return Principal(name="revocable-viewer", role="viewer")
        return None

    live.controller.services.auth.add_lookup(lookup)
    mine = {"Authorization": f"Bearer {token}"}
    with (
        http_calls.client(base_url=live.url, timeout=STREAM_GUARD_S) as c,
        c.stream("GET", "/api/v1/stream", headers=live.headers("viewer")) as other,
        c.stream("GET", "/api/v1/stream", headers=mine) as r,
    ):
        assert (r.status_code, other.status_code) == (200, 200)
        events, others = _events(r), _events(other)
        assert next(events) == "hello" and next(others) == "hello"
        if ending == "revoked":
            valid_until[0] = float("-inf")
        else:
            valid_until[0] = time.time()
        for _ in events:  # ends, or the guard fails the test
            pass
        # The viewer whose token is still good keeps its stream (its next heartbeat comes).
        assert "ping" in others
        again = c.get("/api/v1/stream", headers=mine)
        assert again.status_code == 401 and token not in again.text


def _mutating_routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) of the API that is not a read, as the app routes them."""
    found = []
    for route in iter_route_contexts(app.routes):
        if route.path.startswith("/api/"):
            for method in sorted(set(route.methods or ()) & MUTATING):
                # Any value in the path: the role is refused before the path is judged.
                found.append((method, re.sub(r"\{[^}]+\}", "x1", route.path)))
    return found


@SQLITE
def test_every_mutating_route_refuses_readers_and_agents(controller_factory: Any) -> None:
    """A route added without ``require_operator`` (or with the wrong role) fails here: the
    list comes from the app's own routes, not from a list kept by hand."""
    live = controller_factory(allow_anonymous_read=True)
    routes = _mutating_routes(live.app)
    assert len(routes) >= 15 and ("POST", "/api/v1/reports") in routes, routes
    wrong = []
    with http_calls.client(base_url=live.url, timeout=10) as c:
        for method, path in routes:
            reporting = path == "/api/v1/reports"
            for role in ("viewer", "operator") if reporting else ("viewer", "agent"):
                for body in (None, {}):
                    r = c.request(method, path, json=body, headers=live.headers(role))
                    if r.status_code != 403:
                        wrong.append((method, path, role, body, r.status_code))
            anonymous = c.request(method, path, json={})
            if anonymous.status_code != 401:
                wrong.append((method, path, None, {}, anonymous.status_code))
    assert not wrong, wrong


@SQLITE
def test_tokens_only_from_the_authorization_header_in_any_case(live_controller: Any) -> None:
    """A token in the query string (RFC 6750's ``access_token``, or ``token``) is no
    credential, so no URL, access log or browser history ever needs to carry one; the
    scheme's case does not matter (RFC 7235), other schemes or separators are 401."""
    live = live_controller
    token = live.viewer_token
    with http_calls.client(base_url=live.url, timeout=10) as c:
        for name in ("access_token", "token", "authorization"):
            r = c.get("/api/v1/nodes", params={name: token})
            assert r.status_code == 401 and token not in r.text, name
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            assert c.get("/api/v1/nodes", headers={"Authorization": f"{scheme} {token}"}).is_success
        for value in (f"Bearer\t{token}", f"Bearer{token}", f"Token {token}", f"Bearer {token} x"):
            r = c.get("/api/v1/nodes", headers={"Authorization": value})
            assert r.status_code == 401 and token not in r.text, value


@SQLITE
def test_a_very_long_token_is_401_before_its_body_and_any_token_review(
    controller_factory: Any,
) -> None:
    """A bearer value longer than any credential (JWT-shaped: three dot-separated parts)
    was hashed and sent to the API server as a TokenReview, a cost an unauthenticated
    client chose; now it is 401 at the door, before the body is read."""
    from controller.auth import MAX_TOKEN_CHARS

    with FakeKube.running() as kube:
        live = controller_factory(
            allow_shared_agent_tokens=False, kube_token_review=True, kube_api_url=kube.url
        )
        unknown = http_calls.get(
            f"{live.url}/api/v1/nodes", headers={"Authorization": "Bearer h.unknown.sig"}
        )
        assert unknown.status_code == 401  # reviewed: the API server does not know it
        reviews = len([s for s in kube.served if s[1] == "tokenreviews"])
        assert reviews == 1
        for size in (MAX_TOKEN_CHARS + 1, 4 * MAX_TOKEN_CHARS):
            token = "h." + "x" * (size - 6) + ".sig"
            for request in (
                "GET /api/v1/nodes HTTP/1.1\r\n",
                # 100 MB announced, never sent: a 401 that waited for it would hang here.
                f"POST /api/v1/reports HTTP/1.1\r\nContent-Length: {100 << 20}\r\n",
            ):
                head = f"{request}Host: x\r\nAuthorization: Bearer {token}\r\n\r\n"
                status, response = _raw(live.port, head.encode())
                assert status == 401, (size, request, response[:300])
                assert token.encode() not in response
        assert len([s for s in kube.served if s[1] == "tokenreviews"]) == reviews
