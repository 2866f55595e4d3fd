"""Issue 14 at the door of a real controller (uvicorn on an ephemeral port): authenticate
before parsing, body caps also for chunked bodies, and an agent speaks only for its node
(per-node tokens with rotation, Kubernetes service-account tokens via TokenReview)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests import http_calls
from tests.actuators.fake_kube import FakeKube
from trainguard import wire

REPORTS = "/api/v1/reports"
SA = "system:serviceaccount:trainguard:trainguard-agent"


def _raw(port: int, head: bytes, body: bytes = b"", *, read_timeout_s: float = 5.0) -> bytes:
    """Send ``head`` (+ ``body``) on a raw socket and return what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout_s) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
class TestAuthenticateBeforeParsing:
    @pytest.fixture
    def client(self, live_controller: Any) -> Iterator[httpx.Client]:
        with http_calls.client(base_url=live_controller.url, timeout=10) as c:
            yield c

    @pytest.mark.parametrize("path", [REPORTS, "/api/v1/nodes/x/commands", "/api/v1/policy"])
    @pytest.mark.parametrize(
        "body",
        [b"{not json", b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000],
    )
    def test_no_token_is_401_whatever_the_body(
        self, client: httpx.Client, path: str, body: bytes
    ) -> None:
        for headers in ({}, {"Authorization": "Bearer not-a-known-token-123"}):
            r = client.post(path, content=body, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"

    def test_401_is_sent_before_the_body_is_read(self, live_controller: Any) -> None:
        # 100 MB announced, not one byte sent: an answer proves nobody waited for the body.
        for path in (REPORTS, "/api/v1/nodes/x/commands"):
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 << 20}\r\n\r\n"
            ).encode()
            started = time.monotonic()
            response = _raw(live_controller.port, head)
            assert _status(response) == 401, response
            assert time.monotonic() - started < 4

    def test_chunked_without_length_over_the_cap_is_413(self, live_controller: Any) -> None:
        # One chunk one byte over the cap, its closing CRLF never sent: the server must
        # count, answer 413 and stop reading (nothing is left unread, so no reset races it).
        size = wire.MAX_REPORT_BYTES + 1
        for role, path in (("agent", REPORTS), ("operator", "/api/v1/nodes/x/commands")):
            token = live_controller.headers(role)["Authorization"]
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {token}\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                f"{size:x}\r\n"
            ).encode()
            response = _raw(live_controller.port, head, b" " * size, read_timeout_s=20)
            assert _status(response) == 413, (path, response[:300])

    def test_chunked_without_token_is_401_not_413(self, client: httpx.Client) -> None:
        def endless() -> Iterator[bytes]:
            for _ in range(200):
                yield b"x" * 65536

        try:
            r = client.post(REPORTS, content=endless())
        except httpx.WriteError:
            pytest.fail("the server closed the connection without answering 401")
        assert r.status_code == 401

    def test_content_length_over_the_cap_is_413_with_a_token(self, live_controller: Any) -> None:
        agent = live_controller.headers("agent")["Authorization"]
        head = (
            f"POST {REPORTS} HTTP/1.1\r\nHost: x\r\nAuthorization: {agent}\r\n"
            f"Content-Length: {wire.MAX_REPORT_BYTES + 1}\r\n\r\n"
        ).encode()
        assert _status(_raw(live_controller.port, head)) == 413

    def test_valid_token_still_gets_parsed_errors(
        self, live_controller: Any, client: httpx.Client
    ) -> None:
        r = client.post(REPORTS, content=b"{not json", headers=live_controller.headers("agent"))
        assert r.status_code == 400


def _node_tokens(client: httpx.Client, operator: dict[str, str], node: str) -> dict[str, Any]:
    r = client.post(f"/api/v1/agent-credentials/{node}", headers=operator)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    assert body["node"] == node and body["token"].startswith("tgn_")
    return body


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _nodes(client: httpx.Client, viewer: dict[str, str]) -> set[str]:
    return {n["name"] for n in client.get("/api/v1/nodes", headers=viewer).json()["data"]}


