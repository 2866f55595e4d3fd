"""Partitions and mass failures (pure), and the Node cache that gives the second signal."""

from __future__ import annotations

from controller.actuators.k8s.partition import (
    NodeSignals,
    PartitionSettings,
    classify,
    quarantine_limit,
)
from controller.actuators.k8s.watch import NodeCache
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import cluster, kube_on, node, run

__all__ = ["cluster"]
S = PartitionSettings(silent_after_s=30, mass_silence_share=0.3, mass_silence_min_nodes=3)


def fleet(n: int, **silent: NodeSignals) -> list[NodeSignals]:
    return [silent.get(f"n{i}", NodeSignals(name=f"n{i}", silent_for_s=1)) for i in range(n)]


def test_silent_but_ready_is_unreachable_until_a_second_signal() -> None:
    quiet = NodeSignals(name="n3", silent_for_s=90, node_ready=True, pods_running=True)
    v = classify(fleet(10, n3=quiet), S)
    assert v.states["n3"] == "unreachable" and v.act_on == [] and not v.mass_silence
    assert "waiting for a second signal" in v.summary
    for second in (
        NodeSignals(name="n3", silent_for_s=90, node_ready=False),
        NodeSignals(name="n3", silent_for_s=90, node_ready=True, ranks_failing=True),
        NodeSignals(name="n3", silent_for_s=90, node_ready=True, pods_running=False),
    ):
        v = classify(fleet(10, n3=second), S)
        assert v.states["n3"] == "lost" and v.act_on == ["n3"]


def test_many_silent_at_once_acts_on_nobody() -> None:
    dead = {f"n{i}": NodeSignals(name=f"n{i}", silent_for_s=60, node_ready=False) for i in range(3)}
    v = classify(fleet(10, **dead), S)
    assert v.mass_silence and v.act_on == [] and "controller's side" in v.summary
    v = classify(fleet(10, n0=dead["n0"], n1=dead["n1"]), S)  # 2 of 10: below the bar
    assert not v.mass_silence and v.act_on == ["n0", "n1"]


def test_quarantine_limit_is_a_share_of_the_fleet_and_at_least_one() -> None:
    ten = PartitionSettings(max_quarantine_share=0.1, window_s=100)
    assert quarantine_limit(ten, 20) == 2 and quarantine_limit(ten, 29) == 2
    assert quarantine_limit(ten, 30) == 3  # 0.1 * 30 is not 2.9999...
    assert quarantine_limit(S, 3) == 1 and quarantine_limit(S, 0) == 1  # small fleets: one


def test_node_cache_watches_with_bookmarks_and_relists_on_410(cluster: FakeCluster) -> None:
    node(cluster, "gpu-a")
    cache = NodeCache(kube_on(cluster))
    run(cache.relist())
    assert cache.ready == {"gpu-a": True} and cache.relists == 1
    with cluster.lock:
        n = cluster.objects[("", "nodes", "", "gpu-a")]
    cluster.put(
        "", "nodes", {**n, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    run(cache.watch_once(timeout_s=1))
    assert cache.ready == {"gpu-a": False} and cache.relists == 1
    assert ("", "nodes", "watch") in cluster.served
    cluster.compact()
    node(cluster, "gpu-b")
    run(cache.watch_once(timeout_s=1))  # 410 Gone: the cache relists
    assert cache.relists == 2 and cache.ready == {"gpu-a": False, "gpu-b": True}
