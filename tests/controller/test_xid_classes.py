"""Every XID the issue names, through the health detector: fatal ones make the GPU and its
node unhealthy with a ``gpu_fault`` incident; application ones are recorded and harmless;
an unknown code is a warning that changes no health.

The detector runs on a real (migrated, temporary SQLite) store, with the cluster state an
ingested report would have left: only ``on_report`` is called, no HTTP server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table

from controller.db.keys import GpuKey, NodeKey, RowKey
from controller.db.migrate import upgrade
from controller.db.repositories import write_batch
from controller.db.session import make_engine
from controller.logic.detection.incident_evidence import XidEvidence
from controller.services.detection.health import (
    APPLICATION_XIDS,
    FATAL_XIDS,
    HealthDetector,
    xid_class,
)
from controller.services.incidents import IncidentService
from controller.state import ClusterState, GpuState, IncidentState, NodeState
from controller.store import Store
from controller.writer import GroupCommitWriter
from trainguard import wire

#: From issue 2: "Fatal XIDs (48, 79, 94, 95, 63, 64, 74, 119, 120 …) … application XIDs
#: (13, 31, 43, 45, 68) are recorded but never quarantine".
ISSUE_FATAL = (48, 79, 94, 95, 63, 64, 74, 119, 120)
ISSUE_APPLICATION = (13, 31, 43, 45, 68)
#: Codes in neither table.
UNKNOWN = (32, 57, 999)
GPUS = 4
BAD_GPU = 2


@pytest.mark.parametrize("code", ISSUE_FATAL)
def test_issue_fatal_codes_are_fatal(code: int) -> None:
    assert xid_class(code) == "fatal"
    assert FATAL_XIDS[code]  # a meaning for the incident summary


@pytest.mark.parametrize("code", ISSUE_APPLICATION)
def test_issue_application_codes_are_application(code: int) -> None:
    assert xid_class(code) == "application"
    assert code not in FATAL_XIDS


@pytest.mark.parametrize("code", UNKNOWN)
def test_unlisted_codes_are_unknown(code: int) -> None:
    assert xid_class(code) == "unknown"


def test_no_code_is_both_fatal_and_application() -> None:
    assert not set(FATAL_XIDS) & set(APPLICATION_XIDS)


# --------------------------------------------------------------------------- the detector


class _Cluster:
    """The state after one healthy report from ``node``, a detector and the store."""

    def __init__(self, store: Store, node: str) -> None:
        self.state = ClusterState()
        self.store = store
        self.node = node
        now = time.time()
        self.state.nodes[node] = NodeState(
            name=node,
            first_seen_unix_s=now,
            health="healthy",
            last_seen_unix_s=now,
            gpus={
                i: GpuState(index=i, uuid=f"GPU-{i}", ecc_uncorrected_total=0) for i in range(GPUS)
            },
        )
        writer = GroupCommitWriter(store, self.state.row_for, flush_interval_s=0.0, max_rows=1000)
        self.detector = HealthDetector(
            self.state, IncidentService(self.state, store), writer, node_lost_after_s=30.0
        )

    async def register(self) -> None:
        """The node and GPU rows the ingest would have written (incidents point at them)."""
        keys: list[RowKey] = [NodeKey(self.node), *(GpuKey(self.node, i) for i in range(GPUS))]
        rows: dict[Table, list[dict[str, Any]]] = {}
        for key in keys:
            row = self.state.row_for(key)
            assert row is not None
            rows.setdefault(key.table, []).append(row)
        await self.store.write(lambda conn: write_batch(conn, rows))

    async def report_xid(self, code: int, build: Callable[..., dict[str, Any]]) -> None:
        events = {BAD_GPU: {"xid_events": [{"code": code, "time_unix_s": time.time()}]}}
        body = build(self.node, 1, gpus=GPUS, samples=1, gpu_overrides=events)
        await self.detector.on_report(wire.Report.model_validate(body), time.time())

    def incidents(self) -> list[IncidentState]:
        return list(self.state.incidents.values())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('xid')) / 'tg.db'}"
    upgrade(url)
    store = Store(make_engine(url))
    yield store
    store.close()


def _run(
    store: Store, code: int, build: Callable[..., dict[str, Any]]
) -> tuple[_Cluster, NodeState]:
    cluster = _Cluster(store, f"node-xid-{code}")

    async def go() -> None:
        await cluster.register()
        await cluster.report_xid(code, build)

    asyncio.run(go())
    return cluster, cluster.state.nodes[cluster.node]


@pytest.mark.parametrize("code", ISSUE_FATAL)
def test_fatal_xid_opens_gpu_fault_and_marks_gpu_and_node_unhealthy(
    store: Store, ctl_report: Callable[..., dict[str, Any]], code: int
) -> None:
    cluster, node = _run(store, code, ctl_report)
    reason = f"XID {code} on GPU {BAD_GPU}: {FATAL_XIDS[code]}"
    assert (node.health, node.health_reason) == ("unhealthy", reason)
    assert node.gpus[BAD_GPU].health == "unhealthy"
    assert [i for i, g in node.gpus.items() if g.health != "healthy"] == [BAD_GPU]
    (incident,) = cluster.incidents()
    assert (incident.kind, incident.severity) == ("gpu_fault", "critical")
    assert (incident.node, incident.gpu_index) == (cluster.node, BAD_GPU)
    assert incident.summary == f"{cluster.node}: {reason}"


@pytest.mark.parametrize("code", ISSUE_APPLICATION)
def test_application_xid_is_recorded_and_never_quarantines(
    store: Store, ctl_report: Callable[..., dict[str, Any]], code: int
) -> None:
    cluster, node = _run(store, code, ctl_report)
    assert node.health == "healthy" and node.gpus_unhealthy == 0
    (incident,) = cluster.incidents()
    assert (incident.kind, incident.severity) == ("application_xid", "info")
    assert incident.gpu_index == BAD_GPU
    assert isinstance(incident.evidence, XidEvidence)
    assert incident.evidence.codes == {str(code): 1}
    assert f"application XID {code} ({APPLICATION_XIDS[code]})" in incident.summary


@pytest.mark.parametrize("code", UNKNOWN)
def test_unknown_xid_is_a_warning_that_changes_no_health(
    store: Store, ctl_report: Callable[..., dict[str, Any]], code: int
) -> None:
    cluster, node = _run(store, code, ctl_report)
    assert node.health == "healthy" and node.gpus_unhealthy == 0
    (incident,) = cluster.incidents()
    assert (incident.kind, incident.severity) == ("gpu_xid", "warning")
    assert incident.summary == f"{cluster.node}: unclassified XID {code} on GPU {BAD_GPU}"
