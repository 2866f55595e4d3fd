"""Flight Recorder evidence on hang incidents (controller side), on a real SQLite store.

A hang incident of a job on two nodes gets a ``JobDumpTrace`` command per node; the ranks'
dumps arriving in reports are read once all are in, and the incident's evidence then holds
where the ranks diverged and whether that agrees with trainguard's own culprits; a
disagreement is said in the summary. The dumps are in torch's Flight Recorder format as the
ranks send them (``collectives.flight.dump_record``; the real gloo hang that produces them is
tests/collectives/test_multirank.py's hang test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from controller.db.keys import NodeKey
from controller.db.migrate import upgrade
from controller.db.repositories import write_batch
from controller.db.session import make_engine
from controller.logic.detection.c4d.job_evidence import FlightRecorderEvidence, HangEvidence
from controller.services.commands import CommandService
from controller.services.flight_evidence import FlightEvidence, flight_evidence
from controller.services.incidents import IncidentService, IncidentSpec
from controller.state import ClusterState, JobState, NodeState, RankState
from controller.store import Store
from controller.writer import GroupCommitWriter
from trainguard import wire

NODES = {0: "fr-node-a", 1: "fr-node-a", 2: "fr-node-b"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('fr')) / 'tg.db'}"
    upgrade(url)
    store = Store(make_engine(url))
    yield store
    store.close()


def _entry(seq: int) -> dict[str, Any]:
    return {
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[8]],
        "output_sizes": [[8]],
        "time_created_ns": seq,
        "state": "scheduled",
        "retired": seq < 6,
    }


def _report(node: str, dumps: list[wire.FlightRecorderDump]) -> wire.Report:
    return wire.Report(
        node=wire.NodeIdentity(name=node),
        agent_instance="a",
        seq=1,
        sent_unix_s=time.time(),
        job=wire.JobRecords(traces=dumps),
    )


async def _scenario(store: Store, culprits: list[int]) -> tuple[Any, list[Any]]:
    state = ClusterState()
    now = time.time()
    for node in sorted(set(NODES.values())):
        state.nodes[node] = NodeState(name=node, first_seen_unix_s=now, last_seen_unix_s=now)
    rows: dict[Any, list[dict[str, Any]]] = {}
    for node in state.nodes:
        row = state.row_for(NodeKey(node))
        assert row is not None
        rows.setdefault(NodeKey(node).table, []).append(row)
    await store.write(lambda conn: write_batch(conn, rows))
    state.jobs["llm"] = JobState(
        name="llm",
        first_seen_unix_s=now,
        last_seen_unix_s=now,
        world_size=3,
        ranks={r: RankState(rank=r, node=n, last_seen_unix_s=now) for r, n in NODES.items()},
    )
    writer = GroupCommitWriter(store, state.row_for, flush_interval_s=0.0, max_rows=1000)
    incidents = IncidentService(state, store)
    commands = CommandService(state, writer, expire_after_s=60.0)
    evidence = FlightEvidence(state, incidents, commands)
    incident, _ = await incidents.open_or_bump(
        IncidentSpec(
            kind="hang",
            severity="critical",
            summary=f"llm: ranks {culprits} never entered all_reduce seq 6",
            dedupe_key=f"hang:llm:{culprits}",
            job="llm",
            ranks=culprits,
            evidence=HangEvidence(
                group="0",
                seq=6,
                op="all_reduce",
                elapsed_s=30.0,
                entered=[r for r in NODES if r not in culprits],
                passed=[],
                absent=culprits,
                confidence=1.0,
            ),
        )
    )
    await evidence.on_incident_opened(incident)
    asked = [c for c in state.commands.values() if c.kind == "job_dump_trace"]
    by_node = {c.node: c for c in asked}

    def dump(rank: int, last: int) -> wire.FlightRecorderDump:
        return wire.FlightRecorderDump(
            job="llm",
            rank=rank,
            command_id=by_node[NODES[rank]].id,
            enabled=True,
            entries=[_entry(s) for s in range(1, last + 1)],
            pg_ranks={"0": [0, 1, 2]},
        )

    # ranks 0 and 1 entered seq 6 (stuck in it); rank 2 never got past seq 5
    await evidence.on_report(_report("fr-node-a", [dump(0, 6)]), now)
    partial = incident.evidence.as_json()
    await evidence.on_report(_report("fr-node-a", [dump(1, 6)]), now)
    await evidence.on_report(_report("fr-node-b", [dump(2, 5)]), now)
    return incident, [asked, partial]


def _flight_recorder(incident: Any) -> FlightRecorderEvidence:
    """The reading merged into the hang's evidence (typed, as memory holds it)."""
    assert isinstance(incident.evidence, HangEvidence), incident.evidence
    assert incident.evidence.flight_recorder is not None
    return incident.evidence.flight_recorder


