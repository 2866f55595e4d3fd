"""Third security sweep of the API: an agent token's issue and its audit row are one
transaction, and hostile names, headers, query parameters and JSON bodies get a one-line
4xx. What test_security_sweep.py, test_security_sweep2.py and
test_api_semantics_sweep.py cover is not repeated here.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from controller.auth import Authenticator, Principal
from controller.db.session import make_engine
from controller.errors import Unauthenticated
from controller.services.agent_identity import IdentityResolver, NodeCredentials, ReviewResult
from controller.settings import TokenConfig
from controller.store import Store
from tests import http_calls

#: The live controllers here run on SQLite.
SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
API = "/api/v1"


def _actions(client: httpx.Client, kind: str) -> list[dict[str, Any]]:
    rows = client.get(f"{API}/actions", params={"limit": 5000}).json()["data"]
    return [a for a in rows if a["kind"] == kind]


@SQLITE
def test_an_issued_token_and_its_audit_row_are_one_write(
    live_controller: Any, ctl_db_outage: Any
) -> None:
    """The issue's audit row was written ``pending`` before the token and finished after,
    in another transaction: a database lost (or a crash) between the two left a working
    token whose only record said ``pending`` for ever. Now the token and its ``succeeded``
    row are one transaction, so there is no second write to lose."""
    live = live_controller
    path = f"{API}/agent-credentials/n1"
    with http_calls.client(base_url=live.url, timeout=20, headers=live.headers()) as c:
        ctl_db_outage.arm(r"^\s*UPDATE actions")
        issued = c.post(path)
        ctl_db_outage.disarm()
        assert issued.status_code == 201, issued.text
        [row] = _actions(c, "issue_agent_token")
        token = issued.json()["token"]
        report = c.get(f"{API}/agent-credentials/n1").json()
    assert row["status"] == "succeeded" and row["finished_unix_s"] is not None, row
    assert row["params"] == {"node": "n1", "previous_valid_until_unix_s": None}
    assert report["count"] == 1 and token not in str(row)


# appended temporarily to test_security_sweep3.py


# ------------------------------------------------------------------ the bearer credential

TOKEN = secrets.token_hex(16)
#: What the refusal says (``controller.auth.BAD_CREDENTIAL``).
ONE_WORD = "one word of printable ASCII"
#: Blanks ``str.strip()`` removes that HTTP's optional whitespace (space, tab) is not. The
#: first four fit a latin-1 header value, so a real request can carry them.
NOT_OWS = ("\xa0", "\x85", "\x1c", "\x1f", "\u3000", "\u2028")


def _authenticator() -> Authenticator:
    config = TokenConfig(name="ops", role="operator", token=TOKEN)
    return Authenticator([config], allow_anonymous_read=False)


@pytest.mark.parametrize("blank", NOT_OWS)
def test_a_token_with_a_non_http_blank_around_it_is_not_that_token(blank: str) -> None:
    """The credential was ``str.strip()``-ed, which also strips U+00A0, U+0085, the
    ``\\x1c``..``\\x1f`` separators and the other Unicode blanks: ``TOKEN\\xa0`` was
    taken as ``TOKEN``. Only space and tab (RFC 9110 OWS) are trimmed now, and anything
    else that is not one word of printable ASCII is refused with one line."""
    auth = _authenticator()
    assert auth.principal(f"Bearer  {TOKEN}\t").name == "ops"  # OWS is still fine
    for value in (f"Bearer {TOKEN}{blank}", f"Bearer {blank}{TOKEN}"):
        with pytest.raises(Unauthenticated) as caught:
            auth.principal(value)
        assert ONE_WORD in caught.value.message


def test_two_tokens_in_one_header_are_refused_as_such() -> None:
    """``Bearer A B`` was hashed as the text ``A B`` (an "unknown token"); it is no token."""
    with pytest.raises(Unauthenticated) as caught:
        _authenticator().principal(f"Bearer {TOKEN} {TOKEN}")
    assert ONE_WORD in caught.value.message


class _RecordingReviewer:
    """The API server's TokenReview, as a fake: every JWT-shaped token is an agent's."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def review(self, token: str) -> ReviewResult:
        self.asked.append(token)
        return ReviewResult(True, username="system:serviceaccount:tg:agent", node="n1")


def test_token_review_sees_the_credential_the_rule_reads(tmp_path: Any) -> None:
    """The TokenReview path read the header with its own ``strip()``: ``a.b.c\\xa0`` was
    sent for review as ``a.b.c`` and authenticated. Both paths use one rule now."""
    reviewer = _RecordingReviewer()
    store = Store(make_engine(f"sqlite:///{tmp_path / 'c.db'}"))
    resolver = IdentityResolver(
        _authenticator(),
        NodeCredentials(store),
        reviewer=reviewer,
        agent_usernames=frozenset({"system:serviceaccount:tg:agent"}),
    )
    found = asyncio.run(resolver.resolve("Bearer a.b.c"))
    assert found == Principal(name="sa:n1", role="agent", node="n1")
    with pytest.raises(Unauthenticated):
        asyncio.run(resolver.resolve("Bearer a.b.c\xa0"))
    assert reviewer.asked == ["a.b.c"]


@SQLITE
def test_a_latin1_blank_after_a_real_token_is_401_over_http(live_controller: Any) -> None:
    """The same through a real server: a header's bytes are latin-1, so ``\\xa0`` after
    the operator's token arrives as U+00A0, and was stripped into the token."""
    live = live_controller
    token = live.headers("operator")["Authorization"].removeprefix("Bearer ")
    with http_calls.client(base_url=live.url, timeout=10) as c:
        assert c.get(f"{API}/nodes", headers={"Authorization": f"Bearer {token}"}).is_success
        raw = f"Bearer {token}".encode() + b"\xa0"
        r = c.get(f"{API}/nodes", headers={b"Authorization": raw})
    assert r.status_code == 401 and ONE_WORD in r.json()["detail"], r.text
