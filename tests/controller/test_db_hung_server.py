"""The controller against a PostgreSQL server that is connected but hung, or a network that
silently drops (the 3 a.m. failover), and against a statement the server can never run.

A hung COMMIT or write is a real lock held by a second session of the test (``LOCK TABLE
gpu_history IN EXCLUSIVE MODE``: every report inserts there, the readiness query reads
nothing there); the server itself is never stopped or reconfigured.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event, text
from sqlalchemy.engine import make_url

from tests import http_calls
from tests.controller import test_db_outage_sweep
from tests.controller.db_reads import stored
from tests.controller.test_db_outage_sweep import PgProxy
from tests.waiting import wait_for

#: The outage sweep's TCP proxy, as a fixture of this module too.
pg_proxy = test_db_outage_sweep.pg_proxy

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("db_url", ["postgres"], indirect=True),
]


@contextlib.contextmanager
def _table_locked(db_url: str, table: str) -> Iterator[Connection]:
    """Hold ``table``'s EXCLUSIVE lock in a transaction of another session until the block
    ends (rolled back): every write to it waits, reads go on."""
    from controller.db.session import make_engine

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            conn.execute(text(f"LOCK TABLE {table} IN EXCLUSIVE MODE"))
            try:
                yield conn
            finally:
                conn.rollback()
    finally:
        engine.dispose()


def _post(live: Any, body: dict[str, Any], timeout: float = 30) -> Any:
    return http_calls.post(
        f"{live.url}/api/v1/reports", json=body, headers=live.headers("agent"), timeout=timeout
    )


def _post_together(live: Any, make: Any, nodes: list[str], seq: int) -> list[Any]:
    """One report of each node, sent at once (so they share a group-commit batch)."""
    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
        return list(pool.map(lambda n: _post(live, make(n, seq, gpus=1, samples=1)), nodes))


def _tcp_options(sock: socket.socket) -> dict[str, int]:
    return {
        "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    }


def _socket_options_of_engine_connection(url: str) -> dict[str, int]:
    """The TCP options the kernel holds for a connection the engine really opened."""
    from controller.db.session import make_engine

    engine = make_engine(url)
    try:
        raw = engine.raw_connection()
        try:
            fd = raw.driver_connection.fileno()
            with socket.socket(fileno=fd) as sock:
                try:
                    return _tcp_options(sock)
                finally:
                    sock.detach()  # the fd stays psycopg's
        finally:
            raw.close()
    finally:
        engine.dispose()


def test_pool_connections_carry_keepalives_and_tcp_user_timeout_unless_the_url_says(
    db_url: str, pg_proxy: PgProxy
) -> None:
    """A partition under an in-flight query left it waiting for the kernel's retransmission
    limit (~15 minutes), the group commit with it: the pool's connections had no TCP
    keepalives and no ``tcp_user_timeout``. Read back from the kernel for a connection made
    through the engine (through the proxy too: what a controller pointed elsewhere gets);
    a parameter in the URL wins over the default."""
    from controller.db.session import PG_KEEPALIVES

    assert _socket_options_of_engine_connection(db_url) == PG_KEEPALIVES
    assert _socket_options_of_engine_connection(pg_proxy.url(db_url)) == PG_KEEPALIVES
    url = make_url(db_url).update_query_dict({"keepalives_idle": "42", "tcp_user_timeout": "4321"})
    own = _socket_options_of_engine_connection(url.render_as_string(hide_password=False))
    assert own == {**PG_KEEPALIVES, "keepalives_idle": 42, "tcp_user_timeout": 4321}


def test_a_write_the_server_never_finishes_is_cancelled_once_per_batch_and_answered_503(
    db_url: str, controller_factory: Any, ctl_report: Any, caplog: Any
) -> None:
    """A write waiting for a lock held elsewhere (as a COMMIT waiting for a lost synchronous
    replica) held the group commit, and every report, for ever: no statement timeout. Now it
    is cancelled after ``database_statement_timeout_s``, the batch's reports get 503 with
    Retry-After, and the batch is not retried report by report (one more timeout each, in a
    row, on a hung server); once the lock is gone the agents' resends are stored."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="controller.writer")
    live = controller_factory(
        database_statement_timeout_s=0.5,
        database_write_stalled_after_s=600,
        ingest_flush_interval_s=1.0,
    )
    nodes = ["n0", "n1", "n2"]
    assert [r.status_code for r in _post_together(live, ctl_report, nodes, 0)] == [200] * 3
    # A write that fails is rolled back on the store's writer thread (one that commits is
    # not): count those while the lock is held.
    failed_writes: list[str] = []

    def count(_conn: Any) -> None:
        if threading.current_thread().name.startswith("tg-db-write"):
            failed_writes.append(threading.current_thread().name)

    engine = live.controller.store.engine
    event.listen(engine, "rollback", count)
    try:
        with _table_locked(db_url, "gpu_history"):
            caplog.clear()
            replies = _post_together(live, ctl_report, nodes, 1)
            messages = [r.getMessage() for r in caplog.records]
            failed_batches = messages.count("group commit failed")
    finally:
        event.remove(engine, "rollback", count)
    assert [r.status_code for r in replies] == [503] * len(nodes), [r.text for r in replies]
    assert {r.headers["retry-after"] for r in replies} == {"1"}
    assert all("statement timeout" in r.json()["detail"] for r in replies), replies[0].text
    # One cancelled transaction per failed batch, none per report of it.
    assert failed_batches and len(failed_writes) == failed_batches, failed_writes
    # Logged once, as the outage it is, not once per refused report.
    assert messages.count("request failed") == 0, messages
    assert sum(m.startswith("database unavailable") for m in messages) == 1, messages

    # The agents' spools send them again.
    assert [r.status_code for r in _post_together(live, ctl_report, nodes, 1)] == [200] * 3
    assert stored(db_url, "SELECT count(*) FROM gpu_history") == 2 * len(nodes)