def test_dumps_are_asked_for_and_their_verdict_attached(store: Store) -> None:
    incident, (asked, partial) = asyncio.run(_scenario(store, [2]))
    assert sorted(c.node for c in asked) == ["fr-node-a", "fr-node-b"]
    assert all(
        wire.JobDumpTrace.model_validate({**c.params, "id": c.id}).job == "llm" for c in asked
    )
    assert "flight_recorder" not in partial  # not before every rank answered
    fr = _flight_recorder(incident)
    (div,) = fr.divergences
    assert (div.seq, div.entered, div.missing) == (6, [0, 1], [2])
    assert fr.agrees_with_trainguard is True and fr.dumps_missing == []
    assert incident.evidence.seq == 6 and incident.evidence.absent == [2]  # the detector's stays
    assert "disagrees" not in incident.summary


def test_a_disagreement_is_said_in_the_summary(store: Store) -> None:
    incident, _ = asyncio.run(_scenario(store, [1]))
    fr = _flight_recorder(incident)
    assert fr.agrees_with_trainguard is False
    assert (
        "Flight Recorder disagrees" in incident.summary and "[2] never entered" in incident.summary
    )


# Dumps are what agents relay: they must not put a rank that does not exist, or take the
# culprit out of, a hang incident's verdict (found in review of bdaf5ee, which bounded the
# rank references of the wire).


def _hostile_dump(rank: int, last: int, members: list[int]) -> wire.FlightRecorderDump:
    return wire.FlightRecorderDump(
        job="llm",
        rank=rank,
        command_id="c",
        enabled=True,
        entries=[_entry(s) for s in range(1, last + 1)],
        pg_ranks={"0": members},
    )


HANG_OF_2 = SimpleNamespace(kind="hang", ranks=[2])
JOB = {0, 1, 2}


def test_a_dump_from_a_rank_not_of_the_job_is_left_out() -> None:
    dumps = {r: _hostile_dump(r, last, [0, 1, 2]) for r, last in ((0, 6), (1, 6), (2, 5))}
    dumps[999] = _hostile_dump(999, 1, [0, 1, 2, 999])
    fr = flight_evidence(dumps, JOB, HANG_OF_2)  # type: ignore[arg-type]
    assert fr.dumps_from == [0, 1, 2]
    assert fr.divergences[0].missing == [2] and "999" not in fr.verdict


def test_one_dump_cannot_rewrite_a_groups_members() -> None:
    """Rank 0's dump leaves rank 2 out of group 0: the two other dumps outvote it."""
    dumps = {
        0: _hostile_dump(0, 6, [0, 1]),
        1: _hostile_dump(1, 6, [0, 1, 2]),
        2: _hostile_dump(2, 5, [0, 1, 2]),
    }
    for order in (dumps, dict(reversed(list(dumps.items())))):
        fr = flight_evidence(order, JOB, HANG_OF_2)  # type: ignore[arg-type]
        assert fr.divergences[0].missing == [2], fr.verdict
        assert fr.agrees_with_trainguard is True
