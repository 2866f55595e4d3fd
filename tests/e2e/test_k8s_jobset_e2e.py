"""A JobSet of four pods, each a torchrun of two real gloo ranks, survives a fatal XID
(issue 18): the node is tainted, the gang restarts without it, training resumes from the
checkpoint, and Events tell the story.

The machinery (real controller, agents and ranks; the fake API server with its JobSet and
Job controllers and scheduler; this test playing the kubelet) is ``tests/e2e/k8s_gang.py``,
shared with the PyTorchJob test. Here: the JobSet, and what its pods get that a real
cluster would give them (``--node-rank`` from the pod's ``jobset.sigs.k8s.io/job-index``,
the rendezvous on 127.0.0.1 with a port per restart attempt); ``TRAINGUARD_GENERATION``
comes through the downward API from ``jobset.sigs.k8s.io/restart-attempt``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.actuators.fake_cluster import FakeCluster
from tests.e2e.k8s_gang import (
    JOB,
    NS,
    GangCluster,
    Workload,
    assert_quarantined_and_resumed,
    gang_cluster,
    report_times,
    train_then_xid,
)

pytestmark = pytest.mark.slow

#: The JobSet a user applies (docs/kubernetes.md, "End to end"): four workers, each a
#: torchrun of two ranks, restarted as a whole by its own failurePolicy.
JOBSET_YAML = """\
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  name: llm
  namespace: train
  labels:
    trainguard.io/job: llm
spec:
  failurePolicy:
    maxRestarts: 3
  replicatedJobs:
  - name: workers
    replicas: 4
    template:
      spec:
        parallelism: 1
        completions: 1
        backoffLimit: 0
        template:
          metadata:
            labels:
              trainguard.io/job: llm
          spec:
            restartPolicy: Never
            containers:
            - name: trainer
              image: registry.example.com/ml/trainguard-demo:0.1.0
              command: [torchrun, --nnodes=4, --nproc-per-node=2, -m, demojob.train]
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
                    fieldPath: metadata.labels['jobset.sigs.k8s.io/restart-attempt']
"""


def _rendezvous(pod: dict[str, Any], port: int) -> tuple[list[str], dict[str, str]]:
    """What the user's script would pass from the JobSet's DNS names and completion index."""
    index = pod["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"]
    return [f"--node-rank={index}", "--master-addr=127.0.0.1", f"--master-port={port}"], {}


def _reconcile(cluster: FakeCluster) -> None:
    cluster.reconcile_jobset(NS, JOB)


JOBSET = Workload(
    group="jobset.x-k8s.io",
    plural="jobsets",
    manifest=JOBSET_YAML,
    reconcile=_reconcile,
    gang=lambda pod: pod["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"],
    rendezvous=_rendezvous,
)


@pytest.fixture
def jobset() -> Iterator[GangCluster]:
    with gang_cluster(JOBSET, "tg-jobset-e2e-") as c:
        yield c


@pytest.mark.timeout(900)  # a quiet machine needs far less; a shared one much more
def test_jobset_gang_restarts_off_a_fatal_xid_and_resumes(jobset: GangCluster) -> None:
    began = time.monotonic()
    xid_at = train_then_xid(jobset)
    jobset.wait("generation 1 resumed", lambda: len(jobset.generation(1)) >= 3, 240)
    # The whole gang restarted, by the JobSet's own failurePolicy, without the bad node.
    js = jobset.cluster.get("jobset.x-k8s.io", "jobsets", NS, JOB)
    assert js is not None and js["status"]["restarts"] == 1
    second = {node for _, node, attempt in jobset.kubelet.started if attempt == "1"}
    assert second == {"k8s-node-0", "k8s-node-2", "k8s-node-3", "k8s-node-4"}, second
    # Cordoned, tainted, marked; resumed from the checkpoint; the Node's Event.
    assert_quarantined_and_resumed(jobset)
    # Events tell the story: the gang restarted by the JobSet's own controller.
    events = jobset.events()
    assert any(kind == "JobSet" and reason == "TrainguardGangRestart" for kind, _, reason in events)
    report_times(jobset, "JobSet", xid_at, began)
