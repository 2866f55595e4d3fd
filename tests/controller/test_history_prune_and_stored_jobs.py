"""Two database-side gaps of a long-lived controller.

GPU history pruning: one unbounded DELETE of everything past ``history_retention_s`` ran
on the store's one writer thread, the group commit's. After a backlog (retention lowered
from a week to a day on a big fleet) it outran PostgreSQL's statement timeout, was
cancelled every minute and never finished, holding every agent's report for the whole
timeout each time. It now deletes in chunks, each its own transaction, a few per tick,
and reports commit between them.

Jobs that left memory (``job_retention_s``): ``GET /api/v1/jobs/{name}`` answered 404 for
yesterday's job although its rows were all stored; it now answers from the database
(state ``ended``, source ``history``), and ``GET /api/v1/jobs?history=true`` lists them.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, event

from controller import runtime
from controller.db.models import GpuHistory
from controller.db.session import make_engine
from tests import http_calls
from tests.controller.db_reads import stored
from tests.controller.test_job_retention import ALERT_ONLY, job_records
from tests.remediation.test_engine import open_incident
from tests.waiting import wait_for

PRUNE = "history-retention"
CHUNK = 7
MAX_CHUNKS = 3
BACKLOG = 50


class WriterLog:
    """What the store's writer thread ran, in order: each ``gpu_history`` DELETE with the
    rows it removed and the prune tick it ran in, each report's batch (its agent cursor's
    upsert: its history rows are copied past SQLAlchemy), each COMMIT. Real SQLAlchemy
    engine events, on every engine of the process; only the writer thread's are kept.

    The first DELETE that removes rows waits, inside its transaction, until a report's
    group commit is queued on the writer thread behind it: the report must then be stored
    before the next chunk, not after the whole backlog.
    """

    def __init__(self, live: Any, post_report: Any) -> None:
        self.live = live
        self.post_report = post_report
        self.events: list[tuple[Any, ...]] = []
        self.paused = False
        self.report_thread: threading.Thread | None = None

    def __enter__(self) -> WriterLog:
        event.listen(Engine, "after_cursor_execute", self.after_execute)
        event.listen(Engine, "commit", self.on_commit)
        return self

    def __exit__(self, *_exc: object) -> None:
        event.remove(Engine, "after_cursor_execute", self.after_execute)
        event.remove(Engine, "commit", self.on_commit)

    @staticmethod
    def _on_writer() -> bool:
        return threading.current_thread().name.startswith("tg-db-write")

    def after_execute(
        self, _conn: Any, cursor: Any, statement: str, _params: Any, _ctx: Any, _many: bool
    ) -> None:
        if not self._on_writer():
            return
        sql = " ".join(statement.split()).lower()
        if sql.startswith("delete from gpu_history"):
            tick = self.live.controller.ticks[PRUNE].started
            self.events.append(("delete", cursor.rowcount, tick))
            if cursor.rowcount > 0 and not self.paused:
                self.paused = True
                self._report_while_deleting()
        elif sql.startswith("insert into agent_cursors"):
            self.events.append(("report",))

    def on_commit(self, _conn: Any) -> None:
        if self._on_writer():
            self.events.append(("commit",))

    def _report_while_deleting(self) -> None:
        """Post a report from another thread and wait until its batch is queued on the
        writer thread (this one, busy with the chunk): handed to the store's executor,
        whose ``submit`` is watched for the group commit's function."""
        executor = self.live.controller.store._writer
        submit = executor.submit
        queued = threading.Event()

        def watched(fn: Any, *args: Any) -> Any:
            if args and "GroupCommitWriter._commit" in getattr(args[0], "__qualname__", ""):
                queued.set()
            return submit(fn, *args)

        executor.submit = watched
        try:
            self.report_thread = threading.Thread(target=self.post_report, daemon=True)
            self.report_thread.start()
            assert queued.wait(timeout=30), "the report's batch never reached the writer"
        finally:
            del executor.submit  # the class's own again

    def deletes(self) -> list[tuple[int, int]]:
        """(rows, tick) of each DELETE that removed rows."""
        return [(e[1], e[2]) for e in self.events if e[0] == "delete" and e[1] > 0]


