"""Where a gang runs while some of its pods are not Running, and which nodes can take it.

On a real cluster the pod on the failed node is rarely Running when trainguard acts: a
rank crash under ``restartPolicy: Never`` leaves it Failed, a node that stopped answering
leaves it Terminating (stuck), a pod can sit Pending on its node or be Unknown. Such a pod
is still the gang's and its node the one to move off; only pods that no longer exist (or
a newer generation's) make the ranks' reports stale. Found by the k8s acceptance probe:
``current_placement`` raised "has no trainguard.io/rank label" or reported a smaller gang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from controller.actuators.base import ActuatorError
from controller.actuators.kubernetes import KubernetesActuator
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, node, pod, run
from tests.actuators.test_k8s_workloads import jobset_doc
from trainguard.wire import RankEvent

__all__ = ["cluster"]

JOB = {"trainguard.io/job": "llm"}


def actuator(c: FakeCluster) -> KubernetesActuator:
    cfg = client.Configuration(host=c.url)
    cfg.retries = 0
    return KubernetesActuator(client.ApiClient(cfg), NS, settle_timeout_s=2, poll_interval_s=0.05)


def launch(c: FakeCluster, *, tolerations: list[dict[str, Any]] | None = None) -> None:
    """A JobSet of 2 pods (gpu-a, gpu-b), 2 torchrun ranks each, no rank labels."""
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        node(c, n)
    doc = jobset_doc("llm", replicas=2, max_restarts=3)
    doc["metadata"]["labels"] = dict(JOB)
    template = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    template["metadata"] = {"labels": dict(JOB), "annotations": {"trainguard.io/generation": "2"}}
    if tolerations:
        template["spec"]["tolerations"] = tolerations
    c.put("jobset.x-k8s.io", "jobsets", doc)
    assert c.reconcile_jobset(NS, "llm") == "created"


def gang(c: FakeCluster) -> list[dict[str, Any]]:
    return sorted(c.items("", "pods", NS), key=lambda p: p["metadata"]["name"])


def report_ranks(act: KubernetesActuator, c: FakeCluster) -> None:
    for i, p in enumerate(gang(c)):
        for local in range(2):
            ev = RankEvent(job="llm", rank=2 * i + local, kind="started", time_unix_s=1.0,
                           local_rank=local, world_size=4, pod=p["metadata"]["name"],
                           namespace=NS)  # fmt: skip
            act.observe_ranks(p["spec"]["nodeName"], [ev])


def change(c: FakeCluster, p: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    obj = c.get("", "pods", NS, p["metadata"]["name"])
    assert obj is not None
    edit(obj)
    c.put("", "pods", obj)


def phase(value: str) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        obj["status"] = {"phase": value}

    return edit


def terminating(obj: dict[str, Any]) -> None:
    """A node that stopped answering: the pod is marked for deletion and stays (stuck)."""
    obj["metadata"]["deletionTimestamp"] = "2025-01-01T00:05:00Z"
    obj["metadata"]["finalizers"] = ["example.com/stuck"]


@pytest.mark.parametrize(
    "edit",
    [phase("Failed"), phase("Pending"), phase("Unknown"), terminating],
    ids=["failed", "pending-on-its-node", "unknown", "terminating"],
)
def test_a_reported_pod_that_is_not_running_stays_in_the_gang(
    cluster: FakeCluster, edit: Callable[[dict[str, Any]], None]
) -> None:
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)
    first = gang(cluster)[0]
    assert first["spec"]["nodeName"] == "gpu-a"
    change(cluster, first, edit)

    placement = run(act.current_placement("llm"))

    assert placement is not None
    assert (placement.nodes, placement.ranks_per_node) == (("gpu-a", "gpu-b"), 2)
    assert placement.generation == 2


def test_reports_from_pods_that_are_gone_say_so_when_the_new_pods_carry_no_rank_label(
    cluster: FakeCluster,
) -> None:
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)
    old = gang(cluster)
    for p in old:  # the workload's controller replaced the gang: new pods, no reports yet
        with cluster.lock:  # gone, finalizers or not
            cluster.objects.pop(("", "pods", NS, p["metadata"]["name"]))
    pod(cluster, "llm-new-0", "gpu-b", labels=JOB, annotations={"trainguard.io/generation": "3"})
    pod(cluster, "llm-new-1", "gpu-c", labels=JOB, annotations={"trainguard.io/generation": "3"})

    with pytest.raises(ActuatorError) as err:
        run(act.current_placement("llm"))

    msg = str(err.value)
    assert "its ranks have not reported from pods ['llm-new-0', 'llm-new-1'] yet" in msg
    assert "(new pods after a restart?" in msg and "are gone" in msg
    assert "carry no trainguard.io/rank label" in msg


def test_pods_of_a_newer_generation_make_the_reports_stale(cluster: FakeCluster) -> None:
    """The old gang's pods still exist (their Running status not updated yet) but
    generation 3 is starting: its pods, labelled by rank, are where the job runs now, at
    generation 3 (not the old nodes with the new generation number)."""
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)
    for rank, n in enumerate(("gpu-b", "gpu-c")):
        pod(cluster, f"llm-g3-{rank}", n, labels={**JOB, "trainguard.io/rank": str(rank)},
            annotations={"trainguard.io/generation": "3"})  # fmt: skip

    placement = run(act.current_placement("llm"))

    assert placement is not None
    assert (placement.nodes, placement.ranks_per_node, placement.generation) == (
        ("gpu-b", "gpu-c"),
        1,
        3,
    )


def test_half_a_reported_gang_deleted_is_stale_and_the_error_says_so(
    cluster: FakeCluster,
) -> None:
    """The workload's controller deletes the old gang pod by pod: the pod still there runs
    no rank the reports can place, and it carries no rank label."""
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)
    first, second = gang(cluster)
    with cluster.lock:
        cluster.objects.pop(("", "pods", NS, first["metadata"]["name"]))

    with pytest.raises(ActuatorError) as err:
        run(act.current_placement("llm"))

    msg = str(err.value)
    assert f"its ranks have not reported from pods ['{second['metadata']['name']}'] yet" in msg
    assert f"the pods its ranks reported from are gone (['{first['metadata']['name']}'])" in msg


def test_a_gang_whose_pods_are_all_gone_is_not_placed(cluster: FakeCluster) -> None:
    """A guard for the rule above (the old code agreed): no pod left, nothing placed."""
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)
    for p in gang(cluster):
        with cluster.lock:  # gone, finalizers or not
            cluster.objects.pop(("", "pods", NS, p["metadata"]["name"]))

    assert run(act.current_placement("llm")) is None


def test_a_labelled_gang_keeps_its_failed_pod(cluster: FakeCluster) -> None:
    for n in ("gpu-a", "gpu-b"):
        node(cluster, n)
    pod(cluster, "w-0", "gpu-a", labels={**JOB, "trainguard.io/rank": "0"}, phase="Failed")
    pod(cluster, "w-1", "gpu-b", labels={**JOB, "trainguard.io/rank": "1"})
    act = actuator(cluster)

    placement = run(act.current_placement("llm"))

    assert placement is not None and placement.nodes == ("gpu-a", "gpu-b")


def test_a_labelled_gang_pod_not_scheduled_yet_is_an_error_not_a_smaller_gang(
    cluster: FakeCluster,
) -> None:
    node(cluster, "gpu-a")
    pod(cluster, "w-0", "gpu-a", labels={**JOB, "trainguard.io/rank": "0"})
    pod(cluster, "w-1", "", labels={**JOB, "trainguard.io/rank": "1"}, phase="Pending")
    act = actuator(cluster)

    with pytest.raises(ActuatorError, match=r"job 'llm': pod w-1 is not scheduled yet; "):
        run(act.current_placement("llm"))


def put_node(
    c: FakeCluster, name: str, *, ready: str = "True", taints: list[Any] | None = None
) -> None:
    spec = {"taints": taints} if taints else {}
    c.put("", "nodes", {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    })  # fmt: skip


def test_candidate_nodes_leave_out_not_ready_nodes_and_taints_the_job_does_not_tolerate(
    cluster: FakeCluster,
) -> None:
    launch(
        cluster,
        tolerations=[
            {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
            {"key": "maintenance", "operator": "Exists"},
        ],
    )
    act = actuator(cluster)
    put_node(cluster, "not-ready", ready="False")
    put_node(cluster, "unknown", ready="Unknown")
    put_node(cluster, "foreign", taints=[{"key": "gpu-broken", "effect": "NoSchedule"}])
    put_node(cluster, "evicting", taints=[{"key": "gpu-broken", "effect": "NoExecute"}])
    put_node(cluster, "other-team",
             taints=[{"key": "dedicated", "value": "other", "effect": "NoSchedule"}])  # fmt: skip
    put_node(cluster, "ours-dedicated",
             taints=[{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}])  # fmt: skip
    put_node(cluster, "maintenance",
             taints=[{"key": "maintenance", "value": "x", "effect": "NoExecute"}])  # fmt: skip
    put_node(cluster, "prefer",
             taints=[{"key": "gpu-broken", "effect": "PreferNoSchedule"}])  # fmt: skip
    # trainguard's own quarantine stays a candidate (the engine leaves out isolated nodes).
    run(act.isolate_node("gpu-a", reason="xid 79"))
    quarantined = cluster.get("", "nodes", "", "gpu-a")
    assert quarantined is not None and quarantined["spec"]["taints"]

    assert run(act.candidate_nodes("llm")) == [
        "gpu-a",
        "gpu-b",
        "gpu-c",
        "maintenance",
        "ours-dedicated",
        "prefer",
    ]


def test_hand_edited_numbers_on_the_gang_are_ignored_not_a_crash(cluster: FakeCluster) -> None:
    """Anyone who can edit a pod can write its annotations: a generation of ``'²'`` or a
    resume step in full-width digits (``str.isdigit`` is true, ``int`` refuses or misreads them)
    used to raise ValueError out of ``current_placement``, which the engine does not catch."""
    launch(cluster)
    act = actuator(cluster)
    report_ranks(act, cluster)

    def hostile(obj: dict[str, Any]) -> None:
        obj["metadata"]["annotations"] = {
            "trainguard.io/generation": "²",
            "trainguard.io/resume-step": "\uff11",  # full-width 1
        }

    for p in gang(cluster):
        change(cluster, p, hostile)
    placement = run(act.current_placement("llm"))
    assert placement is not None
    assert (placement.nodes, placement.generation, placement.resume_step) == (
        ("gpu-a", "gpu-b"),
        0,
        None,
    )
