"""Persistence rules that keep memory, models and migrations honest (issues 13 and 14).

* One write path per table: every statement that writes a table is in one repository
  module (read from the source, so a new path fails here before it ships).
* Rows by column name: a domain object and its row round-trip through the repositories'
  mapping, so a new column needs the model and the dataclass field only.
* Migrations are additive after the first release: the previous controller keeps running
  on the new schema while a rolling upgrade replaces it (expand, then contract later).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from controller.db import repositories
from controller.db.keys import CommandKey, CursorKey, GpuKey, JobKey, NodeKey, RankKey
from controller.db.models import Base
from controller.logic.detection.incident_evidence import EvidenceEvent, GpuFaultEvidence
from controller.state import (
    ClusterState,
    CommandState,
    Cursor,
    GpuState,
    IncidentState,
    JobState,
    NodeState,
    RankState,
)

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "controller"
REPOSITORIES = CONTROLLER / "db" / "repositories"
MIGRATIONS = CONTROLLER / "db" / "migrations" / "versions"

#: The generic statements the repositories build on; they name no table themselves.
PRIMITIVES = {REPOSITORIES / "_dml.py"}

MODELS = {m.class_.__name__: m.class_.__tablename__ for m in Base.registry.mappers}
WRITE_CALLS = {"insert", "update", "delete", "upsert", "bulk_insert"}
WRITE_SQL = ("INSERT ", "UPDATE ", "DELETE ", "COPY ", "TRUNCATE ")


#: Calls whose first argument is SQL text.
SQL_RUNNERS = {"text", "exec_driver_sql", "execute", "executemany", "copy"}


def _sql_text(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lstrip().upper()
    if isinstance(node, ast.JoinedStr) and node.values:
        return _sql_text(node.values[0])
    return ""


def _table_of(node: ast.expr) -> str | None:
    """The table a statement's target names: ``Node``, ``Node.__table__``, ``table("x")``."""
    if isinstance(node, ast.Name):
        return MODELS.get(node.id, "?" + node.id)
    if isinstance(node, ast.Attribute) and node.attr == "__table__":
        return _table_of(node.value)
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        return str(node.args[0].value)
    return "?" + ast.unparse(node)


