"""One hostile or broken agent report must not corrupt a job for good (found by the API
acceptance probe): a rank at or above its world size is refused, an absurd step is refused,
and one report's world size does not override what the job's other ranks agree on, while a
real shrink (every rank restarting with the smaller size) is followed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.tracker import JobTracker
from controller.logic.world_size import WorldSize
from controller.services.dashboard import StepRecorder
from tests import http_calls
from trainguard import wire

SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

Factory = Callable[..., Any]
MakeReport = Callable[..., dict[str, Any]]
HUGE = 2**31 - 1


def _step(rank: int, world_size: int, step: int) -> dict[str, Any]:
    return {
        "job": "job-x",
        "rank": rank,
        "world_size": world_size,
        "step": step,
        "step_time_s": 1.0,
        "compute_time_s": 1.0,
        "collective_wait_s": 0.0,
        "end_unix_s": time.time(),
    }


class Poster:
    def __init__(self, live: Any, make_report: MakeReport) -> None:
        self.live, self.make_report, self.seq = live, make_report, 0

    def post(self, node: str, job: dict[str, Any]) -> httpx.Response:
        self.seq += 1
        body = self.make_report(node, self.seq, gpus=1, samples=1) | {"job": job}
        return http_calls.post(
            f"{self.live.url}/api/v1/reports",
            json=body,
            headers=self.live.headers("agent"),
            timeout=10,
        )

    def steps(self, node: str, *steps: dict[str, Any]) -> None:
        r = self.post(node, {"steps": list(steps)})
        assert r.status_code == 200, r.text

    def job(self) -> dict[str, Any]:
        r = http_calls.get(
            f"{self.live.url}/api/v1/jobs/job-x", headers=self.live.headers("viewer"), timeout=10
        )
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


@SQLITE
def test_rank_at_or_above_world_size_and_absurd_steps_are_refused(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    agent = Poster(controller_factory(), ctl_report)
    r = agent.post("node-c", {"steps": [_step(7, 2, 1)]})
    assert r.status_code == 422, r.text
    assert "rank 7 must be less than world_size 2" in r.text
    event = {"job": "job-x", "rank": 2, "kind": "started", "time_unix_s": time.time()}
    r = agent.post("node-c", {"rank_events": [event | {"world_size": 2}]})
    assert r.status_code == 422, r.text
    assert "world_size" in r.text
    r = agent.post("node-c", {"steps": [_step(0, 2, 2**63 - 1)]})
    assert r.status_code == 422, r.text
    assert "step" in r.text
    r = agent.post("node-c", {"steps": [_step(0, 2, wire.MAX_STEP)]})
    assert r.status_code == 200, r.text
    agent.steps("node-c", _step(1, 2, 0))  # a rank event without world size still goes
    r = agent.post("node-c", {"rank_events": [event | {"rank": 9}]})
    assert r.status_code == 200, r.text


@SQLITE
def test_one_report_with_a_huge_world_size_does_not_stick(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    agent = Poster(controller_factory(), ctl_report)
    agent.steps("node-a", _step(0, 2, 1))
    agent.steps("node-b", _step(1, 2, 1))
    assert agent.job()["world_size"] == 2
    agent.steps("node-c", _step(5, HUGE, 1))
    for step in (2, 3):
        agent.steps("node-a", _step(0, 2, step))
        agent.steps("node-b", _step(1, 2, step))
    job = agent.job()
    assert (job["world_size"], job["state"], job["ranks_reporting"]) == (2, "running", 2)
    assert [r["rank"] for r in job["ranks"]] == [0, 1]


@SQLITE
def test_a_shrink_restart_lowers_the_world_size_and_drops_the_old_ranks(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    agent = Poster(controller_factory(), ctl_report)
    agent.steps("node-a", _step(0, 4, 10), _step(1, 4, 10))
    agent.steps("node-b", _step(2, 4, 10), _step(3, 4, 10))
    assert agent.job()["world_size"] == 4
    agent.steps("node-a", _step(0, 2, 5), _step(1, 2, 5))  # resumed on half the nodes
    job = agent.job()
    assert (job["world_size"], job["state"], job["ranks_reporting"]) == (2, "running", 2)
    assert [r["rank"] for r in job["ranks"]] == [0, 1]
    assert job["nodes"] == ["node-a"]


@SQLITE
def test_in_flight_and_checkpoint_records_add_no_rank_outside_the_world(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    """Those records carry no world size for the wire to check their rank against: a rank
    beyond the agreed world gets no row (in memory or in the database), while the
    checkpoint event itself stays in the job's history."""
    live = controller_factory()
    agent = Poster(live, ctl_report)
    agent.steps("node-a", _step(0, 2, 1), _step(1, 2, 1))
    now = time.time()
    stuck = {"job": "job-x", "group": "g0", "op": "all_reduce", "seq": 3, "elapsed_s": 1.0}
    ckpt = {"job": "job-x", "step": 1, "kind": "durable", "time_unix_s": now}
    r = agent.post(
        "node-b",
        {
            "inflight": [stuck | {"rank": HUGE}, stuck | {"rank": 1}],
            "checkpoints": [ckpt | {"rank": 9}, ckpt | {"rank": 1}],
        },
    )
    assert r.status_code == 200, r.text
    assert sorted(live.controller.state.jobs["job-x"].ranks) == [0, 1]
    live.restart()
    ranks = live.controller.state.jobs["job-x"].ranks
    assert sorted(ranks) == [0, 1]
    assert ranks[1].node == "node-b"  # the in-world records still count
    r = http_calls.get(
        f"{live.url}/api/v1/jobs/job-x/checkpoints", headers=live.headers("viewer"), timeout=10
    )
    assert r.status_code == 200, r.text
    assert sorted(c["rank"] for c in r.json()["data"]) == [1, 9]


