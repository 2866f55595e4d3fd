"""Schemathesis against the live controller's OpenAPI schema: no input makes it answer 5xx,
and every answer matches the documented schema."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

EXAMPLES_PER_MODE = 12

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def test_openapi_has_stable_operation_ids(live_controller) -> None:
    spec = httpx.get(f"{live_controller.url}/openapi.json").json()
    ids = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    assert {
        "post_report", "get_status", "list_nodes", "get_node", "list_jobs", "get_job",
        "list_incidents", "get_incident", "list_actions", "create_command", "list_commands",
        "healthz", "readyz",
    } <= ids  # fmt: skip
    body = spec["paths"]["/api/v1/reports"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/Report"}
    assert "Report" in spec["components"]["schemas"]


@pytest.mark.slow
def test_no_server_errors_for_any_input(live_controller, ctl_report) -> None:
    # Some state, so that reads return real rows too.
    httpx.post(
        f"{live_controller.url}/api/v1/reports",
        json=ctl_report("node-a", 0),
        headers=live_controller.headers("agent"),
    )
    schema = schemathesis.openapi.from_url(f"{live_controller.url}/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        role = (
            "agent" if operation.definition.raw.get("operationId") == "post_report" else "operator"
        )
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _fuzz(operation, mode, live_controller.url, live_controller.headers(role))
            except Unsatisfiable:
                # Nothing to get wrong: e.g. negative cases of an operation without inputs.
                assert mode is GenerationMode.NEGATIVE, operation.label
                continue
            checked += 1
    assert checked >= 13 + 9


def _fuzz(operation: Any, mode: GenerationMode, url: str, headers: dict[str, str]) -> None:
    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=10)
        assert response.status_code < 500, (case.method, case.path, response.text)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    run()
