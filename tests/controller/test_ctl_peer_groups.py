"""Peer groups reach the detectors when summaries name them by id (issue 15, item 3).

A real controller over HTTP: summaries that name a declared peer group reach the
``JobRecordsReported`` subscribers (the detectors) with ``group_ranks`` filled in; a
summary from an older agent that carries the list is taken as it is. After a controller
restart the membership is gone: the reply asks for it, the agent's cache
(``agents.peer_groups``) answers in the next report, and the summaries have their peers
again.
"""

from __future__ import annotations

from typing import Any

import pytest

from agents.peer_groups import PeerGroupCache
from tests import http_calls
from trainguard import wire

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

STAGE = list(range(0, 64, 4))
GID = wire.peer_group_id(STAGE)


def _step(step: int, **fields: Any) -> dict[str, Any]:
    return {
        "job": "train",
        "rank": 4,
        "world_size": 64,
        "step": step,
        "step_time_s": 1.0,
        "compute_time_s": 0.9,
        "collective_wait_s": 0.1,
        **fields,
    }


def _watch(live: Any) -> list[tuple[int, list[int]]]:
    from controller.services.events import JobRecordsReported

    seen: list[tuple[int, list[int]]] = []

    async def record(event: JobRecordsReported) -> None:
        seen.extend((s.step, list(s.group_ranks)) for s in event.report.job.steps)

    live.controller.events.subscribe(JobRecordsReported, record, name="test-peers")
    return seen


def test_peer_groups_by_id_survive_a_controller_restart(live_controller, ctl_report) -> None:
    agent = live_controller.headers("agent")
    cache = PeerGroupCache()
    declared = wire.JobRecords(
        steps=[_step(0, peer_group=GID)],
        peer_groups=[wire.PeerGroup(job="train", id=GID, ranks=STAGE)],
    )
    cache.remember(declared)  # what the agent's socket handler does with a rank's records
    seen = _watch(live_controller)
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:

        def send(seq: int, records: dict[str, Any]) -> dict[str, Any]:
            body = ctl_report("node-p", seq, samples=1, job=records)
            r = client.post("/api/v1/reports", json=body, headers=agent)
            assert r.status_code == 200, r.text
            reply: dict[str, Any] = r.json()
            return reply

        reply = send(0, declared.model_dump(mode="json"))
        assert reply["peer_groups_unknown"] == []
        reply = send(1, {"steps": [_step(1, peer_group=GID)]})
        assert reply["peer_groups_unknown"] == []
        # an older agent: the list itself, no id
        send(2, {"steps": [_step(2, group_ranks=[1, 2])]})
        assert seen == [(0, STAGE), (1, STAGE), (2, [1, 2])]

    live_controller.restart()
    seen = _watch(live_controller)
    with http_calls.client(base_url=live_controller.url, timeout=10) as client:
        body = ctl_report("node-p", 3, samples=1, job={"steps": [_step(3, peer_group=GID)]})
        reply = client.post("/api/v1/reports", json=body, headers=agent).json()
        asked = wire.ReportReply.model_validate(reply).peer_groups_unknown
        assert [(ref.job, ref.id) for ref in asked] == [("train", GID)]
        assert seen == [(3, [])]  # unknown for now: no peers rather than wrong ones
        again = cache.wanted(asked)  # the agent's answer, in its next report
        records = {**again.model_dump(mode="json"), "steps": [_step(4, peer_group=GID)]}
        body = ctl_report("node-p", 4, samples=1, job=records)
        reply = client.post("/api/v1/reports", json=body, headers=agent).json()
    assert reply["peer_groups_unknown"] == []
    assert seen == [(3, []), (4, STAGE)]
