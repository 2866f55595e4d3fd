"""Typed action parameters (issue 13): one model per remediation action kind, shared by the
writer (the steps), the reader (``GET /api/v1/actions``), the OpenAPI schema and the CLI.
Stored JSON keeps its shape: rows written before the models existed still load, a row that
does not fit its kind's model is left out with a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from controller.api.app import create_app
from controller.db.migrate import upgrade
from controller.db.models import Action
from controller.db.session import make_engine
from controller.logic.remediation.params import (
    CaptureParams,
    GoodputFacts,
    PlanKind,
    RestartParams,
    parse_params,
)
from controller.schemas import RestartActionPublic
from controller.services.queries import list_actions
from controller.settings import ControllerSettings

TOKENS = [{"name": "ops", "role": "operator", "token": "o" * 20}]

#: A restart row as the engine wrote it before the models (a rollback, resumed).
OLD_RESTART = {
    "incident": 7,
    "incident_kind": "nonfinite",
    "rollback": {"bad_step": 30},
    "plan": "same_size",
    "reason": "all nodes healthy",
    "from_nodes": ["n0", "n1"],
    "from_world_size": 4,
    "original_nodes": 2,
    "resume_step": 20,
    "nodes": ["n0", "n1"],
    "world_size": 4,
    "tp": 1,
    "dp": 4,
    "generation": 2,
    "goodput": {
        "ledger_id": "7",
        "kind": "nonfinite",
        "fault_unix_s": 100.5,
        "detected_unix_s": 101.5,
        "last_step": 31,
        "resume_step": 20,
        "step_s": 1.5,
        "restart_unix_s": 102.5,
        "resumed_unix_s": 110.5,
    },
    "resumed_step": 21,
    "remediation": "r1",
    "job": "gpt",
}


def test_old_rows_load_typed_and_a_malformed_row_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'tg.db'}"
    upgrade(url)
    engine = make_engine(url)
    rows = [
        ("restart_job", "gpt", OLD_RESTART),
        (
            "capture_evidence",
            "gpt",
            {
                "ranks": [
                    {
                        "rank": 0,
                        "node": "n0",
                        "state": "hung",
                        "last_step": 3,
                        "inflight": [{"op": "all_reduce", "seq": 9, "group": "0"}],
                    }
                ]
            },
        ),
        ("isolate_node", "n1", {"incident": 7, "incident_kind": "gpu_fault", "actuator": None}),
        ("set_policy", "policy", {"enabled": True}),  # another service's kind: as stored
        ("restart_job", "gpt", {"incident": 8, "nodes": "n0,n1"}),  # malformed
    ]
    with Session(engine) as session, session.begin():
        for i, (kind, target, params) in enumerate(rows):
            session.add(
                Action(
                    kind=kind,
                    target=target,
                    trigger="incident:7",
                    params=params,
                    status="succeeded",
                    outcome="",
                    created_unix_s=1000.0 - i,
                    finished_unix_s=None,
                )
            )
    with caplog.at_level(logging.WARNING), Session(engine) as session:
        actions, count = list_actions(session, limit=50, offset=0)
    engine.dispose()
    assert count == 5 and [a.kind for a in actions] == [
        "restart_job",
        "capture_evidence",
        "isolate_node",
        "set_policy",
    ]
    restart = actions[0]
    assert isinstance(restart, RestartActionPublic)
    assert restart.params.plan is PlanKind.SAME_SIZE
    assert restart.params.goodput is not None and restart.params.goodput.resumed_unix_s == 110.5
    assert restart.params.rollback is not None and restart.params.rollback.bad_step == 30
    # What the API returns is what was stored, key for key.
    assert restart.model_dump(mode="json")["params"] == OLD_RESTART
    assert isinstance(actions[1].params, CaptureParams)
    assert actions[1].params.ranks[0].inflight[0].op == "all_reduce"
    assert actions[3].params == {"enabled": True}
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "nodes" in skipped[0].getMessage()


def test_the_api_schema_types_params_by_kind(tmp_path: Path) -> None:
    settings = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'tg.db'}", tokens=TOKENS)
    spec = create_app(settings).openapi()
    schemas = spec["components"]["schemas"]
    items = schemas["ActionsPublic"]["properties"]["data"]["items"]
    refs = {ref["$ref"].rsplit("/", 1)[1] for ref in items["oneOf"]}
    assert {"RestartActionPublic", "IsolateActionPublic", "OtherActionPublic"} <= refs
    restart = schemas["RestartActionPublic"]["properties"]
    assert restart["kind"]["const"] == "restart_job"
    assert restart["params"]["$ref"].endswith("/RestartParams")
    plan = schemas["RestartParams"]["properties"]["plan"]["anyOf"][0]["$ref"]
    assert set(schemas[plan.rsplit("/", 1)[1]]["enum"]) == {m.value for m in PlanKind}


def test_writer_and_reader_share_the_model() -> None:
    facts = GoodputFacts(
        ledger_id="1",
        kind="hang",
        fault_unix_s=1.0,
        detected_unix_s=2.0,
        last_step=5,
        resume_step=3,
        step_s=None,
    )
    written = RestartParams(plan=PlanKind.SHRINK, nodes=["n0"], goodput=facts).to_params()
    assert written == {"plan": "shrink", "nodes": ["n0"], "goodput": facts.to_params()}
    assert "resumed_unix_s" not in written["goodput"]  # only the fields given are stored
    assert parse_params("restart_job", written) == RestartParams.model_validate(written)
    with pytest.raises(ValueError, match="plan"):
        parse_params("restart_job", {"plan": "sideways"})


def test_cli_actions_view_reads_params_through_the_model() -> None:
    from trainguard.cli.views import action_params_cell

    restart = {
        "kind": "restart_job",
        "params": {
            "incident": 7,
            "job": "gpt",
            "plan": "shrink",
            "nodes": ["n0"],
            "resume_step": 20,
        },
    }
    assert action_params_cell(restart) == "nodes=n0,plan=shrink,resume_step=20"
    # Not fitting the model (another release's row): shown as it came, never a traceback.
    odd = {"kind": "restart_job", "params": {"plan": "sideways"}}
    assert action_params_cell(odd) == "plan=sideways"
    assert action_params_cell({"kind": "set_policy", "params": {"enabled": True}}) == "enabled=true"


def test_other_kinds_do_not_overlap_the_typed_ones(tmp_path: Path) -> None:
    """``oneOf`` needs exactly one match: a restart row must not also fit OtherActionPublic."""
    jsonschema = pytest.importorskip("jsonschema")
    settings = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'tg.db'}", tokens=TOKENS)
    spec = create_app(settings).openapi()
    items = spec["components"]["schemas"]["ActionsPublic"]["properties"]["data"]["items"]
    schema = jsonschema.Draft202012Validator({**items, "components": spec["components"]})
    row = {
        "id": 1,
        "target": "gpt",
        "trigger": "incident:7",
        "status": "succeeded",
        "outcome": "",
        "created_unix_s": 1.0,
        "finished_unix_s": None,
        "duration_s": None,
    }
    schema.validate({**row, "kind": "restart_job", "params": OLD_RESTART})
    schema.validate({**row, "kind": "set_policy", "params": {"enabled": True}})
