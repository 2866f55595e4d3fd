"""A JobSet of four pods, each a torchrun of two real gloo ranks, survives a fatal XID
(issue 18): the node is tainted, the gang restarts without it, training resumes from the
checkpoint, and Events tell the story.

What is real: the controller (a process, ``actuator: kubernetes`` against the fake API
server through the official client), five node agents (processes, simulated GPUs, each
with its socket), the JobSet's pods' processes (``torchrun --nnodes=4 --nproc-per-node=2``
running ``demojob.train`` on gloo: 8 ranks, TP=2 inside a pod, DP=4 across pods) and the
checkpoint they resume from. What stands in for Kubernetes: ``FakeCluster`` holds the
Nodes, the JobSet, its Jobs, pods and Events; its JobSet controller, Job controller and
scheduler (``tests/actuators/fake_controllers.py``) are reconciled by this test every
0.2 s; and this test plays the **kubelet**: it starts a torchrun process for every pod the
scheduler bound to a node (with that node's agent socket, and the environment the pod
template's downward API gives: pod name and namespace, and ``TRAINGUARD_GENERATION`` from
the pod's ``jobset.sigs.k8s.io/restart-attempt`` label), kills it when its pod is deleted,
and reports a pod Failed when its process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.actuators.fake_cluster import FakeCluster
from tests.e2e.e2e_cluster import E2ECluster, _clean_env
from trainguard.cli.procs import cli_argv, free_port, wait_until

pytestmark = pytest.mark.slow

NS = "train"
JOB = "llm"
NODES = tuple(f"k8s-node-{i}" for i in range(5))  # four for the gang, one spare
ROOT = Path(__file__).resolve().parents[2]

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


class Kubelet:
    """Runs each bound pod as a local torchrun process; see the module docstring."""

    def __init__(self, cluster: FakeCluster, workdir: Path, sockets: dict[str, str]) -> None:
        self.cluster, self.workdir, self.sockets = cluster, workdir, sockets
        self.procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self.ports: dict[str, int] = {}  # restart attempt -> the gang's rendezvous port
        self.started: list[tuple[str, str, str]] = []  # (pod, node, attempt)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.cluster.reconcile_jobset(NS, JOB)  # the JobSet controller's turn
            self.sync()

    def sync(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self.cluster.items("", "pods", NS)}
        for name, (proc, _) in list(self.procs.items()):
            if name not in pods:  # deleted: the kubelet kills its containers
                _kill(proc)
                del self.procs[name]
            elif proc.poll() is not None and pods[name].get("status", {}).get("phase") == "Running":
                pod = pods[name]
                pod["status"]["phase"] = "Succeeded" if proc.returncode == 0 else "Failed"
                self.cluster.put("", "pods", pod)
        for name, pod in pods.items():
            node = pod["spec"].get("nodeName")
            if node and name not in self.procs and pod.get("status", {}).get("phase") == "Running":
                self.procs[name] = (self._run(pod, node), node)

    def _run(self, pod: dict[str, Any], node: str) -> subprocess.Popen[bytes]:
        labels = pod["metadata"]["labels"]
        attempt = labels["jobset.sigs.k8s.io/restart-attempt"]
        port = self.ports.setdefault(attempt, free_port())
        self.started.append((pod["metadata"]["name"], node, attempt))
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env |= {  # what the downward API fills in
            "POD_NAME": pod["metadata"]["name"],
            "POD_NAMESPACE": NS,
            "TRAINGUARD_GENERATION": attempt,
        }
        env |= {
            "TRAINGUARD_AGENT_SOCKET": self.sockets[node],
            "TG_STEPS": "100000",
            "TG_CKPT_DIR": str(self.workdir / "ckpt"),
            "TG_CKPT_EVERY": "5",
            "TG_GLOBAL_BATCH": "8",
            "TG_STEP_SLEEP_S": "0.05",
            "TG_PG_TIMEOUT_S": "30",
            "TG_LOG": str(self.workdir / "loss.jsonl"),
            "OMP_NUM_THREADS": "1",
        }
        command = container["command"]
        assert command[0] == "torchrun"
        argv = [sys.executable, "-m", "torch.distributed.run", *command[1:3]]
        argv += [
            f"--node-rank={labels['jobset.sigs.k8s.io/job-index']}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *command[3:],
        ]
        log = (self.workdir / f"{pod['metadata']['name']}.log").open("ab")
        return subprocess.Popen(
            argv,
            env=_clean_env(env),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def running_nodes(self) -> set[str]:
        return {node for proc, node in self.procs.values() if proc.poll() is None}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for proc, _ in self.procs.values():
            _kill(proc)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: torchrun starts its workers in sessions of their own,
    so killing torchrun's process group would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """What the kubelet does to a deleted pod's containers: kill every process in it."""
    if proc.poll() is None:
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class JobSetCluster:
    def __init__(self, workdir: Path, cluster: FakeCluster) -> None:
        self.workdir, self.cluster = workdir, cluster
        self.base = E2ECluster(workdir, f"sqlite:///{workdir / 'tg.db'}")
        self.sockets = {n: str(workdir / f"{n}.sock") for n in NODES}
        self.fault_files = {n: workdir / f"{n}.faults" for n in NODES}
        self.kubelet = Kubelet(cluster, workdir, self.sockets)

    def start(self) -> None:
        for node in NODES:
            self.cluster.put(
                "",
                "nodes",
                {
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                    "spec": {},
                    "status": {"conditions": [{"type": "Ready", "status": "True"}]},
                },
            )
            argv = cli_argv(
                *("agent", "--controller", self.base.server, "--token", self.base.agent_token),
                *("--node-name", node, "--gpus", "sim:2"),
                *("--spool-dir", str(self.workdir / node / "spool")),
                *("--socket-path", self.sockets[node], "--metrics-port", "-1"),
                *("--sample-interval", "0.2", "--report-interval", "0.5"),
                *("--sim-fault-file", str(self.fault_files[node])),
            )
            self.base.procs.start(node, argv, env=_clean_env({}))
        sockets = list(self.sockets.values())
        assert wait_until(lambda: all(os.path.exists(s) for s in sockets), timeout_s=30)
        (self.workdir / "policy.json").write_text(
            json.dumps({"guards": {"max_isolated_fraction": 0.5}})
        )
        self.start_controller(
            {
                "TRAINGUARD_ACTUATOR": "kubernetes",
                "TRAINGUARD_KUBE_API_URL": self.cluster.url,
                "TRAINGUARD_KUBE_NAMESPACE": NS,
                "TRAINGUARD_LEADER_ELECTION_BACKEND": "database",
                "TRAINGUARD_POLICY_FILE": str(self.workdir / "policy.json"),
            }
        )
        self.cluster.put("jobset.x-k8s.io", "jobsets", yaml.safe_load(JOBSET_YAML))
        self.kubelet.start()

    def start_controller(self, extra_env: dict[str, str]) -> None:
        """``E2ECluster.start_controller`` with a longer start-up allowance: on a machine
        shared by many test runs the controller's imports alone can take a minute."""
        base = self.base
        tokens = [
            {"name": "e2e-agent", "role": "agent", "token": base.agent_token},
            {"name": "e2e-viewer", "role": "viewer", "token": base.viewer_token},
        ]
        env = {
            "TRAINGUARD_TOKENS": json.dumps(tokens),
            "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",
            **extra_env,
        }
        argv = cli_argv(
            *("controller", "--host", "127.0.0.1", "--port", str(base.port)),
            *("--database-url", base.database_url),
        )
        child = base.procs.start("controller", argv, env=_clean_env(env))
        with base.api() as probe:
            ok = wait_until(lambda: probe.ready() or not child.alive(), timeout_s=240)
            if not (ok and child.alive() and probe.ready()):
                raise AssertionError(f"controller did not start:\n{child.log_tail(40)}")

    def losses(self) -> list[dict[str, Any]]:
        path = self.workdir / "loss.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip().endswith("}")]

    def generation(self, gen: int) -> list[dict[str, Any]]:
        return [r for r in self.losses() if r["generation"] == gen]

    def wait(self, what: str, predicate: Any, timeout_s: float) -> None:
        if not wait_until(predicate, timeout_s=timeout_s, interval_s=0.2):
            pods = "\n".join(
                f"--- {p.name}\n" + p.read_text()[-1500:] for p in self.workdir.glob("llm-*.log")
            )
            self.base.wait(what, lambda: False, timeout_s=0.1)  # raises with the process logs
            raise AssertionError(pods)

    def actions(self) -> list[dict[str, Any]]:
        """The controller's action rows, oldest first."""
        with self.base.api() as api:
            return sorted(api.actions(), key=lambda a: a["id"])

    def events(self) -> list[tuple[str, str, str]]:
        found = self.cluster.items("", "events", NS) + self.cluster.items("", "events", "default")
        return [
            (e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reason"])
            for e in sorted(found, key=lambda e: e["metadata"]["resourceVersion"])
        ]

    def close(self) -> None:
        self.kubelet.close()
        self.base.close()


@pytest.fixture
def jobset() -> Iterator[JobSetCluster]:
    # Not pytest's tmp_path: other pytest sessions on this machine rotate the numbered base
    # directories away (only the newest three are kept) while this long test still runs.
    workdir = Path(tempfile.mkdtemp(prefix="tg-jobset-e2e-"))
    with FakeCluster.running() as cluster:
        c = JobSetCluster(workdir, cluster)
        try:
            c.start()
            yield c
        finally:
            c.close()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.timeout(900)  # a quiet machine needs far less; a shared one much more
def test_jobset_gang_restarts_off_a_fatal_xid_and_resumes(jobset: JobSetCluster) -> None:
    began = time.monotonic()
    jobset.wait("generation 0 trains", lambda: len(jobset.generation(0)) >= 8, 240)
    first = jobset.kubelet.running_nodes()
    assert first == set(NODES[:4]), first  # the scheduler spread the gang; the spare idles
    bad = "k8s-node-1"
    with jobset.fault_files[bad].open("a") as f:
        f.write("kind=xid,code=79,gpu=0,at=0\n")
    xid_at = time.time()

    jobset.wait("generation 1 resumed", lambda: len(jobset.generation(1)) >= 3, 240)
    gen0, gen1 = jobset.generation(0), jobset.generation(1)
    # The whole gang restarted, by the JobSet's own failurePolicy, without the bad node.
    js = jobset.cluster.get("jobset.x-k8s.io", "jobsets", NS, JOB)
    assert js is not None and js["status"]["restarts"] == 1
    second = {node for _, node, attempt in jobset.kubelet.started if attempt == "1"}
    assert second == {"k8s-node-0", "k8s-node-2", "k8s-node-3", "k8s-node-4"}, second
    # The bad node is cordoned, tainted and marked, by trainguard.
    node = jobset.cluster.get("", "nodes", "", bad)
    assert node is not None and node["spec"]["unschedulable"] is True
    assert any(t["key"] == "trainguard.io/unhealthy" for t in node["spec"]["taints"])
    healthy = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert healthy["TrainguardHealthy"] == "False"
    # Training resumed from the checkpoint, at the same world size, and went on.
    resumed = gen1[0]
    assert resumed["world_size"] == 8 and resumed["dp"] == 4 and resumed["tp"] == 2
    assert resumed["resumed_from"] is not None and resumed["step"] == resumed["resumed_from"]
    # From the protective checkpoint trainguard asked for (or a newer one), no step skipped.
    protective = [
        int(a["outcome"].split()[3])
        for a in jobset.actions()
        if a["kind"] == "checkpoint" and a["status"] == "succeeded"
    ]
    assert protective and resumed["resumed_from"] >= protective[0], protective
    assert resumed["resumed_from"] <= max(r["step"] for r in gen0) + 1
    assert resumed["loss"] < gen0[0]["loss"]  # it continued, it did not start over
    again = {r["step"]: r["loss"] for r in gen0}
    assert all(abs(r["loss"] - again[r["step"]]) < 1e-6 for r in gen1 if r["step"] in again)
    # Events tell the story: the node quarantined, the gang restarted.
    events = jobset.events()
    assert ("Node", bad, "TrainguardQuarantined") in events, events
    assert any(kind == "JobSet" and reason == "TrainguardGangRestart" for kind, _, reason in events)
    restart = next(a for a in jobset.actions() if a["kind"] == "restart_job")
    print(
        f"JobSet e2e: XID -> restart {restart['created_unix_s'] - xid_at:.1f} s, XID -> first "
        f"step of generation 1 {resumed['time_unix_s'] - xid_at:.1f} s, "
        f"whole test {time.monotonic() - began:.1f} s after start-up",
        flush=True,
    )
