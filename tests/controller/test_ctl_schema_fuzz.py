"""Schemathesis against the live controller's OpenAPI schema, on SQLite and PostgreSQL: no
input makes it answer 5xx, and every answer matches the documented schema.

Every operation is fuzzed with the token of each role: the role the route is for gets
positive and negative cases (``EXAMPLES``), the others a few positive ones (they must be
refused with a documented 401/403, never served or crashed). Failures are collected and
listed together; the run prints ``fuzz: <db> operations=.. cases=.. failures=..``, the figure
docs/security.md quotes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests import http_calls

if TYPE_CHECKING:  # imported where used: ~1 s of CPU in every worker that only collects this
    import schemathesis
    from schemathesis import GenerationMode

#: Cases per (operation, mode) for the role the route is for, and per other role.
EXAMPLES = 8
EXAMPLES_OTHER_ROLE = 2
ROLES = ("agent", "viewer", "operator")
#: Routes that read (a viewer may call them); every other operation needs an operator,
#: except ``post_report`` (agents only).
PUBLIC = {"healthz", "readyz"}
#: The cases drawn for each (operation, mode, count), in the order drawn, kept for the next
#: database (``None``: unsatisfiable). Derandomized, the draw is the same on SQLite and on
#: PostgreSQL, case for case, and drawing is most of this test's CPU: the second database
#: is sent the very same cases without drawing them again. Both runs share a worker
#: (``make test`` schedules a test file as one unit), so the draw is made once.
_DRAWN: dict[tuple[str, str, int], list[Any] | None] = {}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_openapi_has_stable_operation_ids(live_controller) -> None:
    # The schema is built on first request (~0.3 s of CPU here, seconds on a loaded host).
    spec = http_calls.get(f"{live_controller.url}/openapi.json", timeout=60).json()
    ids = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {
        "post_report", "get_status", "list_nodes", "get_node", "list_jobs", "get_job",
        "list_incidents", "get_incident", "list_actions", "create_command", "list_commands",
        "healthz", "readyz", "issue_agent_token", "list_agent_credentials", "revoke_agent_tokens",
    } <= ids  # fmt: skip
    body = spec["paths"]["/api/v1/reports"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/Report"}
    assert "Report" in spec["components"]["schemas"]


def _home_role(operation: Any) -> str:
    raw = operation.definition.raw
    if raw.get("operationId") == "post_report":
        return "agent"
    return "viewer" if operation.method.upper() == "GET" else "operator"


@pytest.mark.slow
def test_no_server_errors_for_any_input(live_controller, ctl_report, db_url: str) -> None:
    # Some state, so that reads return real rows too.
    r = http_calls.post(
        f"{live_controller.url}/api/v1/reports",
        json=ctl_report("node-a", 0),
        headers=live_controller.headers("agent"),
    )
    assert r.status_code == 200, r.text
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{live_controller.url}/openapi.json")
    started = time.monotonic()
    operations, cases, failures = 0, [0], []
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        home = _home_role(operation)
        for role in ROLES:
            own = role == home or operation.definition.raw.get("operationId") in PUBLIC
            modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if own else ()
            for mode in modes or (GenerationMode.POSITIVE,):
                try:
                    _fuzz(
                        operation,
                        mode,
                        live_controller.url,
                        live_controller.headers(role),
                        EXAMPLES if own else EXAMPLES_OTHER_ROLE,
                        cases,
                        failures,
                    )
                except Unsatisfiable:
                    # Nothing to get wrong: e.g. negative cases of an operation without inputs.
                    assert mode is GenerationMode.NEGATIVE, operation.label
    elapsed = time.monotonic() - started
    database = "postgresql" if db_url.startswith("postgresql") else "sqlite"
    print(
        f"fuzz: {database} operations={operations} cases={cases[0]} "
        f"failures={len(failures)} seconds={elapsed:.0f}"
    )
    assert operations >= 40
    assert failures == [], "\n".join(failures[:20])


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    url: str,
    headers: dict[str, str],
    examples: int,
    cases: list[int],
    failures: list[str],
) -> None:
    key = (operation.label, mode.value, examples)
    if key in _DRAWN:
        drawn = _DRAWN[key]
        if drawn is None:
            raise Unsatisfiable(f"{operation.label}: no {mode.value} cases (as drawn before)")
        for case in drawn:
            _send(case, mode, url, headers, cases, failures)
        return
    drawing: list[Any] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        drawing.append(case)
        _send(case, mode, url, headers, cases, failures)

    try:
        run()
    except Unsatisfiable:
        _DRAWN[key] = None
        raise
    _DRAWN[key] = drawing


def _send(
    case: Any,
    mode: GenerationMode,
    url: str,
    headers: dict[str, str],
    cases: list[int],
    failures: list[str],
) -> None:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance

    cases[0] += 1
    response = case.call(base_url=url, headers=headers, timeout=10)
    try:
        assert response.status_code < 500, response.text[:200]
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
    except Exception as exc:  # collected: one run lists every failing operation
        failures.append(f"{case.method} {case.path} ({mode.value}): {exc}"[:400])