def test_a_history_backlog_drains_in_chunks_over_ticks_while_reports_are_stored(
    controller_factory: Any, ctl_report: Any, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "HISTORY_PRUNE_INTERVAL_S", 0.05)
    live = controller_factory(history_retention_s=3600.0)
    live.controller.history_prune_chunk_rows = CHUNK
    live.controller.history_prune_max_chunks = MAX_CHUNKS
    live.report(ctl_report("n1", 0, gpus=2, samples=1))  # the node's row; 2 fresh rows
    fresh = stored(db_url, "SELECT count(*) FROM gpu_history")
    assert fresh == 2

    with WriterLog(live, lambda: live.report(ctl_report("n1", 1, gpus=2, samples=1))) as log:
        old = time.time() - 30 * 86_400
        engine = make_engine(db_url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    GpuHistory.__table__.insert(),
                    [
                        {
                            "node_name": "n1",
                            "gpu_index": i % 2,
                            "start_unix_s": old + i,
                            "end_unix_s": old + i + 1,
                            "samples": 1,
                            "throttle_reasons_mask": 0,
                        }
                        for i in range(BACKLOG)
                    ],
                )
        finally:
            engine.dispose()
        cutoff = time.time() - 3600.0
        wait_for(
            lambda: (
                stored(db_url, "SELECT count(*) FROM gpu_history WHERE end_unix_s < :t", t=cutoff)
                == 0
            ),
            timeout_s=30,
        )
        live.wait_ticks(PRUNE)  # the last tick's statements are all logged
    assert log.report_thread is not None
    log.report_thread.join(timeout=30)
    events = list(log.events)

    # Every row of the backlog went, no chunk larger than asked, a few chunks per tick.
    deletes = log.deletes()
    assert sum(rows for rows, _ in deletes) == BACKLOG
    assert max(rows for rows, _ in deletes) <= CHUNK
    per_tick: dict[int, int] = {}
    for _, tick in deletes:
        per_tick[tick] = per_tick.get(tick, 0) + 1
    assert max(per_tick.values()) <= MAX_CHUNKS
    assert len(per_tick) >= -(-BACKLOG // CHUNK) // MAX_CHUNKS  # several ticks

    # Each chunk is a transaction of its own: a COMMIT between any two DELETEs.
    positions = [i for i, e in enumerate(events) if e[0] == "delete" and e[1] > 0]
    for a, b in itertools.pairwise(positions):
        assert ("commit",) in events[a:b], events[a : b + 1]
    # The report that arrived during the first chunk was stored before the second one.
    assert ("report",) in events[positions[0] : positions[1]], events[: positions[1] + 1]

    # The reports' own rows are kept: fresh ones are not pruned.
    assert stored(db_url, "SELECT count(*) FROM gpu_history") == 4


@pytest.mark.usefixtures("fast_remediation_engine")
def test_a_job_that_left_memory_is_answered_from_the_database(
    controller_factory: Any, ctl_report: Any, db_url: str, tmp_path: Any
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(ALERT_ONLY)
    live = controller_factory(job_retention_s=1.0, policy_file=policy)
    ended = ["old-a", "old-b", "old-c"]
    live.report(ctl_report("n1", 0, gpus=4, samples=1, job=job_records([*ended, "held"], world=4)))
    live.report(
        ctl_report("n1", 1, gpus=4, samples=1, job=job_records(ended, world=4, exited=True))
    )
    open_incident(live, "comm_failure", job="held")  # keeps "held" in memory
    wait_for(lambda: live.controller.state.jobs.keys() == {"held"})

    # Yesterday's job: its stored ranks, world size and last step, marked as history.
    job = live.read("/api/v1/jobs/old-b")
    assert (job["name"], job["state"], job["source"]) == ("old-b", "ended", "history")
    assert (job["world_size"], job["last_step"], job["ranks_reporting"]) == (4, 2, 0)
    assert job["nodes"] == ["n1"]
    assert [(r["rank"], r["node"], r["state"]) for r in job["ranks"]] == [
        (rank, "n1", "exited") for rank in range(4)
    ]
    held = live.read("/api/v1/jobs/held")
    assert (held["state"], held["source"], held["open_incidents"]) == ("running", "live", 1)
    missing = http_calls.get(
        f"{live.url}/api/v1/jobs/never-ran", headers=live.headers("viewer"), timeout=10
    )
    assert missing.status_code == 404, missing.text

    # The list: only memory by default; every stored job, by name and paged, on request.
    listed = live.read("/api/v1/jobs")
    assert ([j["name"] for j in listed["data"]], listed["count"]) == (["held"], 1)
    everything = live.read("/api/v1/jobs", history="true")
    assert everything["count"] == 4
    assert [(j["name"], j["source"]) for j in everything["data"]] == [
        ("held", "live"),
        ("old-a", "history"),
        ("old-b", "history"),
        ("old-c", "history"),
    ]
    assert everything["data"][2] == {k: v for k, v in job.items() if k != "ranks"}
    page = live.read("/api/v1/jobs", history="true", limit=2, offset=1)
    assert ([j["name"] for j in page["data"]], page["count"]) == (["old-a", "old-b"], 4)
