"""Job retention, the leftovers: the power and traffic services forget a job too.

Job retention (``controller.services.job_retention``) dropped a quiet job from the cluster
state, the detectors, ingest and the remediation engine, but two services still kept
something per job for good: the power loop each job's priority (and the tree's stored root
row listed it, so a restart read it back), and the traffic service each job's live plan
(every link change re-planned them all, and a restart restored every plan ever made). On a
controller that runs thousands of short jobs, both grew with every job ever seen.

Here N short jobs run through the real composition (``controller.runtime.compose``, on
SQLite): reported through ingest, planned, prioritized; the retention sweep then forgets
them, and every per-job structure holds only the job an open incident still names, in this
controller and in the next one built on the same database. The jobs' index
(``ix_jobs_last_seen_unix_s``, migration 0006) is checked with SQLite's query plan.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select, text

from controller.db.migrate import upgrade
from controller.db.models import Job
from controller.db.session import make_engine
from controller.loader import load_state
from controller.logic.detection.c4d.job_evidence import CommFailureEvidence
from controller.logic.incident_kinds import IncidentKind
from controller.runtime import compose
from controller.services.container import Services
from controller.services.incidents import IncidentSpec
from controller.services.traffic.placement import Layout
from controller.settings import ControllerSettings
from tests.traffic.fabrics import lab_fabric_file
from trainguard import wire

RETENTION_S = 3600.0
#: Short jobs, each on two of the lab fabric's four nodes.
SHORT = [f"short-{i}" for i in range(12)]
#: Quiet as long, but an open incident names it: kept, with its plan and priority.
HELD = "held"
NODES = [f"tg-{i}" for i in range(4)]


async def _noop(*_: object) -> None:
    return None


def tree_file(path: Path) -> Path:
    """One row over the four fabric nodes (the power tree job priorities need)."""
    doc = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 100_000,
        "children": [{"name": n, "kind": "server", "budget_w": 5000} for n in NODES],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def migrated(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'tg.db'}"
    upgrade(url)
    yield url


def compose_on(db_url: str, tmp_path: Path) -> Services:
    settings = ControllerSettings(
        database_url=db_url,
        tokens=[{"name": "ops", "role": "operator", "token": "o" * 20}],
        topology_file=lab_fabric_file(tmp_path),
        power_domains_file=tree_file(tmp_path / "tree.yaml"),
        job_retention_s=RETENTION_S,
    )
    return compose(settings, on_elected=_noop, on_lost=_noop, acting=lambda: True)


async def lead(services: Services) -> None:
    """What ``Controller._lead`` does for the state, traffic and power."""
    state = services.state
    await services.store.read(lambda s: load_state(s, state, retention_s=RETENTION_S))
    await services.traffic.load()
    await services.power.start()


def per_job(services: Services) -> dict[str, set[str]]:
    """The jobs each per-job structure holds (power and traffic, this change's; the state,
    ingest and the detector, the earlier ones; the engine's books, filled on its ticks, are
    tests/controller/test_job_retention.py's)."""
    return {
        "state": set(services.state.jobs),
        "ingest": set(services.ingest._world),
        "detector": set(services.jobs.trackers.jobs),
        "power": set(services.power.loop.job_priorities),
        "traffic": {live.plan.job.name for live in services.traffic.plans.values()},
    }


def holding(*jobs: str) -> dict[str, set[str]]:
    return {key: set(jobs) for key in ("state", "ingest", "detector", "power", "traffic")}


async def run_jobs(services: Services) -> None:
    """Each job reported (rank 0 on one node, rank 1 on the next), planned, prioritized."""
    jobs = [*SHORT, HELD]
    for i, job in enumerate(jobs):
        node = NODES[i % 2 * 2]  # tg-0 or tg-2
        other = NODES[NODES.index(node) + 1]
        for seq, (where, rank) in enumerate(((node, 0), (other, 1))):
            reply = await services.ingest.ingest(_rank_report(where, 2 * i + seq, job, rank))
            assert not reply.duplicate, reply
        await services.traffic.create_plan(job, Layout(), replace=False, by="test")
        await services.power.set_job_priority(job, "high")
    await services.incidents.open_or_bump(
        IncidentSpec(
            kind=IncidentKind.COMM_FAILURE,
            severity="critical",
            summary="held by an open incident",
            dedupe_key="test:held",
            job=HELD,
            evidence=CommFailureEvidence(errors={"0": "connection reset by peer"}),
        )
    )


def _rank_report(node: str, seq: int, job: str, rank: int) -> wire.Report:
    now = time.time()
    event = wire.RankEvent(
        job=job, rank=rank, kind="started", world_size=2, time_unix_s=now, gpu_index=0
    )
    return wire.Report(
        node=wire.NodeIdentity(name=node),
        agent_instance=f"a-{node}",
        seq=seq,
        sent_unix_s=now,
        job=wire.JobRecords(rank_events=[event]),
    )


def test_power_and_traffic_forget_the_jobs_retention_forgets(migrated: str, tmp_path: Path) -> None:
    async def scenario() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
        services = compose_on(migrated, tmp_path)
        services.writer.start()
        try:
            await lead(services)
            await run_jobs(services)
            before = per_job(services)
            # A link change may be iterating this dict on a worker thread (``_replan_all``):
            # the forget hook replaces it instead of changing its size under that loop.
            replanning = services.traffic.plans
            later = time.time() + RETENTION_S + 1
            forgotten = services.remediation.retention.sweep(later)
            assert sorted(forgotten) == sorted(SHORT)
            after = per_job(services)
            assert len(replanning) == len(SHORT) + 1
            await services.writer.close()
        finally:
            services.store.close()
        return before, after

    before, after = asyncio.run(scenario())
    assert before == holding(*SHORT, HELD)
    assert after == holding(HELD)


def test_a_new_leader_restores_no_plan_or_priority_of_a_forgotten_job(
    migrated: str, tmp_path: Path
) -> None:
    async def first() -> None:
        services = compose_on(migrated, tmp_path)
        services.writer.start()
        try:
            await lead(services)
            await run_jobs(services)
            await services.writer.close()
        finally:
            services.store.close()

    async def second() -> dict[str, set[str]]:
        services = compose_on(migrated, tmp_path)
        try:
            await lead(services)
            return per_job(services)
        finally:
            services.store.close()

    asyncio.run(first())
    # Time passes: every job quiet for longer than the retention period.
    engine = make_engine(migrated)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE jobs SET last_seen_unix_s = last_seen_unix_s - :d"),
                {"d": 2 * RETENTION_S},
            )
    finally:
        engine.dispose()
    found = asyncio.run(second())
    # The loader reads back the held job only; the plans and priorities follow it. (The
    # detectors, ingest and the engine fill theirs from reports and their own reads.)
    assert {k: found[k] for k in ("state", "power", "traffic")} == {
        "state": {HELD},
        "power": {HELD},
        "traffic": {HELD},
    }


def test_the_retained_jobs_read_uses_the_last_seen_index(migrated: str) -> None:
    """The loader's ``WHERE last_seen_unix_s > :since`` searches the index (migration
    0006) instead of scanning every job ever stored."""
    engine = make_engine(migrated)
    try:
        query = select(Job).where(Job.last_seen_unix_s > 1.0)
        sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
        with engine.connect() as conn:
            plan = " ".join(str(row[-1]) for row in conn.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
    finally:
        engine.dispose()
    assert "ix_jobs_last_seen_unix_s" in plan, plan
    assert "SCAN jobs" not in plan, plan
