"""Leader election: two controller replicas on one database never both act.

The replicas are real ``trainguard controller`` processes on the same SQLite file or
PostgreSQL database. What is checked is what a second acting replica would break: a node
that goes silent must give exactly one ``node_lost`` incident row, before and after the
leader is killed and the standby takes over.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from controller.db.models import Incident
from controller.db.session import make_engine
from controller.services.leader import (
    LOST_DETAIL,
    STANDBY_DETAIL,
    STARTING_DETAIL,
    FileLock,
    LeadershipLost,
)
from tests import http_calls
from tests.environ import clean_env
from trainguard.cli.procs import Child, ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

NODE_LOST_AFTER_S = 2.0
#: Generous bound on takeover after ``kill -9`` of the leader (measured: see the output).
FAILOVER_BOUND_S = 15.0

Report = Callable[..., dict[str, Any]]


class Replica:
    """One controller process and its HTTP address."""

    def __init__(self, child: Child, port: int, tokens: dict[str, str]) -> None:
        self.child = child
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {tokens['operator']}"}
        self.agent_headers = {"Authorization": f"Bearer {tokens['agent']}"}

    def readyz(self) -> tuple[int, str]:
        try:
            reply = http_calls.get(f"{self.url}/readyz", timeout=2.0)
        except httpx.TransportError:
            return 0, "unreachable"
        return reply.status_code, str(reply.json().get("detail", ""))

    def status(self) -> dict[str, Any]:
        reply = http_calls.get(f"{self.url}/api/v1/status", headers=self.headers, timeout=5.0)
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def post_report(self, body: dict[str, Any]) -> httpx.Response:
        return http_calls.post(f"{self.url}/api/v1/reports", json=body, headers=self.agent_headers)

    def leader_gauge(self) -> float:
        text = http_calls.get(f"{self.url}/metrics", timeout=5.0).text
        line = next(x for x in text.splitlines() if x.startswith("trainguard_controller_leader "))
        return float(line.split()[1])


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[[str], Replica]]:
    """Start ``trainguard controller`` processes that share their tokens."""
    tokens = {role: secrets.token_urlsafe(24) for role in ("agent", "operator")}
    configured = [{"name": f"t-{r}", "role": r, "token": t} for r, t in tokens.items()]
    env = clean_env()
    env |= {
        "TRAINGUARD_TOKENS": json.dumps(configured),
        "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",  # one agent token, many nodes
        "TRAINGUARD_NODE_LOST_AFTER_S": str(NODE_LOST_AFTER_S),
        "TRAINGUARD_LOG_LEVEL": "info",
    }
    with ProcessSet(tmp_path / "logs") as procs:

        def start(database_url: str) -> Replica:
            port = free_port()
            name = f"controller-{len(procs.children)}"
            argv = cli_argv(
                *("controller", "--host", "127.0.0.1", "--port", str(port)),
                *("--database-url", database_url),
            )
            replica = Replica(procs.start(name, argv, env=env), port, tokens)
            # Up: it answers and its first try for the lock has ended (leader or standby).
            up = wait_until(
                lambda: (
                    replica.readyz() not in ((0, "unreachable"), (503, STARTING_DETAIL))
                    or not replica.child.alive()
                ),
                timeout_s=60,
            )
            assert up and replica.child.alive(), replica.child.log_tail(30)
            return replica

        yield start


def node_lost_rows(database_url: str, node: str) -> int:
    engine = make_engine(database_url, **({} if "sqlite" in database_url else {"pool_size": 1}))
    try:
        with engine.connect() as conn:
            query = select(func.count()).where(
                Incident.kind == "node_lost", Incident.node_name == node
            )
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def migrate_if_postgres(database_url: str) -> None:
    if database_url.startswith("postgresql"):
        from controller.db.migrate import upgrade

        upgrade(database_url)  # PostgreSQL is never migrated by the controller itself


@pytest.mark.slow
def test_one_replica_acts_and_the_standby_takes_over_after_kill_9(
    db_url: str, replicas: Callable[[str], Replica], ctl_report: Report
) -> None:
    migrate_if_postgres(db_url)
    first = replicas(db_url)
    assert first.readyz() == (200, "")
    assert first.post_report(ctl_report("n1", 0, gpus=2, samples=1)).status_code == 200

    # Started after n1 is in the database: if it acted, it would load n1 and, when n1 stays
    # silent, open a second node_lost incident of its own.
    second = replicas(db_url)
    # A healthy standby is Ready (rollouts finish); it leads by the gauge, not by /readyz.
    assert second.readyz() == (200, "")
    assert (first.status()["leader"], second.status()["leader"]) == (True, False)
    assert (first.leader_gauge(), second.leader_gauge()) == (1.0, 0.0)
    refused = second.post_report(ctl_report("n1", 1, gpus=2, samples=1))
    assert refused.status_code == 503 and refused.json()["detail"] == STANDBY_DETAIL
    assert refused.headers["retry-after"] == "1"

    assert wait_until(lambda: node_lost_rows(db_url, "n1") == 1, timeout_s=15)
    time.sleep(NODE_LOST_AFTER_S + 1.5)  # room for a wrongly acting standby to duplicate it
    assert node_lost_rows(db_url, "n1") == 1
    assert second.leader_gauge() == 0.0

    first.child.send(signal.SIGKILL)
    first.child.popen.wait()
    killed = time.monotonic()
    took_over = wait_until(lambda: second.leader_gauge() == 1.0, timeout_s=FAILOVER_BOUND_S)
    failover_s = time.monotonic() - killed
    print(f"\nfailover ({db_url.split(':')[0]}): standby leads {failover_s:.2f} s after kill -9")
    assert took_over, second.child.log_tail(30)
    assert second.status()["leader"] is True
    assert second.leader_gauge() == 1.0

    # The new leader acts: its own node goes silent and gets its incident ...
    assert second.post_report(ctl_report("n2", 0, gpus=2, samples=1)).status_code == 200
    assert wait_until(lambda: node_lost_rows(db_url, "n2") == 1, timeout_s=15)
    # ... and it loaded n1's open incident instead of opening another.
    assert node_lost_rows(db_url, "n1") == 1


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_leader_whose_lock_session_is_terminated_stops_acting(
    db_url: str, controller_factory: Any, ctl_report: Report
) -> None:
    import psycopg

    live = controller_factory(node_lost_after_s=3.0, leader_check_interval_s=0.5)
    controller = live.controller
    assert controller.leader.is_leader
    backend_pid = controller.leader.lock.backend_pid
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    # n1's last report goes in right before the kill (the admin connection made first: on a
    # loaded machine connecting took seconds, and a leader that n1's silence passed
    # node_lost_after_s *before it could know* it had lost the lock rightly opened node_lost).
    with psycopg.connect(dsn, autocommit=True) as admin:
        reply = http_calls.post(
            f"{live.url}/api/v1/reports",
            json=ctl_report("n1", 0, gpus=2, samples=1),
            headers=live.headers("agent"),
        )
        assert reply.status_code == 200
        reported = time.monotonic()
        admin.execute("SELECT pg_terminate_backend(%s)", (backend_pid,))
    killed = time.monotonic()
    assert wait_until(lambda: controller.leader.role == "lost", timeout_s=5)
    noticed = time.monotonic()
    print(f"\nlock session terminated: stopped acting after {noticed - killed:.2f} s")
    assert noticed - reported < 3.0 - 0.5, "too slow to notice for this test to judge"

    ready = http_calls.get(f"{live.url}/readyz")
    assert (ready.status_code, ready.json()["detail"]) == (503, LOST_DETAIL)
    assert http_calls.get(f"{live.url}/healthz").status_code == 200
    refused = http_calls.post(
        f"{live.url}/api/v1/reports",
        json=ctl_report("n1", 1, gpus=2, samples=1),
        headers=live.headers("agent"),
    )
    assert refused.status_code == 503
    # n1 has been silent past node_lost_after_s: a leader still acting would open node_lost.
    time.sleep(max(0.0, reported + 3.0 + 1.5 - time.monotonic()))
    assert node_lost_rows(db_url, "n1") == 0
    assert not controller.leader.is_leader


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_controller_process_exits_75_when_its_lock_session_dies(
    db_url: str, replicas: Callable[[str], Replica]
) -> None:
    import psycopg

    migrate_if_postgres(db_url)
    replica = replicas(db_url)
    assert replica.readyz() == (200, "")
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    database = dsn.rsplit("/", 1)[1]
    with psycopg.connect(dsn, autocommit=True) as admin:
        terminated = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'trainguard-leader' AND datname = %s",
            (database,),
        ).fetchall()
    assert terminated == [(True,)]
    assert wait_until(lambda: not replica.child.alive(), timeout_s=10)
    assert replica.child.popen.returncode == 75, replica.child.log_tail(20)
    assert "lost the leader lock" in replica.child.log_tail(20)


def test_file_lock_is_exclusive_and_notices_a_replaced_lock_file(tmp_path: Path) -> None:
    import asyncio

    async def scenario() -> None:
        path = tmp_path / "trainguard.db.leader"
        first, second = FileLock(path), FileLock(path)
        assert await first.try_acquire()
        assert not await second.try_acquire()  # separate opens conflict, even in one process
        await first.check()
        path.unlink()
        with pytest.raises(LeadershipLost, match="deleted"):
            await first.check()
        await first.release()
        assert await second.try_acquire()
        await second.release()

    asyncio.run(scenario())