def test_readyz_is_503_while_a_write_hangs_and_ready_again_when_it_ends(
    db_url: str, controller_factory: Any, ctl_report: Any
) -> None:
    """A hung server still answers the readiness query on another connection, so a replica
    whose group commit was wedged stayed Ready while reports piled up. Now ``/readyz`` says
    503 with one line while a write has been in flight past
    ``database_write_stalled_after_s``; liveness stays 200 (a restart would not help); the
    report is stored once the write goes through."""
    live = controller_factory(
        database_statement_timeout_s=120,  # a hang guard: the lock is released below
        database_write_stalled_after_s=0.3,
    )
    assert _post(live, ctl_report("n0", 0, gpus=1, samples=1)).status_code == 200
    assert http_calls.get(f"{live.url}/readyz", timeout=10).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _table_locked(db_url, "gpu_history"):
            reply = pool.submit(_post, live, ctl_report("n0", 1, gpus=1, samples=1), 60)
            not_ready = wait_for(
                lambda: (
                    (r := http_calls.get(f"{live.url}/readyz", timeout=10)).status_code == 503 and r
                )
            )
            detail = not_ready.json()["detail"]
            assert detail.startswith("database write stalled: one has been in flight for "), detail
            assert "\n" not in detail
            assert http_calls.get(f"{live.url}/healthz", timeout=10).status_code == 200
            assert not reply.done()
        assert reply.result(timeout=60).status_code == 200
    wait_for(lambda: http_calls.get(f"{live.url}/readyz", timeout=10).status_code == 200)
    assert stored(db_url, "SELECT count(*) FROM gpu_history") == 2


def test_a_report_over_a_server_limit_is_422_and_the_agent_sets_it_aside(
    db_url: str, controller_factory: Any, ctl_report: Any
) -> None:
    """SQLSTATE class 54 (program limit exceeded: a row or index entry too big, a statement
    too complex) was answered 503, so the agent resent that report for ever; it is the
    report's fault: 422 with a line that says so, its batch-mates stored, and the agent's
    reporter moves a 422 to ``rejected/`` instead of retrying it. The server's own error,
    raised by a trigger in this test's database for one node's rows."""
    from agents.reporter import classify
    from controller.db.session import make_engine

    live = controller_factory(ingest_flush_interval_s=0.5)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "CREATE FUNCTION refuse_big() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                    " IF NEW.node_name = 'big' THEN RAISE EXCEPTION"
                    " 'row is too big: size 9000000, maximum size 8160'"
                    " USING ERRCODE = 'program_limit_exceeded'; END IF; RETURN NEW; END $$"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER refuse_big BEFORE INSERT ON gpu_history"
                    " FOR EACH ROW EXECUTE FUNCTION refuse_big()"
                )
            )
    finally:
        engine.dispose()
    big, fine = _post_together(live, ctl_report, ["big", "n0"], 0)
    assert big.status_code == 422, big.text
    assert "retry-after" not in big.headers
    detail = big.json()["detail"]
    assert detail.startswith("report not stored: the database cannot store this"), detail
    assert "row is too big" in detail and "sending it again will fail again" in detail
    assert classify(big.status_code) == "rejected"
    assert fine.status_code == 200, fine.text
    assert stored(db_url, "SELECT count(*) FROM gpu_history WHERE node_name = 'n0'") == 1
    assert stored(db_url, "SELECT count(*) FROM gpu_history WHERE node_name = 'big'") == 0