def test_per_node_tokens_speak_only_for_their_node(controller_factory: Any, ctl_report) -> None:
    live = controller_factory(allow_shared_agent_tokens=False, agent_token_grace_s=3600)
    with http_calls.client(base_url=live.url, timeout=10) as client:
        viewer, operator = live.headers("viewer"), live.headers("operator")
        # Only operators issue tokens.
        assert client.post("/api/v1/agent-credentials/node-a", headers=viewer).status_code == 403
        first = _node_tokens(client, operator, "node-a")
        r = client.post(REPORTS, json=ctl_report("node-a", 0), headers=_bearer(first["token"]))
        assert r.status_code == 200, r.text

        # A fake fatal report for another node: 403, and that node never appears.
        body = ctl_report("node-b", 0)
        body["samples"][0]["gpus"][0]["xid_events"] = [{"code": 79, "time_unix_s": 1.0}]
        r = client.post(REPORTS, json=body, headers=_bearer(first["token"]))
        assert r.status_code == 403
        assert "bound to node 'node-a'" in r.json()["detail"]
        assert _nodes(client, viewer) == {"node-a"}

        # The shared agent token is refused when the setting forbids it.
        r = client.post(REPORTS, json=ctl_report("node-b", 0), headers=live.headers("agent"))
        assert r.status_code == 403 and "shared agent tokens are disabled" in r.json()["detail"]
        assert _nodes(client, viewer) == {"node-a"}

        # Rotation: the new token works at once, the old one until the grace period ends.
        second = _node_tokens(client, operator, "node-a")
        assert second["previous_valid_until_unix_s"] > time.time() + 3000
        for seq, token in ((1, first["token"]), (2, second["token"])):
            r = client.post(REPORTS, json=ctl_report("node-a", seq), headers=_bearer(token))
            assert r.status_code == 200, r.text
        listed = client.get("/api/v1/agent-credentials/node-a", headers=operator).json()
        assert listed["count"] == 2
        assert [c["expires_unix_s"] is None for c in listed["data"]] == [False, True]
        assert "token" not in json.dumps(listed)

    # Tokens are stored (hashed) in the database: a restarted controller still knows them.
    live.restart()
    with http_calls.client(base_url=live.url, timeout=10) as client:
        r = client.post(REPORTS, json=ctl_report("node-a", 3), headers=_bearer(second["token"]))
        assert r.status_code == 200, r.text


def test_rotation_without_grace_ends_the_old_token(controller_factory: Any, ctl_report) -> None:
    live = controller_factory(agent_token_grace_s=0)
    with http_calls.client(base_url=live.url, timeout=10) as client:
        operator = live.headers("operator")
        first = _node_tokens(client, operator, "node-a")
        _node_tokens(client, operator, "node-a")
        r = client.post(REPORTS, json=ctl_report("node-a", 0), headers=_bearer(first["token"]))
        assert r.status_code == 401
        # Shared tokens still work when allowed (the default).
        r = client.post(REPORTS, json=ctl_report("node-z", 0), headers=live.headers("agent"))
        assert r.status_code == 200