def _writes(path: Path) -> list[tuple[str, int]]:
    """(table, line) of every write statement in ``path``."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if called in SQL_RUNNERS and node.args and _sql_text(node.args[0]).startswith(WRITE_SQL):
            found.append(("?sql", node.lineno))
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute):
            if func.attr in ("insert", "update", "delete") and not node.args:
                # ``table.insert()``: a Core statement on a table object
                if isinstance(func.value, ast.Name | ast.Call | ast.Attribute) and (
                    _table_of(func.value) in MODELS.values()
                    or isinstance(func.value, ast.Call)
                    or (isinstance(func.value, ast.Attribute) and func.value.attr == "__table__")
                ):
                    found.append((_table_of(func.value) or "?", node.lineno))
                continue
            name = func.attr if func.attr in WRITE_CALLS and func.attr != "update" else None
        route = isinstance(node.args[0], ast.Constant) if node.args else False
        if name in ("insert", "update", "delete") and node.args and not route:
            # (``router.delete("/path")`` names a route, not a table)
            found.append((_table_of(node.args[0]) or "?", node.lineno))
        elif name in ("upsert", "bulk_insert") and len(node.args) >= 2:
            found.append((_table_of(node.args[1]) or "?", node.lineno))
    return found


def test_each_table_is_written_from_exactly_one_repository_module() -> None:
    writers: dict[str, set[str]] = {}
    outside: list[str] = []
    for path in sorted(CONTROLLER.rglob("*.py")):
        if MIGRATIONS in path.parents or path in PRIMITIVES:
            continue
        for table, line in _writes(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if REPOSITORIES not in path.parents:
                outside.append(f"{where} writes {table}")
                continue
            assert table in MODELS.values(), f"{where}: cannot tell which table it writes"
            writers.setdefault(table, set()).add(str(path.relative_to(ROOT)))
    assert outside == [], "write SQL outside controller/db/repositories:\n" + "\n".join(outside)
    assert set(writers) == set(MODELS.values()), "tables nobody writes (or unknown tables)"
    several = {t: sorted(m) for t, m in writers.items() if len(m) > 1}
    assert several == {}, f"tables with more than one write path: {several}"


def test_the_write_path_check_sees_a_second_writer(tmp_path: Path) -> None:
    """The check above is only worth something if it catches these shapes."""
    source = tmp_path / "rogue.py"
    source.write_text(
        "conn.execute(update(Node).where(Node.name == n).values(x=1))\n"
        "conn.execute(table('incidents').insert(), rows)\n"
        "conn.execute(Gpu.__table__.delete())\n"
        "upsert(conn, Job.__table__, rows)\n"
        "conn.exec_driver_sql('DELETE FROM ranks')\n"
        "x = {}.update(y)\n"
    )
    found = sorted(_writes(source), key=lambda item: item[1])
    assert [t for t, _ in found] == ["nodes", "incidents", "gpus", "jobs", "?sql"]


def _sample_state() -> ClusterState:
    state = ClusterState()
    gpu = GpuState(index=3, uuid="GPU-3", name="H100", pci_bus_id="0:3", memory_total_bytes=80)
    gpu.health, gpu.health_reason, gpu.ecc_uncorrected_total = "unhealthy", "xid 79", 7
    state.nodes["n1"] = NodeState(
        name="n1",
        first_seen_unix_s=1.0,
        hostname="n1.example",
        labels={"rack": "r1"},
        backend="nvml",
        agent_version="1.2",
        driver_version="550",
        health="unhealthy",
        health_reason="GPU 3",
        power_w=700.5,
        spool_dropped_total=2,
        last_report_unix_s=5.0,
        gpus={3: gpu},
        isolated_reason="incident 9",
        isolated_unix_s=6.0,
    )
    state.cursors[("n1", "i1")] = Cursor(committed_seq=41)
    rank = RankState(rank=1, node="n1", last_seen_unix_s=5.0, gpu_index=3, pid=99, last_step=8)
    state.jobs["j1"] = JobState(
        name="j1", first_seen_unix_s=1.0, last_seen_unix_s=5.0, world_size=2, last_step=8,
        ranks={1: rank},
    )  # fmt: skip
    state.commands["c1"] = CommandState(
        id="c1", node="n1", kind="set_power_limit", params={"watts": 500}, created_unix_s=2.0
    )
    state.add_incident(
        IncidentState(
            id=1, kind="gpu_fault", severity="critical", state="open", summary="s",
            dedupe_key="gpu_fault:n1:3", opened_unix_s=3.0, updated_unix_s=4.0, node="n1",
            gpu_index=3, job="j1", ranks=[1], count=2,
            evidence=GpuFaultEvidence(
                reasons=["XID 79"], events=[EvidenceEvent(time_unix_s=2.5, xid=79)]
            ),
        )
    )  # fmt: skip
    return state


def test_rows_round_trip_through_the_database(tmp_path: Path) -> None:
    """Every state-mirrored table: memory -> row -> database -> loader -> same memory."""
    from sqlalchemy.orm import Session

    from controller.db.migrate import upgrade
    from controller.db.session import make_engine
    from controller.loader import load_state

    url = f"sqlite:///{tmp_path / 'rt.db'}"
    upgrade(url)
    before = _sample_state()
    keys = [
        NodeKey("n1"), GpuKey("n1", 3), CursorKey("n1", "i1"), JobKey("j1"), RankKey("j1", 1),
        CommandKey("c1"),
    ]  # fmt: skip
    upserts: dict = {}
    for key in keys:
        row = before.row_for(key)
        assert row is not None and set(row) == {c.key for c in key.table.columns}
        upserts.setdefault(key.table, []).append(row)
    with pytest.raises(AssertionError, match="unreachable"):
        before.row_for(("nodes", ("n1",)))  # type: ignore[arg-type]  # an old string key
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            repositories.write_batch(conn, upserts)
            incident = before.incidents[1]
            assert (
                repositories.incidents.insert_incident(
                    conn, repositories.incidents.incident_row(incident, incident.evidence.as_json())
                )
                == 1
            )
            repositories.nodes.set_isolation(conn, "n1", "incident 9", 6.0)
        after = ClusterState()
        with Session(engine) as session:
            load_state(session, after)
    finally:
        engine.dispose()

    def plain(obj: object) -> dict:
        return {
            f.name: getattr(obj, f.name)
            for f in dataclasses.fields(obj)  # type: ignore[arg-type]
            if f.name not in ("last_seen_unix_s", "gpus", "ranks", "latest", "inflight")
        }

    assert plain(after.nodes["n1"]) == plain(before.nodes["n1"])
    assert plain(after.nodes["n1"].gpus[3]) == plain(before.nodes["n1"].gpus[3])
    assert after.cursors[("n1", "i1")].committed_seq == 41
    assert plain(after.jobs["j1"]) == plain(before.jobs["j1"])
    assert plain(after.jobs["j1"].ranks[1]) == plain(before.jobs["j1"].ranks[1])
    assert plain(after.commands["c1"]) == plain(before.commands["c1"])
    assert plain(after.incidents[1]) == plain(before.incidents[1])
    assert type(after.incidents[1].evidence) is GpuFaultEvidence  # typed once, by the loader


def test_node_upsert_from_memory_never_undoes_a_stored_isolation(tmp_path: Path) -> None:
    """Isolation is written before it is shown; a node row built from memory a moment
    earlier (isolation still empty there) must not overwrite it in a later batch."""
    from sqlalchemy import text

    from controller.db.migrate import upgrade
    from controller.db.session import make_engine

    url = f"sqlite:///{tmp_path / 'iso.db'}"
    upgrade(url)
    state = _sample_state()
    node = state.nodes["n1"]
    node.isolated_reason = node.isolated_unix_s = None
    stale = state.row_for(NodeKey("n1"))
    assert stale is not None
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            repositories.write_batch(conn, {NodeKey.table: [stale]})
            assert repositories.nodes.set_isolation(conn, "n1", "incident 9", 6.0)
            repositories.write_batch(conn, {NodeKey.table: [stale]})
            stored = conn.execute(text("SELECT isolated_reason FROM nodes")).scalar_one()
            assert not repositories.nodes.set_isolation(conn, "nobody", "x", 1.0)
    finally:
        engine.dispose()
    assert stored == "incident 9"


#: Revisions shipped before the expand/contract rule; later ones must only add.
BASELINE = {"0001", "0002", "0003"}
DESTRUCTIVE = ("drop_table", "drop_column", "alter_column", "drop_constraint", "rename_table")


@pytest.mark.parametrize("path", sorted(MIGRATIONS.glob("*.py")), ids=lambda p: p.stem)
def test_migrations_after_the_baseline_are_additive(path: Path) -> None:
    """The previous controller must run on the new schema (rolling upgrade, two replicas):
    no dropped or altered column or table in ``upgrade()``, and the docstring says so."""
    tree = ast.parse(path.read_text())
    revision = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "revision" for t in n.targets)
        and isinstance(n.value, ast.Constant)
    )
    if revision in BASELINE:
        return
    upgrade_fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade"
    )
    calls = [
        n.func.attr
        for n in ast.walk(upgrade_fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    assert not set(calls) & set(DESTRUCTIVE), f"{path.name}: destructive ops {calls}"
    doc = ast.get_docstring(tree) or ""
    assert "backward compatible" in doc.lower(), f"{path.name}: say why it is backward compatible"


def test_restore_puts_back_everything_a_report_changed() -> None:
    """A report the database did not take is undone field by field (new node, GPUs, jobs,
    ranks, commands), except liveness and isolation, which are not the report's to undo."""
    from trainguard import wire

    state = _sample_state()
    state.commands["c1"].status = "sent"
    report = wire.Report.model_validate(
        {
            "node": {"name": "n1", "gpus": []},
            "agent_instance": "i2",
            "seq": 0,
            "sent_unix_s": 1.0,
            "command_acks": [{"command_id": "c1", "status": "succeeded"}],
            "job": {
                "steps": [
                    {
                        "job": "j1",
                        "rank": 1,
                        "step": 9,
                        "world_size": 2,
                        "step_time_s": 1.0,
                        "compute_time_s": 0.8,
                        "collective_wait_s": 0.2,
                    }
                ],
                "rank_events": [{"job": "j2", "rank": 0, "kind": "started", "time_unix_s": 9.0}],
            },
        }
    )
    before = {
        "node": dataclasses.asdict(state.nodes["n1"]),
        "job": dataclasses.asdict(state.jobs["j1"]),
        "command": dataclasses.asdict(state.commands["c1"]),
    }
    snap = state.snapshot(report)
    node = state.nodes["n1"]
    node.hostname, node.labels, node.last_seen_unix_s = "moved", {"rack": "r9"}, 99.0
    node.gpus[3].uuid = "GPU-other"
    node.gpus[4] = GpuState(index=4)
    node.isolated_reason = "isolated meanwhile (its own write path)"
    state.jobs["j1"].last_step = 9
    state.jobs["j1"].ranks[1].last_step = 9
    state.jobs["j1"].ranks[5] = RankState(rank=5, node="n1", last_seen_unix_s=9.0)
    state.jobs["j2"] = JobState(name="j2", first_seen_unix_s=9.0, last_seen_unix_s=9.0)
    state.commands["c1"].status = "succeeded"
    state.cursors[("n1", "i2")] = Cursor()

    state.restore(snap)

    after_node = dataclasses.asdict(state.nodes["n1"])
    assert after_node.pop("last_seen_unix_s") == 99.0  # liveness: the node did report
    assert after_node.pop("isolated_reason") == "isolated meanwhile (its own write path)"
    expected = dict(before["node"])
    del expected["last_seen_unix_s"], expected["isolated_reason"]
    assert after_node == expected
    assert dataclasses.asdict(state.jobs["j1"]) == before["job"]
    assert "j2" not in state.jobs
    assert dataclasses.asdict(state.commands["c1"]) == before["command"]
    assert ("n1", "i2") not in state.cursors and ("n1", "i1") in state.cursors

    fresh = wire.Report.model_validate(
        {"node": {"name": "n-new", "gpus": []}, "agent_instance": "i", "seq": 0, "sent_unix_s": 1}
    )
    snap = state.snapshot(fresh)
    state.nodes["n-new"] = NodeState(name="n-new", first_seen_unix_s=1.0)
    state.restore(snap)
    assert "n-new" not in state.nodes


