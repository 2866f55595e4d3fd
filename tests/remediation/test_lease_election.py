"""Lease leader election wired (issue 18): two real controllers against the fake API server.

Each ``Controller`` is built by ``compose`` from settings alone (``leader_election_backend:
lease``, ``actuator: kubernetes``). Controller A reaches the API server through a TCP
proxy the test can cut: a partitioned leader. A must stop acting (its actuator fenced, its
tasks stopped) at its renew deadline, *before* the Lease can expire for B; B takes over
after observing the Lease unrenewed for ``leaseDurationSeconds``; and when A's network
comes back, the deposed A writes nothing to the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.actuators.k8s.api import Fenced
from controller.runtime import Controller
from controller.services.lease_lock import LEASE_RULES, build_leader_lock, lease_backend
from controller.settings import ControllerSettings
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node

__all__ = ["cluster"]

TOKENS = [{"name": "ops", "role": "operator", "token": "o" * 20}]
DURATION_S, DEADLINE_S, RENEW_S = 4.0, 2.5, 0.3


class Proxy:
    """A TCP proxy to the fake API server; :meth:`cut` makes it refuse (reset) every
    connection, old and new, like a network partition between one replica and the API."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                conn.close()
                continue
            up = socket.create_connection(self.upstream)
            with self._lock:
                self._conns += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture
def proxy(cluster: FakeCluster) -> Iterator[Proxy]:
    p = Proxy(cluster.url)
    yield p
    p.close()


def node_annotations(cluster: FakeCluster, name: str) -> dict[str, str]:
    obj = cluster.get("", "nodes", "", name)
    assert obj is not None
    return dict(obj["metadata"].get("annotations") or {})


def settings(tmp_path: Path, name: str, api_url: str) -> ControllerSettings:
    return ControllerSettings(
        database_url=f"sqlite:///{tmp_path / (name + '.db')}",
        tokens=TOKENS,
        actuator="kubernetes",
        kube_namespace=NS,
        kube_api_url=api_url,
        leader_election_backend="lease",
        leader_lease_namespace=NS,
        leader_identity=name,
        leader_lease_duration_s=DURATION_S,
        leader_lease_renew_deadline_s=DEADLINE_S,
        leader_check_interval_s=RENEW_S,
        leader_retry_interval_s=RENEW_S,
    )


def test_auto_is_the_database_outside_a_pod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    auto = ControllerSettings(database_url=f"sqlite:///{tmp_path / 'x.db'}", tokens=TOKENS)
    assert auto.leader_election_backend == "auto" and not lease_backend(auto)
    lock, lease = build_leader_lock(auto)
    assert lease is None and lock.description.startswith("flock ")


def test_bad_lease_timings_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must stop acting before its Lease can expire"):
        ControllerSettings(
            database_url=f"sqlite:///{tmp_path / 'x.db'}",
            tokens=TOKENS,
            leader_election_backend="lease",
            leader_lease_duration_s=5,
            leader_lease_renew_deadline_s=6,
        )


def test_deposed_leader_stops_acting_before_the_lease_expires(
    cluster: FakeCluster, proxy: Proxy, tmp_path: Path
) -> None:
    node(cluster, "gpu-1")
    node(cluster, "gpu-2")

    async def scenario() -> dict[str, float]:
        t: dict[str, float] = {}
        a = Controller(settings(tmp_path, "a", proxy.url))
        b = Controller(settings(tmp_path, "b", cluster.url))

        def stopped(reason: str) -> None:
            t.setdefault("a_stopped", time.monotonic())

        a.on_leadership_lost = stopped
        await a.start()
        assert a.acting
        await b.start()
        try:
            assert a.acting and not b.acting
            assert a.leader.lock.description.startswith(f"lease {NS}/trainguard as a + flock ")
            act_a, act_b = a.remediation.actuator, b.remediation.actuator
            assert act_a is not None and act_b is not None
            # The leader writes to the cluster, fenced by its Lease generation.
            await act_a.isolate_node("gpu-1", reason="test: leader writes")
            fence = node_annotations(cluster, "gpu-1")
            assert fence["trainguard.io/fence"] == "0"
            # A standby's actuator refuses to write at all.
            with pytest.raises(Fenced):
                await act_b.isolate_node("gpu-2", reason="test: standby")

            proxy.cut()
            t["cut"] = time.monotonic()
            await asyncio.wait_for(b.leader.elected.wait(), DURATION_S * 4)
            t["b_elected"] = time.monotonic()
            assert not a.acting and a.leader.role == "lost"
            # A's network heals: the deposed leader still writes nothing.
            proxy.heal()
            with pytest.raises(Fenced):
                await act_a.isolate_node("gpu-2", reason="test: deposed leader")
            assert "trainguard.io/unhealthy" not in str(cluster.get("", "nodes", "", "gpu-2"))
            # The new leader does, under the next generation.
            await act_b.isolate_node("gpu-2", reason="test: new leader")
            fence = node_annotations(cluster, "gpu-2")
            assert fence["trainguard.io/fence"] == "1"
        finally:
            await b.stop()
            await a.stop()
        return t

    t = asyncio.run(scenario())
    stopped, elected = t["a_stopped"] - t["cut"], t["b_elected"] - t["cut"]
    # A stops within its renew deadline (plus one renew period to notice) …
    assert stopped <= DEADLINE_S + RENEW_S + 0.5, t
    # … and before B may take over, which needs the whole lease duration unrenewed.
    assert stopped < elected, t
    assert elected >= DURATION_S - RENEW_S, t
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["holderIdentity"] in ("b", "")
    assert lease["spec"]["leaseTransitions"] == 1
    # Exactly the verbs the chart grants for Leases were used (create, get, update).
    used = {verb for group, resource, verb in cluster.served if resource == "leases"}
    assert used == {v for rule in LEASE_RULES for v in rule["verbs"]}
