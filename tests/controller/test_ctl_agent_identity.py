"""Revoking a node's agent tokens (issue 14): the next report is 401 at once, audited, durable.

On SQLite and PostgreSQL: an operator revokes; viewers and agents cannot; the revocation and
its audit row are one transaction, so a database that fails leaves the token working and no
audit row, and the retry works. Shared agent tokens are off by default.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from controller.settings import ControllerSettings
from tests import http_calls
from tests.controller.db_reads import stored as _stored

REPORTS = "/api/v1/reports"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _revocations(client: httpx.Client, live: Any) -> list[dict[str, Any]]:
    r = client.get("/api/v1/actions", headers=live.headers())
    assert r.status_code == 200, r.text
    return [a for a in r.json()["data"] if a["kind"] == "revoke_agent_tokens"]


def test_shared_agent_tokens_are_off_by_default() -> None:
    assert ControllerSettings.model_fields["allow_shared_agent_tokens"].default is False
    settings = ControllerSettings(
        database_url="sqlite://", tokens=[{"name": "a", "role": "agent", "token": "a" * 24}]
    )
    assert settings.allow_shared_agent_tokens is False


def test_revoked_token_is_refused_at_once_and_audited(
    controller_factory: Any, db_url: str, ctl_report: Any, ctl_db_outage: Any
) -> None:
    live = controller_factory(allow_shared_agent_tokens=False, agent_token_grace_s=3600)
    operator = live.headers("operator")
    with http_calls.client(base_url=live.url, timeout=20) as client:
        first = client.post("/api/v1/agent-credentials/node-r", headers=operator)
        assert first.status_code == 201, first.text
        # Rotated: the first token is in its grace period, both work; revoking ends both.
        second = client.post("/api/v1/agent-credentials/node-r", headers=operator)
        old, new = first.json()["token"], second.json()["token"]
        for seq, token in enumerate((old, new)):
            r = client.post(REPORTS, json=ctl_report("node-r", seq), headers=_bearer(token))
            assert r.status_code == 200, r.text

        # Only operators revoke.
        for role in ("viewer", "agent"):
            r = client.delete("/api/v1/agent-credentials/node-r", headers=live.headers(role))
            assert r.status_code == 403, r.text
        r = client.delete("/api/v1/agent-credentials/node-r", headers=_bearer(new))
        assert r.status_code == 403, r.text

        # The database fails: nothing revoked, nothing audited, the token still works.
        ctl_db_outage.arm(r"^\s*UPDATE agent_credentials")
        r = client.delete("/api/v1/agent-credentials/node-r", headers=operator)
        assert r.status_code == 503, r.text
        ctl_db_outage.disarm()
        r = client.post(REPORTS, json=ctl_report("node-r", 2), headers=_bearer(new))
        assert r.status_code == 200, r.text
        assert _revocations(client, live) == []

        r = client.delete("/api/v1/agent-credentials/node-r", headers=operator)
        assert r.status_code == 200, r.text
        assert r.json() == {"node": "node-r", "revoked": 2}
        for seq, token in enumerate((old, new), start=3):
            r = client.post(REPORTS, json=ctl_report("node-r", seq), headers=_bearer(token))
            assert r.status_code == 401, r.text
        (audit,) = _revocations(client, live)
        assert audit["target"] == "node:node-r" and audit["status"] == "succeeded"
        assert audit["trigger"] == "operator:test-operator"
        valid = _stored(
            db_url,
            "SELECT count(*) FROM agent_credentials WHERE node_name = 'node-r' "
            "AND expires_unix_s IS NULL",
        )
        assert valid == 0
        # Nothing left to revoke: a one-line 404.
        r = client.delete("/api/v1/agent-credentials/node-r", headers=operator)
        assert r.status_code == 404 and "no valid agent token" in r.text

    # Durable: a restarted controller refuses the tokens too; a new one works.
    live.restart()
    with http_calls.client(base_url=live.url, timeout=20) as client:
        r = client.post(REPORTS, json=ctl_report("node-r", 5), headers=_bearer(new))
        assert r.status_code == 401, r.text
        fresh = client.post("/api/v1/agent-credentials/node-r", headers=operator).json()["token"]
        r = client.post(REPORTS, json=ctl_report("node-r", 5), headers=_bearer(fresh))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_revokes_a_node_token(controller_factory: Any, capsys: Any, ctl_report: Any) -> None:
    from trainguard.cli.app import run

    live = controller_factory(allow_shared_agent_tokens=False)
    common = ["--server", live.url, "--token", live.operator_token]
    capsys.readouterr()
    assert run(["agent-token", "issue", "node-s", *common], prog_name="trainguard") == 0
    token = capsys.readouterr().out.strip()
    assert run(["agent-token", "revoke", "node-s", *common], prog_name="trainguard") == 0
    assert capsys.readouterr().out.strip() == "1 agent token(s) of node node-s revoked"
    with http_calls.client(base_url=live.url, timeout=10) as client:
        r = client.post(REPORTS, json=ctl_report("node-s", 0), headers=_bearer(token))
        assert r.status_code == 401
    assert run(["agent-token", "revoke", "node-s", *common], prog_name="trainguard") != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error:") and "no valid agent token" in last