def test_last_preflight_verdicts_survive_a_restart(tmp_path: Path) -> None:
    """A node whose last preflight failed stays out of placement after a restart or a
    failover: finished commands leave memory, their rows stay, the loader takes each node's
    newest verdict back."""
    from sqlalchemy.orm import Session

    from controller.db.migrate import upgrade
    from controller.db.session import make_engine
    from controller.loader import load_state
    from controller.logic.remediation.preflight import PREFLIGHT_KIND, failed_nodes
    from controller.services.commands import CommandService

    url = f"sqlite:///{tmp_path / 'pf.db'}"
    upgrade(url)
    before = _sample_state()
    before.nodes["n2"] = dataclasses.replace(before.nodes["n1"], name="n2", gpus={})

    def done(cid: str, node: str, kind: str, status: str, at: float) -> CommandState:
        command = CommandState(id=cid, node=node, kind=kind, params={}, created_unix_s=at - 1)
        command.status, command.reason, command.finished_unix_s = status, f"{cid} said", at
        return command

    commands = [
        done("p1", "n1", PREFLIGHT_KIND, "succeeded", 10.0),
        done("p2", "n1", PREFLIGHT_KIND, "failed", 20.0),  # n1's newest: failed
        done("p3", "n2", PREFLIGHT_KIND, "failed", 10.0),
        done("p4", "n2", PREFLIGHT_KIND, "succeeded", 30.0),  # n2's newest: passed
        done("p5", "n2", PREFLIGHT_KIND, "expired", 40.0),  # no verdict
        done("x1", "n2", "set_power_limit", "failed", 50.0),  # another kind
    ]
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            repositories.write_batch(
                conn,
                {
                    NodeKey("n1").table: [before.row_for(NodeKey(n)) for n in ("n1", "n2")],
                    CommandKey("p1").table: [
                        repositories.commands.command_row(c) for c in commands
                    ],
                },
            )
        after = ClusterState()
        with Session(engine) as session:
            load_state(session, after)
    finally:
        engine.dispose()
    assert sorted(after.commands) == ["p2", "p4"]
    service = CommandService(after, None, expire_after_s=60)  # type: ignore[arg-type]
    verdicts = service.preflight_verdicts()
    assert failed_nodes(verdicts) == {"n1": "p2 said"}
    assert verdicts["n2"].passed
