"""A PyTorchJob (Kubeflow Training Operator, kubeflow.org/v1) of four pods, each a torchrun
of two real gloo ranks, survives a fatal XID (issue 18): the node is tainted, the gang
restarts the PyTorchJob way without it, training resumes from the checkpoint, and Events
tell the story.

The machinery (real controller, agents and ranks; the fake API server with its scheduler;
this test playing the kubelet) is ``tests/e2e/k8s_gang.py``, shared with the JobSet test.
Here the fake cluster acts as the Training Operator (``reconcile_pytorchjob``): it creates
the Master and Worker pods from the current spec with the variables it injects for torchrun
(``PET_NNODES``, ``PET_NPROC_PER_NODE`` from ``nprocPerNode``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR``/``PET_MASTER_PORT`` naming the master's Service), and recreates every
pod that is deleted. The replicas' ``restartPolicy: OnFailure`` is what makes trainguard
restart the gang the operator's way: it writes the new generation (and resume step) into
the spec, then evicts every old pod; the operator recreates them off the tainted node. The
only thing the test changes in a pod's environment is what the cluster network would give:
the master's Service name resolves to 127.0.0.1, with a port per generation (all pods share
this machine's loopback).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_schema import schema_errors
from tests.e2e.k8s_gang import (
    BAD,
    JOB,
    NODES,
    NS,
    GangCluster,
    Workload,
    assert_quarantined_and_resumed,
    gang_cluster,
    report_times,
    train_then_xid,
)

pytestmark = pytest.mark.slow

#: The PyTorchJob a user applies (docs/kubernetes.md, "End to end"): one Master and three
#: Workers, each a torchrun of two ranks whose options come from the operator
#: (``nprocPerNode``), the generation and resume step trainguard writes handed to the ranks
#: through the downward API.
PYTORCHJOB_YAML = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: llm
  namespace: train
  labels:
    trainguard.io/job: llm
spec:
  nprocPerNode: "2"
  runPolicy:
    cleanPodPolicy: None
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      restartPolicy: OnFailure
      template: &rank
        metadata:
          labels:
            trainguard.io/job: llm
        spec:
          containers:
          - name: pytorch
            image: registry.example.com/ml/trainguard-demo:0.1.0
            command: [torchrun, -m, demojob.train]
            env:
            - name: TRAINGUARD_JOB
              value: llm
            - name: TG_TP
              value: "2"
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            - name: TRAINGUARD_GENERATION
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['trainguard.io/generation']
            - name: TRAINGUARD_RESUME_STEP
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['trainguard.io/resume-step']
    Worker:
      replicas: 3
      restartPolicy: OnFailure
      template: *rank
"""


def _rendezvous(pod: dict[str, Any], port: int) -> tuple[list[str], dict[str, str]]:
    """The master's Service (``llm-master-0``) as this machine reaches it."""
    local = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [], local | {f"PET_{k}": v for k, v in local.items()}


def _reconcile(cluster: FakeCluster) -> None:
    cluster.reconcile_pytorchjob(NS, JOB)


PYTORCHJOB = Workload(
    group="kubeflow.org",
    plural="pytorchjobs",
    manifest=PYTORCHJOB_YAML,
    reconcile=_reconcile,
    gang=lambda pod: (pod["metadata"].get("annotations") or {}).get(
        "trainguard.io/generation", "0"
    ),
    rendezvous=_rendezvous,
)


@pytest.fixture
def pytorchjob() -> Iterator[GangCluster]:
    # Field names and shapes are the project's own: kubeflow-training's models take it as is.
    assert schema_errors(yaml.safe_load(PYTORCHJOB_YAML)) == []
    with gang_cluster(PYTORCHJOB, "tg-pytorchjob-e2e-") as c:
        yield c


@pytest.mark.timeout(900)  # a quiet machine needs far less; a shared one much more
def test_pytorchjob_gang_restarts_off_a_fatal_xid_and_resumes(pytorchjob: GangCluster) -> None:
    c = pytorchjob
    began = time.monotonic()
    xid_at = train_then_xid(c)
    c.wait("generation 1 resumed", lambda: len(c.generation(1)) >= 3, 240)
    # Restarted the PyTorchJob way: the new generation is in its spec (and round-trips
    # through kubeflow-training's models), every old pod was removed and the operator
    # recreated all four from the spec, off the tainted node, onto the spare.
    pj = c.cluster.get("kubeflow.org", "pytorchjobs", NS, JOB)
    assert pj is not None and schema_errors(pj) == []
    assert pj["metadata"]["annotations"]["trainguard.io/generation"] == "1"
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert {t: s["replicas"] for t, s in specs.items()} == {"Master": 1, "Worker": 3}
    for spec in specs.values():
        assert spec["template"]["metadata"]["annotations"]["trainguard.io/generation"] == "1"
    restart = next(a for a in c.actions() if a["kind"] == "restart_job")
    assert restart["status"] == "succeeded", restart
    assert "restarted as generation 1 with 8 ranks (PyTorchJob llm, was 8" in restart["outcome"]
    assert "the operator recreates pods" in restart["outcome"], restart["outcome"]
    assert "shrunk" not in restart["outcome"]  # a spare node: the same size
    # Every old pod went (not only BAD's), and the operator recreated all four.
    pods = {"llm-master-0", "llm-worker-0", "llm-worker-1", "llm-worker-2"}
    now = {p["metadata"]["name"]: p for p in c.cluster.items("", "pods", NS)}
    assert set(now) == pods
    assert {p["metadata"]["annotations"]["trainguard.io/generation"] for p in now.values()} == {"1"}
    second = {pod: node for pod, node, gen in c.kubelet.started if gen == "1"}
    assert set(second) == pods, second
    assert set(second.values()) == set(NODES) - {BAD}, second
    assert not any(node == BAD for _, node, gen in c.kubelet.started if gen == "1")
    # Cordoned, tainted, marked; resumed from the checkpoint; the Node's Event.
    resumed = assert_quarantined_and_resumed(c)
    # No rollback: no resume bound in the spec (the job checkpointed on until its pods
    # went, and retention may have deleted the checkpoint that was newest at the decision),
    # so the ranks resumed from the newest one; the action recorded the one it knew of.
    for spec in specs.values():
        assert "trainguard.io/resume-step" not in spec["template"]["metadata"]["annotations"]
    assert resumed["resumed_from"] >= restart["params"]["resume_step"], (resumed, restart)
    # Events tell the story: the node quarantined (above), the PyTorchJob restarted.
    assert ("PyTorchJob", JOB, "JobRestarted") in c.events(), c.events()
    report_times(c, "PyTorchJob", xid_at, began)
