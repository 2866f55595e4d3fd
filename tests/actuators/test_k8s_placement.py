"""Placement learned from the ranks' own reports; workloads found from owner references."""

from __future__ import annotations

import pytest

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.placement import PlacementBook, resolve_workload, workload_hint
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, kube_on, node, owner, pod, run
from trainguard.wire import RankEvent

__all__ = ["cluster"]


def started(job: str, rank: int, world: int, pod_name: str, *, local: int) -> RankEvent:
    return RankEvent(job=job, rank=rank, kind="started", time_unix_s=1.0, local_rank=local,
                     world_size=world, pod=pod_name, namespace=NS)  # fmt: skip


def test_torchrun_pods_of_two_ranks_each_give_the_placement() -> None:
    book = PlacementBook()
    # Agents on gpu-a and gpu-b forward what the ranks of 2 pods x 2 torchrun ranks said.
    for rank in (3, 0, 2, 1):
        node_name, pod_name = ("gpu-a", "llm-w-0-0-abc") if rank < 2 else ("gpu-b", "llm-w-0-1-def")
        book.observe(node_name, started("llm", rank, 4, pod_name, local=rank % 2))
    layout = book.layout("llm")
    assert layout is not None and layout.complete and layout.namespace == NS
    assert layout.pods() == {"llm-w-0-0-abc": [0, 1], "llm-w-0-1-def": [2, 3]}
    assert layout.pods_on("gpu-b") == ["llm-w-0-1-def"]
    p = layout.placement(generation=2)
    assert (p.nodes, p.ranks_per_node, p.world_size, p.generation) == (("gpu-a", "gpu-b"), 2, 4, 2)
    # A relaunch at another world size starts the book over; exits are not seats.
    book.observe("gpu-c", started("llm", 0, 2, "llm-w-0-0-zzz", local=0))
    book.observe("gpu-c", RankEvent(job="llm", rank=1, kind="exited", time_unix_s=2.0))
    layout = book.layout("llm")
    assert layout is not None and not layout.complete
    with pytest.raises(ActuatorError, match=r"ranks \[1\] have not reported"):
        layout.placement()


def test_interleaved_ranks_have_no_placement_and_labels_override() -> None:
    book = PlacementBook()
    for rank, node_name in enumerate(["a", "b", "a", "b"]):
        book.observe(node_name, started("j", rank, 4, f"p{rank}", local=0))
    layout = book.layout("j")
    assert layout is not None
    with pytest.raises(ActuatorError, match="interleaved"):
        layout.placement()
    # A labelled pod (one rank per pod) overrides what was learned and fills silent ranks.
    labelled = [
        {"metadata": {"name": f"q{r}", "namespace": NS, "labels": {"trainguard.io/rank": str(r)}},
         "spec": {"nodeName": "a" if r < 2 else "b"}}
        for r in range(4)
    ]  # fmt: skip
    layout = PlacementBook().layout("j", labelled)
    assert layout is not None and layout.placement().nodes == ("a", "b")


def test_workloads_from_owner_references_and_labels(cluster: FakeCluster) -> None:
    node(cluster, "gpu-a")
    tj = cluster.put(
        "trainer.kubeflow.org", "trainjobs", {"metadata": {"name": "tj", "namespace": NS}}
    )
    by_tj = {"ownerReferences": [owner(tj)]}
    js = cluster.put(
        "jobset.x-k8s.io", "jobsets", {"metadata": {"name": "tj", "namespace": NS, **by_tj}}
    )
    job = cluster.put("batch", "jobs", {"metadata": {"name": "tj-node-0", "namespace": NS,
                                                     "ownerReferences": [owner(js)]}})  # fmt: skip
    labels = {
        "jobset.sigs.k8s.io/jobset-name": "tj",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    p = pod(cluster, "tj-node-0-0-x", "gpu-a", owners=[owner(job)], labels=labels)
    kube = kube_on(cluster)
    assert run(resolve_workload(kube, p)).label == f"TrainJob {NS}/tj"
    hint = workload_hint(p)
    assert hint is not None and hint.kind == "JobSet"  # no call: the JobSet's label
    # A JobSet without a TrainJob above it.
    js2 = cluster.put("jobset.x-k8s.io", "jobsets", {"metadata": {"name": "js", "namespace": NS}})
    j2 = cluster.put("batch", "jobs", {"metadata": {"name": "js-w-0", "namespace": NS,
                                                    "ownerReferences": [owner(js2)]}})  # fmt: skip
    p2 = pod(cluster, "js-w-0-0-y", "gpu-a", owners=[owner(j2)])
    assert run(resolve_workload(kube, p2)).label == f"JobSet {NS}/js"
    # PyTorchJob and a plain indexed Job.
    ptj = cluster.put("kubeflow.org", "pytorchjobs", {"metadata": {"name": "ptj", "namespace": NS}})
    p3 = pod(cluster, "ptj-worker-0", "gpu-a", owners=[owner(ptj)],
             labels={"training.kubeflow.org/job-name": "ptj"})  # fmt: skip
    assert run(resolve_workload(kube, p3)).label == f"PyTorchJob {NS}/ptj"
    ij = cluster.put("batch", "jobs", {"metadata": {"name": "ij", "namespace": NS}})
    p4 = pod(cluster, "ij-0-z", "gpu-a", owners=[owner(ij)])
    assert run(resolve_workload(kube, p4)).label == f"Job {NS}/ij"
    lone = pod(cluster, "lone", "gpu-a")
    with pytest.raises(ActuatorError, match="belongs to no Job"):
        run(resolve_workload(kube, lone))