def test_world_size_vote() -> None:
    world = WorldSize(window_s=100.0)
    assert [world.observe(r, 2, 0.0) for r in (0, 1)] == [2, 2]
    assert world.observe(1, HUGE, 1.0) == HUGE  # one of two ranks: the newest wins a tie
    assert world.observe(1, 2, 2.0) == 2  # and the next real report takes it back
    for r in range(8):
        world.observe(r, 8, 10.0)
    assert world.observe(0, 2, 200.0) == 2  # the other ranks' claims are stale: gone


def _summary(rank: int, world_size: int, step: int) -> wire.StepSummary:
    return wire.StepSummary.model_validate(_step(rank, world_size, step))


def test_tracker_and_dashboard_ignore_a_lone_world_size() -> None:
    tracker = JobTracker(job="job-x", cfg=C4DConfig())
    recorder = StepRecorder()
    for step in range(3):
        for rank in range(4):
            tracker.observe_step("n", _summary(rank, 4, step), now_s=float(step))
            recorder.record(_summary(rank, 4, step), float(step))
    tracker.observe_step("evil", _summary(2, HUGE, 3), now_s=3.0)
    recorder.record(_summary(2, HUGE, 3), 3.0)
    recorder.record(_summary(HUGE - 1, HUGE, 2), 3.0)  # and a rank only that claim has
    assert (tracker.world_size, tracker.incarnation) == (4, 0)
    matrix = recorder.matrix("job-x", 10, time.time())
    assert matrix is not None and matrix["world_size"] == 4
    assert [r["rank"] for r in matrix["ranks"]] == [0, 1, 2, 3]
    # A real shrink: every rank of the new run reports the smaller size.
    tracker.observe_step("n", _summary(0, 2, 0), now_s=4.0)
    tracker.observe_step("n", _summary(1, 2, 0), now_s=4.0)
    assert (tracker.world_size, tracker.incarnation) == (2, 1)


def test_a_started_event_drops_the_ranks_beyond_the_new_size() -> None:
    world = WorldSize()
    for r in range(8):
        world.observe(r, 8, 0.0)
    assert world.observe(0, 2, 1.0) == 8  # one step claim against seven: not yet
    assert world.observe(1, 2, 1.0, started=True) == 2  # a restart: ranks 2..7 are gone
    world.observe(2**31 - 2, HUGE, 2.0)  # a stray huge rank, then another restart
    assert world.observe(0, 1, 3.0, started=True) == 1
    tracker = JobTracker(job="job-x", cfg=C4DConfig())
    for rank in range(4):
        tracker.observe_step("n", _summary(rank, 4, 0), now_s=0.0)
    event = {"job": "job-x", "kind": "started", "time_unix_s": 1.0, "world_size": 2}
    tracker.observe_rank_event("n", wire.RankEvent.model_validate(event | {"rank": 0}), 1.0)
    assert (tracker.world_size, tracker.incarnation) == (2, 1)
    tracker.observe_step("n", _summary(1, 2, 0), now_s=2.0)
    assert (tracker.world_size, tracker.incarnation) == (2, 1)
