"""The walking skeleton end to end: real controller and agent processes, real faults.

Every number asserted here is exact. What the agents produced is read from what they put
on the wire (the tap in e2e_cluster) and from their spool on disk, never from the
controller under test.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.e2e_cluster import (
    E2ECluster,
    spool_leftovers,
    unsent_sample_times,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def e2e_cluster(tmp_path: Path) -> Iterator[E2ECluster]:
    cluster = E2ECluster(tmp_path, f"sqlite:///{tmp_path / 'tg.db'}")
    try:
        yield cluster
    finally:
        cluster.close()


def _acked_samples(cluster: E2ECluster, node: str, instance: str) -> list[float]:
    return [
        t
        for r in cluster.tap.of_node(node)
        if r.instance == instance and 200 in r.statuses
        for t in r.sample_times
    ]


def assert_nothing_lost(cluster: E2ECluster, node: str) -> int:
    """After ``node``'s agent stopped: every report it made is stored once or still spooled."""
    instance, next_seq, unsent, _journal = spool_leftovers(cluster.spool_dir(node))
    sent = {r.seq: r for r in cluster.tap.of_node(node) if r.instance == instance}
    assert set(range(next_seq)) == set(sent) | unsent, "a report was neither sent nor spooled"
    acked = {seq for seq, r in sent.items() if 200 in r.statuses}
    assert acked == set(range(next_seq)) - unsent, "spool kept an acked report or lost one"
    expected = sum(len(sent[seq].sample_times) for seq in acked)
    assert expected > 0
    assert cluster.stored_samples(node) == expected
    print(f"{node}: {next_seq} reports, {len(unsent)} unsent, {expected} samples stored")
    return expected


def _run_until_reports(cluster: E2ECluster, nodes: list[str], count: int) -> None:
    cluster.wait(
        f"{count} acked reports from {nodes}",
        lambda: all(cluster.acked_reports(n) >= count for n in nodes),
    )


def _stop_agents(cluster: E2ECluster, nodes: list[str]) -> None:
    for node in nodes:
        assert cluster.procs.stop(node) == 0, cluster.procs[node].log_tail(20)


def test_no_sample_lost_across_controller_kill(tmp_path: Path, db_url: str) -> None:
    """On SQLite and PostgreSQL (``db_url``): what the controller acked survives kill -9."""
    cluster, nodes = E2ECluster(tmp_path, db_url), ["node-a", "node-b"]
    try:
        _controller_kill_round(cluster, nodes)
    finally:
        cluster.close()


def _controller_kill_round(cluster: E2ECluster, nodes: list[str]) -> None:
    if cluster.database_url.startswith("postgresql"):
        cluster.upgrade_database()
    cluster.start_controller()
    for node in nodes:
        cluster.start_agent(node)
    _run_until_reports(cluster, nodes, 3)

    cluster.procs.kill("controller", signal.SIGKILL)
    before = {n: spool_leftovers(cluster.spool_dir(n))[1] for n in nodes}
    cluster.wait(
        "agents to keep spooling reports while the controller is dead",
        lambda: all(spool_leftovers(cluster.spool_dir(n))[1] >= before[n] + 3 for n in nodes),
    )
    cluster.start_controller()
    backlog = {n: spool_leftovers(cluster.spool_dir(n))[1] - 1 for n in nodes}
    assert all(any(502 in r.statuses for r in cluster.tap.of_node(n)) for n in nodes)
    cluster.wait(
        "the backlog to be acknowledged",
        lambda: all(
            any(r.seq >= backlog[n] and 200 in r.statuses for r in cluster.tap.of_node(n))
            for n in nodes
        ),
    )
    _stop_agents(cluster, nodes)
    for node in nodes:
        assert_nothing_lost(cluster, node)


