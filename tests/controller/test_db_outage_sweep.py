"""The controller while its PostgreSQL misbehaves (a failover at 3 a.m.), through a TCP proxy.

A small proxy (:class:`PgProxy`, threads) sits between the controller and the shared
PostgreSQL server, which is never stopped: it forwards ``127.0.0.1:<port>`` to the server and,
on command, cuts every open connection (all, the pool's only or the leader lock's only),
refuses new ones (the port closed: ``ECONNREFUSED``, as a server that is down) or blackholes
traffic (bytes are taken and never delivered: a server that hangs). The controller's
``database_url`` points at the proxy; the checks read the database directly.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests import http_calls
from tests.controller.db_reads import stored as _stored
from tests.waiting import wait_for

#: The proxy is for PostgreSQL's wire protocol: every test here runs on PostgreSQL only.
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("db_url", ["postgres"], indirect=True),
]

#: Marker of the leader lock's session in its startup packet (``application_name``).
LOCK_MARK = b"trainguard-leader"


class _Pair:
    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.lock = False  # the leader lock's session
        self.closed = False
        self.stalled = False  # bytes are taken and dropped, both ways

    def close(self) -> None:
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()


class PgProxy:
    """Forwards 127.0.0.1:<port> to the PostgreSQL server; can cut, refuse and blackhole."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        #: New connections are accepted and never answered (stalled from the start).
        self.blackhole = False
        self._pairs: list[_Pair] = []
        self._mutex = threading.Lock()
        self._listener: socket.socket | None = None
        self.listen()

    # ------------------------------------------------------------------ commands

    def listen(self) -> None:
        """(Re)open the port: new connections are accepted again."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def refuse(self) -> None:
        """Close the port: a new connection is refused, as by a server that is down."""
        sock, self._listener = self._listener, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut(self, which: str = "all") -> int:
        """Reset the open connections (``all``, ``pool`` or ``lock``); how many were cut."""
        chosen = self.sessions(which)
        for pair in chosen:
            pair.close()
        return len(chosen)

    def stall(self, which: str = "all") -> int:
        """Blackhole the open connections (``all``, ``pool`` or ``lock``): each stays open
        and takes every byte, and nothing arrives at either end; how many."""
        chosen = self.sessions(which)
        for pair in chosen:
            pair.stalled = True
        return len(chosen)

    def sessions(self, which: str = "all") -> list[_Pair]:
        """The open connections (``all``, ``pool``: the SQLAlchemy pool's, ``lock``: the
        leader lock's)."""
        with self._mutex:
            return [
                p
                for p in self._pairs
                if not p.closed and (which == "all" or p.lock == (which == "lock"))
            ]

    def url(self, db_url: str) -> str:
        url = make_url(db_url).set(host="127.0.0.1", port=self.port)
        return url.render_as_string(hide_password=False)

    def close(self) -> None:
        self.refuse()
        self.cut()

    # ------------------------------------------------------------------ machinery

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            pair = _Pair(client)
            with self._mutex:
                self._pairs = [p for p in self._pairs if not p.closed] + [pair]
            pair.stalled = self.blackhole
            if not self.blackhole:
                try:
                    pair.upstream = socket.create_connection(self.target, timeout=3)
                    pair.upstream.settimeout(None)
                except OSError:
                    pair.close()
                    continue
                threading.Thread(target=self._pump, args=(pair, True), daemon=True).start()
                threading.Thread(target=self._pump, args=(pair, False), daemon=True).start()
            else:
                threading.Thread(target=self._swallow, args=(pair,), daemon=True).start()

    def _swallow(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while pair.client.recv(65536):
                pass
        pair.close()

    def _pump(self, pair: _Pair, upward: bool) -> None:
        src, dst = (pair.client, pair.upstream) if upward else (pair.upstream, pair.client)
        assert dst is not None and src is not None
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upward and seen < 4096:
                    seen += len(data)
                    if LOCK_MARK in data:
                        pair.lock = True
                if pair.stalled:
                    continue  # taken, never delivered
                dst.sendall(data)
        except OSError:
            pass
        pair.close()


@pytest.fixture
def pg_proxy(db_url: str) -> Iterator[PgProxy]:
    url = make_url(db_url)
    proxy = PgProxy((url.host or "127.0.0.1", url.port or 5432))
    yield proxy
    proxy.close()


def _post_report(live: Any, body: dict[str, Any], timeout: float = 15) -> Any:
    return http_calls.post(
        f"{live.url}/api/v1/reports", json=body, headers=live.headers("agent"), timeout=timeout
    )


def _role(live: Any) -> str:
    return str(live.controller.leader.role)


def test_leader_whose_lock_session_stalls_stops_acting_before_the_server_hands_over(
    db_url: str, pg_proxy: PgProxy, controller_factory: Any, ctl_report: Any
) -> None:
    """A lock session that stops answering (server hung, network black hole) is lost within
        the check interval + 2 s, well before the server frees the lock for another replica
        (8 s). It took 7-12 s: ``wait_for`` waited for psycopg's cancellation of the late query
    (a cancel request and up to 10 s for its answer) before the loss counted."""
    from controller.services.leader import LOST_DETAIL, PG_CHECK_TIMEOUT_S, PG_SERVER_DETECT_S

    url = pg_proxy.url(db_url)
    leader = controller_factory(database_url=url, leader_check_interval_s=0.2)
    leader_lock = pg_proxy.sessions("lock")
    assert len(leader_lock) == 1
    standby = controller_factory(
        database_url=url, leader_check_interval_s=0.2, leader_retry_interval_s=0.2
    )
    assert (_role(leader), _role(standby)) == ("leader", "standby")
    body = ctl_report("n1", 0, gpus=1, samples=1)
    assert _post_report(leader, body).status_code == 200

    stalled_at = time.monotonic()
    leader_lock[0].stalled = True
    wait_for(lambda: _role(leader) == "lost", PG_SERVER_DETECT_S + 6)
    took = time.monotonic() - stalled_at
    assert took < 0.2 + PG_CHECK_TIMEOUT_S + 1.5 < PG_SERVER_DETECT_S, took
    ready = http_calls.get(f"{leader.url}/readyz", timeout=5)
    assert (ready.status_code, ready.json()["detail"]) == (503, LOST_DETAIL)
    refused = _post_report(leader, ctl_report("n1", 1, gpus=1, samples=1))
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
    # The server still holds the lock for the silent session: no second leader yet.
    assert _role(standby) == "standby"
    # The server notices the session is gone (keepalives; here: the proxy resets it).
    leader_lock[0].close()
    wait_for(lambda: _role(standby) == "leader", 10)
    # The agent re-sends what was not acknowledged; the acknowledged report is there.
    again = _post_report(standby, ctl_report("n1", 1, gpus=1, samples=1))
    assert again.status_code == 200 and again.json()["duplicate"] is False
    assert _post_report(standby, body).json()["duplicate"] is True
    assert _stored(db_url, "SELECT count(*) FROM gpu_history WHERE node_name = 'n1'") == 2


class Agent:
    """What the agent's spool does: a report stays until a 200 acknowledges it, and the
    unacknowledged ones are sent again, oldest first."""

    def __init__(self, node: str, make: Any) -> None:
        self.node, self.make = node, make
        self.seq = 0
        self.spool: list[dict[str, Any]] = []
        self.acked: list[int] = []
        self.answers: list[Any] = []

    def tick(self, live: Any) -> None:
        self.spool.append(self.make(self.node, self.seq, gpus=1, samples=1))
        self.seq += 1
        self.flush(live)

    def flush(self, live: Any) -> None:
        while self.spool:
            r = _post_report(live, self.spool[0])
            self.answers.append(r)
            if r.status_code != 200:
                return
            self.acked.append(self.spool.pop(0)["seq"])


def _ticks_failed(live: Any) -> int:
    return sum(t.failed for t in live.controller.ticks.values())


def _loud(caplog: Any) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("controller")
    ]


def test_short_outage_is_503_retry_after_loses_nothing_and_is_logged_once(
    db_url: str, pg_proxy: PgProxy, controller_factory: Any, ctl_report: Any, caplog: Any
) -> None:
    """The pool's connections reset and new ones refused (a PgBouncer or server restart that
    spared the lock session): reports get 503 with Retry-After, readiness drops, an
    operator's isolation is refused whole, the leader keeps leading; afterwards the pool
    reconnects, every report the agents kept is stored, and the log says it once (it said
    it ~8 times per refused report and once per failed tick of each periodic task)."""
    caplog.set_level(logging.INFO)
    live = controller_factory(
        database_url=pg_proxy.url(db_url),
        leader_check_interval_s=0.2,
        node_lost_after_s=60,
        remediation_tick_interval_s=0.1,
    )
    agents = [Agent(f"n{i}", ctl_report) for i in range(4)]
    for agent in agents:
        agent.tick(live)
    caplog.clear()

    pg_proxy.refuse()
    assert pg_proxy.cut("pool") >= 1
    failed_ticks = _ticks_failed(live)
    # The remediation engine reads what earlier leaders did at its first tick, as after a
    # takeover; that read fails every tick during the outage (a periodic task that fails).
    live.controller.remediation._loaded = False
    for _ in range(5):
        for agent in agents:
            agent.tick(live)
    refused = [r for a in agents for r in a.answers[1:]]
    assert {r.status_code for r in refused} == {503}
    assert {r.headers["retry-after"] for r in refused} == {"1"}
    assert all(r.json()["detail"].startswith("report not stored: database") for r in refused)
    ready = wait_for(
        lambda: (r := http_calls.get(f"{live.url}/readyz", timeout=10)).status_code == 503 and r
    )
    assert ready.json()["detail"].startswith("database unreachable")
    assert http_calls.get(f"{live.url}/healthz", timeout=5).status_code == 200
    isolate = http_calls.post(
        f"{live.url}/api/v1/nodes/n0/isolate",
        json={"reason": "drill"},
        headers=live.headers(),
        timeout=10,
    )
    assert (isolate.status_code, isolate.headers.get("retry-after")) == (503, "1"), isolate.text
    command = http_calls.post(
        f"{live.url}/api/v1/nodes/n1/commands",
        json={"kind": "set_power_limit", "gpu_index": 0, "limit_w": 350},
        headers=live.headers(),
        timeout=10,
    )
    assert (command.status_code, command.headers.get("retry-after")) == (503, "1"), command.text
    # The group commit settles: rows of refused reports are given up, nothing spins.
    writer = live.controller.writer
    wait_for(lambda: not writer._carry and not writer._has_work.is_set())
    # Periodic tasks failed ticks against the database meanwhile (the remediation engine).
    wait_for(lambda: _ticks_failed(live) >= failed_ticks + 5)
    assert _role(live) == "leader"

    pg_proxy.listen()
    for agent in agents:
        agent.flush(live)
        assert not agent.spool and agent.acked == list(range(6))
        stored = _stored(
            db_url, "SELECT count(*) FROM gpu_history WHERE node_name = :n", n=agent.node
        )
        assert stored == 6
    node = live.read("/api/v1/nodes/n0")
    assert node.get("isolated_reason") is None
    assert _stored(db_url, "SELECT isolated_reason FROM nodes WHERE name = 'n0'") is None
    assert _stored(db_url, "SELECT count(*) FROM actions WHERE kind = 'isolate_node'") == 0
    assert live.read("/api/v1/commands")["data"] == []
    assert _stored(db_url, "SELECT count(*) FROM commands") == 0
    wait_for(lambda: http_calls.get(f"{live.url}/readyz", timeout=10).status_code == 200)

    loud = _loud(caplog)
    assert loud.count("database available again") == 1, loud
    assert sum(m.startswith("database unavailable") for m in loud) == 1, loud
    # The rest: at most one line per periodic task.
    assert len(loud) <= 2 + len(live.controller.ticks), loud


def test_a_server_that_never_answers_is_503_within_the_connect_timeout_for_a_whole_batch(
    db_url: str, pg_proxy: PgProxy, controller_factory: Any, ctl_report: Any
) -> None:
    """New connections are accepted and never answered (a hung server, a black-holed
    network) and the pool's are gone: every report of a batch is answered 503 once the
    connect timeout (5 s) has passed, inside the agent's 10-s report timeout. Before, a
    connection attempt waited psycopg's default 130 s, and the failed batch was retried
    report by report, one more attempt each, in a row."""
    import concurrent.futures

    from controller.db.session import PG_CONNECT_TIMEOUT_S

    live = controller_factory(database_url=pg_proxy.url(db_url), ingest_flush_interval_s=0.3)
    nodes = [f"n{i}" for i in range(3)]
    for node in nodes:
        assert _post_report(live, ctl_report(node, 0, gpus=1, samples=1)).status_code == 200
    pg_proxy.blackhole = True
    pg_proxy.cut("pool")
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
        replies = list(
            pool.map(
                lambda n: _post_report(live, ctl_report(n, 1, gpus=1, samples=1), timeout=10),
                nodes,
            )
        )
    took = time.monotonic() - started
    assert [r.status_code for r in replies] == [503] * len(nodes), [r.text for r in replies]
    assert {r.headers["retry-after"] for r in replies} == {"1"}
    assert took < PG_CONNECT_TIMEOUT_S + 2.5, took
    assert _role(live) == "leader"  # the lock's session was never touched

    pg_proxy.blackhole = False
    for node in nodes:  # the agents' spools send them again
        assert _post_report(live, ctl_report(node, 1, gpus=1, samples=1)).status_code == 200
    assert _stored(db_url, "SELECT count(*) FROM gpu_history") == 2 * len(nodes)


def test_server_down_fences_the_leader_and_the_standby_takes_over_when_it_is_back(
    db_url: str, pg_proxy: PgProxy, controller_factory: Any, ctl_report: Any, caplog: Any
) -> None:
    """The server goes down (every connection reset, new ones refused) for a few seconds:
    the leader's lock session is gone, so it stops acting at once (503, not ready); the
    standby keeps trying quietly and takes over when the server is back; the agents' spools
    re-send what was not acknowledged and nothing acknowledged is missing."""
    from controller.services.leader import LOST_DETAIL, STANDBY_DETAIL

    caplog.set_level(logging.INFO)
    url = pg_proxy.url(db_url)
    fast = {"leader_check_interval_s": 0.2, "leader_retry_interval_s": 0.2}
    leader = controller_factory(database_url=url, **fast)
    standby = controller_factory(database_url=url, **fast)
    assert (_role(leader), _role(standby)) == ("leader", "standby")
    agents = [Agent(f"n{i}", ctl_report) for i in range(3)]
    for agent in agents:
        agent.tick(leader)
    caplog.clear()

    pg_proxy.refuse()
    pg_proxy.cut()
    wait_for(lambda: _role(leader) == "lost", 5)
    for agent in agents:
        agent.tick(leader)
        agent.flush(standby)
    answers = [r for a in agents for r in a.answers[1:]]
    assert {r.status_code for r in answers} == {503}
    assert {r.headers["retry-after"] for r in answers} == {"1"}
    assert {r.json()["detail"] for r in answers} == {LOST_DETAIL, STANDBY_DETAIL}
    for live in (leader, standby):
        assert http_calls.get(f"{live.url}/healthz", timeout=5).status_code == 200
    assert http_calls.get(f"{leader.url}/readyz", timeout=10).json()["detail"] == LOST_DETAIL
    not_ready = wait_for(
        lambda: (r := http_calls.get(f"{standby.url}/readyz", timeout=10)).status_code == 503 and r
    )
    assert not_ready.json()["detail"].startswith("database unreachable")
    # The standby tries the lock every 0.2 s meanwhile, failing each time: let it fail
    # 6 times (as through a long outage) before the server comes back.
    lock = standby.controller.leader.lock
    tries = [0]
    try_acquire = lock.try_acquire

    async def counted() -> bool:
        tries[0] += 1
        return bool(await try_acquire())

    lock.try_acquire = counted
    wait_for(lambda: tries[0] >= 6)
    pg_proxy.listen()
    wait_for(lambda: _role(standby) == "leader", 10)
    assert _role(leader) == "lost"
    for agent in agents:
        agent.tick(standby)
        assert not agent.spool and agent.acked == [0, 1, 2], agent.acked
        stored = _stored(
            db_url, "SELECT count(*) FROM gpu_history WHERE node_name = :n", n=agent.node
        )
        assert stored == 3
    wait_for(lambda: http_calls.get(f"{standby.url}/readyz", timeout=10).status_code == 200)
    loud = _loud(caplog)
    for line in (
        "lost leadership: stopping all actions",
        "took over as leader",
        "database available again",
        "database unavailable: writes and reads fail (503) until it answers again",
    ):
        assert loud.count(line) == 1, loud
    # Each distinct failure of the standby's tries once (the reset, then the refusals).
    assert loud.count("leader election: cannot reach the lock") <= 2, loud
    assert len(loud) <= 6, loud