def test_service_account_tokens_bound_to_their_node(controller_factory: Any, ctl_report) -> None:
    with FakeKube.running() as kube:
        kube.sa_tokens["h.a.sig"] = (SA, ["trainguard"], "node-a")
        kube.sa_tokens["h.other.sig"] = ("system:serviceaccount:x:other", ["trainguard"], "node-a")
        kube.sa_tokens["h.wrongaud.sig"] = (SA, ["api"], "node-a")
        kube.sa_tokens["h.unbound.sig"] = (SA, ["trainguard"], None)
        # A username that is not ASCII: compared as text it raised TypeError (a 500).
        kube.sa_tokens["h.accent.sig"] = (f"{SA}\u00e9", ["trainguard"], "node-a")
        live = controller_factory(
            allow_shared_agent_tokens=False, kube_token_review=True, kube_api_url=kube.url
        )
        with http_calls.client(base_url=live.url, timeout=10) as client:
            good = _bearer("h.a.sig")
            assert client.post(REPORTS, json=ctl_report("node-a", 0), headers=good).is_success
            r = client.post(REPORTS, json=ctl_report("node-b", 0), headers=good)
            assert r.status_code == 403
            others = ("h.other.sig", "h.wrongaud.sig", "h.unbound.sig", "h.unknown.sig")
            for token in (*others, "h.accent.sig"):
                r = client.post(REPORTS, json=ctl_report("node-a", 1), headers=_bearer(token))
                assert r.status_code == 401, token
            # An agent credential is never more than an agent.
            assert client.get("/api/v1/nodes", headers=good).status_code == 403
            assert _nodes(client, live.headers("viewer")) == {"node-a"}
        reviews = [s for s in kube.served if s[1] == "tokenreviews"]
        # One review per distinct token: answers are cached.
        assert len(reviews) == 6


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_issues_a_node_token(live_controller: Any, capsys: Any, ctl_report) -> None:
    from trainguard.cli.app import run

    operator = live_controller.operator_token
    argv = ["agent-token", "issue", "node-c", "--server", live_controller.url, "--token"]
    capsys.readouterr()
    assert run([*argv, operator], prog_name="trainguard") == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("tgn_")
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        assert client.post(REPORTS, json=ctl_report("node-c", 0), headers=_bearer(token)).is_success
        r = client.post(REPORTS, json=ctl_report("node-d", 0), headers=_bearer(token))
        assert r.status_code == 403
    # A viewer cannot issue: one-line error, usage/failure exit status, no traceback.
    assert run([*argv, live_controller.viewer_token], prog_name="trainguard") != 0
    err = capsys.readouterr().err
    # The in-process controller's log records share this stderr; a handler left on an
    # earlier test's closed capture prints "--- Logging error ---" blocks with their own
    # traceback. The CLI is judged by its own output: its last line, and no other traceback.
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and "operator" in last, err
    assert err.count("Traceback") == err.count("--- Logging error ---"), err