def test_no_sample_lost_across_agent_kill(e2e_cluster: E2ECluster) -> None:
    cluster, nodes = e2e_cluster, ["node-a", "node-b"]
    cluster.start_controller()
    for node in nodes:
        cluster.start_agent(node)
    _run_until_reports(cluster, nodes, 3)

    spool = cluster.spool_dir("node-a")
    cluster.wait("node-a to have journaled samples", lambda: bool(spool_leftovers(spool)[3]))
    cluster.procs.kill("node-a", signal.SIGKILL)
    instance, next_seq, unsent, journal = spool_leftovers(spool)
    sent_before = {r.seq: r for r in cluster.tap.of_node("node-a") if r.instance == instance}
    produced_by_kill = [
        *(t for seq in range(next_seq) if seq not in unsent for t in sent_before[seq].sample_times),
        *unsent_sample_times(spool, unsent),
        *journal,
    ]
    assert produced_by_kill

    cluster.start_agent("node-a")
    cluster.wait(
        "the restarted agent to deliver what it had pending",
        lambda: cluster.acked_reports("node-a") >= len(sent_before) + 2,
    )
    _stop_agents(cluster, nodes)
    for node in nodes:
        assert_nothing_lost(cluster, node)
    delivered = _acked_samples(cluster, "node-a", instance)
    assert sorted(produced_by_kill) == sorted(t for t in delivered if t <= max(produced_by_kill))
    print(f"node-a at kill: {len(journal)} journaled, {len(unsent)} unsent reports")
    assert len(set(delivered)) == len(delivered), "a sample was delivered twice"


def _incidents(cluster: E2ECluster, **filters: str) -> list[dict[str, object]]:
    with cluster.api() as api:
        return api.incidents(**filters)


def _health(cluster: E2ECluster) -> dict[str, str]:
    with cluster.api() as api:
        return {n["name"]: n["health"] for n in api.nodes()}


def test_xid79_flags_only_its_node_and_xid45_does_not(e2e_cluster: E2ECluster) -> None:
    cluster = e2e_cluster
    cluster.start_controller()
    cluster.start_agent("node-a", faults=["kind=xid,code=79,gpu=3,at=1"])
    cluster.start_agent("node-b", faults=["kind=xid,code=45,gpu=1,at=1"])
    cluster.start_agent("node-c")
    cluster.wait(
        "a gpu_fault incident for node-a GPU 3",
        lambda: any(
            i["kind"] == "gpu_fault" and i["gpu_index"] == 3
            for i in _incidents(cluster, state="open", node="node-a")
        ),
    )
    cluster.wait(
        "node-b's XID 45 to reach the controller",
        lambda: any(i["node"] == "node-b" for i in _incidents(cluster, state="open")),
    )
    # node-c has no fault to wait for: only for its first report (a loaded machine started
    # its agent last and slowest, and the node was not listed yet).
    cluster.wait("node-c's first report", lambda: "node-c" in _health(cluster))
    health = _health(cluster)
    assert health == {"node-a": "unhealthy", "node-b": "healthy", "node-c": "healthy"}
    # XID 45 is the application's fault (a killed context), not the GPU's: noted, not fatal.
    assert {i["kind"] for i in _incidents(cluster, node="node-b")} == {"application_xid"}
    assert _incidents(cluster, node="node-c") == []
    with cluster.api() as api:
        gpus = {g["index"]: g["health"] for g in api.node("node-a")["gpus"]}
    assert gpus[3] == "unhealthy"
    assert [i for i, h in gpus.items() if h != "healthy"] == [3]


def test_silent_agent_makes_its_node_lost(tmp_path: Path) -> None:
    cluster = E2ECluster(tmp_path, f"sqlite:///{tmp_path / 'tg.db'}", node_lost_after_s=4.0)
    try:
        cluster.start_controller()
        cluster.start_agent("node-a")
        cluster.start_agent("node-b")
        _run_until_reports(cluster, ["node-a", "node-b"], 2)
        cluster.procs.kill("node-a", signal.SIGSTOP)
        cluster.wait("node-a to be lost", lambda: _health(cluster).get("node-a") == "lost")
        assert _health(cluster)["node-b"] == "healthy"
        assert [i["kind"] for i in _incidents(cluster, state="open", node="node-a")] == [
            "node_lost"
        ]
        cluster.procs.kill("node-a", signal.SIGCONT)
        cluster.wait("node-a to recover", lambda: _health(cluster).get("node-a") == "healthy")
    finally:
        cluster.close()