def test_unstorable_values_are_422_with_their_path_on_both_databases(
    live_controller: Any, ctl_report
) -> None:
    """Same answers on SQLite and PostgreSQL (the param), and nothing stored."""
    agent, operator = live_controller.headers("agent"), live_controller.headers("operator")
    json_headers = {"Content-Type": "application/json"}
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        # A lone surrogate: pydantic's JSON parser refuses the body; the door names the field.
        raw = json.dumps(ctl_report("node-a", 0)).replace(
            '"agent_instance": "', '"agent_instance": "\\ud800'
        )
        r = client.post(REPORTS, content=raw, headers={**agent, **json_headers})
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("body.agent_instance: text must not contain lone")
        # The same in an operator's body (parsed by FastAPI, where it used to pass through).
        for content, field in (
            (b'{"reason": "why\\udc00"}', "body.reason"),
            (b'{"reason": "why\\u0000"}', "body.reason"),
        ):
            r = client.post(
                "/api/v1/nodes/node-a/isolate",
                content=content,
                headers={**operator, **json_headers},
            )
            assert r.status_code == 422, r.text
            assert r.json()["detail"].startswith(f"{field}: text must not contain")
        # NaN / inf / huge numbers in a policy: refused, the policy in force unchanged.
        before = client.get("/api/v1/remediation/policy", headers=operator).json()
        for bad in (b"NaN", b"1e999", b"99999999999999999999999"):
            body = b'{"guards": {"isolation_window_s": ' + bad + b"}}"
            r = client.put(
                "/api/v1/remediation/policy", content=body, headers={**operator, **json_headers}
            )
            assert r.status_code == 422, (bad, r.text)
            assert r.json()["detail"].startswith("body.guards.isolation_window_s:"), r.text
        assert client.get("/api/v1/remediation/policy", headers=operator).json() == before
        # NUL in query and path parameters.
        viewer = live_controller.headers("viewer")
        for path in (
            "/api/v1/incidents?kind=a%00b",
            "/api/v1/nodes/a%00b",
            "/api/v1/commands?node=%00",
        ):
            r = client.get(path, headers=viewer)
            assert r.status_code == 422, (path, r.text)
            assert "NUL" in r.json()["detail"]
        # Nothing of the above was stored; the next good report works.
        assert client.post(REPORTS, json=ctl_report("node-a", 0), headers=agent).is_success
        nodes = client.get("/api/v1/nodes", headers=viewer).json()["data"]
        assert [n["name"] for n in nodes] == ["node-a"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_agent_reads_its_rotating_token_from_a_file(controller_factory: Any, tmp_path: Any) -> None:
    """The agent side of per-node credentials: ``token_file`` (as the kubelet's projected
    token) is re-read when it changes; a report for another node stays in the spool."""
    from agents.reporter import BackoffPolicy, Reporter
    from agents.spool import Spool
    from agents.stats import AgentStats
    from trainguard.wire import NodeIdentity, NodeSample, Report

    live = controller_factory(allow_shared_agent_tokens=False)
    with http_calls.client(base_url=live.url, timeout=10) as client:
        first = _node_tokens(client, live.headers("operator"), "node-a")["token"]
    token_file = tmp_path / "token"
    token_file.write_text(first + "\n")
    spool = Spool(tmp_path / "spool", max_bytes=10_000_000)

    def spool_one(node: str) -> None:
        spool.append(
            lambda seq, dropped: Report(
                node=NodeIdentity(name=node),
                agent_instance=spool.agent_instance,
                seq=seq,
                sent_unix_s=time.time(),
                samples=[NodeSample(time_unix_s=1.0)],
                spool_dropped_total=dropped,
            )
        )

    reporter = Reporter(
        spool,
        controller_url=live.url,
        token=None,
        token_file=token_file,
        stats=AgentStats(),
        on_reply=lambda _reply: None,
        backoff=BackoffPolicy(base_s=0.01, max_s=0.05, min_s=0.001),
    )
    spool_one("node-a")
    assert reporter.send_oldest() == "delivered"
    with http_calls.client(base_url=live.url, timeout=10) as client:
        second = _node_tokens(client, live.headers("operator"), "node-a")["token"]
    token_file.write_text(second)
    spool_one("node-a")
    assert reporter.send_oldest() == "delivered"
    spool_one("node-b")
    assert reporter.send_oldest() == "config"  # kept, retried with backoff, logged
    assert len(spool.pending()) == 1


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_acks_and_preflight_verdicts_only_from_the_commands_node(
    controller_factory: Any, ctl_report
) -> None:
    live = controller_factory(allow_shared_agent_tokens=False)
    with http_calls.client(base_url=live.url, timeout=10) as client:
        operator = live.headers("operator")
        a = _bearer(_node_tokens(client, operator, "node-a")["token"])
        b = _bearer(_node_tokens(client, operator, "node-b")["token"])
        assert client.post(REPORTS, json=ctl_report("node-a", 0), headers=a).is_success
        assert client.post(REPORTS, json=ctl_report("node-b", 0), headers=b).is_success
        r = client.post("/api/v1/nodes/node-b/preflight", headers=operator)
        assert r.status_code == 201, r.text
        command = r.json()["id"]
        ack = {"command_id": command, "status": "succeeded", "reason": "all checks passed"}
        # node-a's agent claims node-b's preflight passed: as node-b (403) or as itself.
        forged = ctl_report("node-b", 1, command_acks=[ack])
        assert client.post(REPORTS, json=forged, headers=a).status_code == 403
        own = ctl_report("node-a", 1, command_acks=[ack])
        assert client.post(REPORTS, json=own, headers=a).is_success
        verdict = client.get(f"/api/v1/nodes/node-b/preflight/{command}", headers=operator)
        assert verdict.json()["status"] in ("pending", "sent"), verdict.text
        # node-b's own agent answers it.
        reply = client.post(REPORTS, json=ctl_report("node-b", 2, command_acks=[ack]), headers=b)
        assert reply.is_success
        verdict = client.get(f"/api/v1/nodes/node-b/preflight/{command}", headers=operator)
        assert verdict.json()["status"] == "succeeded"
