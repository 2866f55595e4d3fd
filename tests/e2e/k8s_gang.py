"""Shared machinery of the Kubernetes end-to-end tests (issue 18): a training workload of
four pods, each a torchrun of two real gloo ranks, on five nodes of the fake API server.

What is real: the controller (a process, ``actuator: kubernetes`` against the fake API
server through the official client), five node agents (processes, simulated GPUs, each
with its socket), the pods' processes (``torchrun`` running ``demojob.train`` on gloo: 8
ranks, TP=2 inside a pod, DP=4 across pods) and the checkpoint they resume from. What
stands in for Kubernetes: :class:`~tests.actuators.fake_cluster.FakeCluster` holds the
Nodes, the workload, its pods and Events; the workload's controller (JobSet and Job
controllers, or the Training Operator) and the scheduler
(``tests/actuators/fake_controllers.py``) are reconciled every 0.2 s by :class:`Kubelet`,
which also plays the **kubelet**: it starts a torchrun process for every pod the scheduler
bound to a node (pods told apart by uid, as a controller may recreate one under the same
name), with that node's agent socket and the environment the pod's spec gives
(literal values, the downward API's ``fieldRef`` paths, what a controller injected), kills
every process of a pod when the pod is deleted, and applies the pod's ``restartPolicy``
when its process exits (``Never``: the pod is Failed or Succeeded; ``OnFailure``/``Always``:
the container restarts in place after the kubelet's first back-off).

What differs between workload kinds is a :class:`Workload`: its manifest, its controller's
reconcile, which gang (restart attempt) a pod belongs to, and what the cluster network gives
a pod for the rendezvous (torchrun options or ``PET_*`` variables, pointed at 127.0.0.1 and
a port of its own per gang, since all pods share this machine's loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.actuators.fake_cluster import FakeCluster
from tests.e2e.e2e_cluster import E2ECluster
from tests.environ import clean_env
from trainguard.cli.procs import cli_argv, wait_until
from trainguard.ports import free_port

NS = "train"
JOB = "llm"
NODES = tuple(f"k8s-node-{i}" for i in range(5))  # four for the gang, one spare
ROOT = Path(__file__).resolve().parents[2]
#: The kubelet's first CrashLoopBackOff delay before it restarts a failed container.
RESTART_BACKOFF_S = 10.0
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload kind, as the stand-in kubelet and the harness need to know it."""

    group: str
    plural: str
    #: The YAML a user applies (docs/kubernetes.md shows the same text).
    manifest: str
    #: One reconcile of the workload's own controller(s) in the fake cluster.
    reconcile: Callable[[FakeCluster], object]
    #: Which gang (restart attempt) a pod belongs to: one rendezvous port per gang.
    gang: Callable[[dict[str, Any]], str]
    #: (torchrun options, environment) the cluster network gives a pod of a gang whose
    #: rendezvous listens on 127.0.0.1:``port``.
    rendezvous: Callable[[dict[str, Any], int], tuple[list[str], dict[str, str]]]


def downward_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it from the pod: literal values
    and the downward API's ``fieldRef`` paths (a missing label or annotation gives "")."""
    meta = pod["metadata"]
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        path = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        if path in ("metadata.name", "metadata.namespace"):
            env[item["name"]] = str(meta.get(path.split(".")[1], ""))
        elif m := _FIELD.fullmatch(path):
            env[item["name"]] = str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        elif path == "spec.nodeName":
            env[item["name"]] = str(pod["spec"].get("nodeName", ""))
        else:
            raise AssertionError(f"the stand-in kubelet cannot fill {item['name']} ({path!r})")
    return env


@dataclass(slots=True)
class _Container:
    proc: subprocess.Popen[bytes]
    node: str
    uid: str  # the pod's: a pod recreated under the same name is another pod
    restart_at: float | None = None  # when a failed container is due to restart


class Kubelet:
    """Runs each bound pod as a local torchrun process; see the module docstring."""

    def __init__(
        self, cluster: FakeCluster, workload: Workload, workdir: Path, sockets: dict[str, str]
    ) -> None:
        self.cluster, self.workload = cluster, workload
        self.workdir, self.sockets = workdir, sockets
        self.containers: dict[str, _Container] = {}
        self.ports: dict[str, int] = {}  # gang -> its rendezvous port
        self.started: list[tuple[str, str, str]] = []  # (pod, node, gang), restarts included
        self.restarts: dict[str, int] = {}  # pod -> container restarts (OnFailure/Always)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.workload.reconcile(self.cluster)  # the workload controller's turn
            self.sync()

    def sync(self) -> None:
        pods = {p["metadata"]["name"]: p for p in self.cluster.items("", "pods", NS)}
        for name, c in list(self.containers.items()):
            pod = pods.get(name)
            if pod is None or pod["metadata"]["uid"] != c.uid:  # deleted: kill its containers
                _kill(c.proc)
                del self.containers[name]
            elif c.proc.poll() is not None and pod.get("status", {}).get("phase") == "Running":
                self._exited(pod, c)
        for name, pod in pods.items():
            node = pod["spec"].get("nodeName")
            running = pod.get("status", {}).get("phase") == "Running"
            if node and running and name not in self.containers:
                self.containers[name] = _Container(
                    self._run(pod, node), node, pod["metadata"]["uid"]
                )

    def _exited(self, pod: dict[str, Any], c: _Container) -> None:
        """The pod's ``restartPolicy``: restart in place (after the back-off), or end it."""
        code = c.proc.returncode
        policy = pod["spec"].get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            now = time.monotonic()
            if c.restart_at is None:
                c.restart_at = now + RESTART_BACKOFF_S
            elif now >= c.restart_at:
                name = pod["metadata"]["name"]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                self.containers[name] = _Container(self._run(pod, c.node), c.node, c.uid)
            return
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        terminated = {"exitCode": code if code >= 0 else 128 - code, "reason": "Error"}
        pod["status"]["containerStatuses"] = [
            {"name": pod["spec"]["containers"][0]["name"], "state": {"terminated": terminated}}
        ]
        self.cluster.put("", "pods", pod)

    def _run(self, pod: dict[str, Any], node: str) -> subprocess.Popen[bytes]:
        name = pod["metadata"]["name"]
        gang = self.workload.gang(pod)
        port = self.ports.setdefault(gang, free_port())
        self.started.append((name, node, gang))
        (container,) = pod["spec"]["containers"]
        options, network = self.workload.rendezvous(pod, port)
        env = downward_env(pod, container) | network
        env |= {  # this machine's stand-ins for the node and the checkpoint volume
            "TRAINGUARD_AGENT_SOCKET": self.sockets[node],
            "TG_STEPS": "100000",
            "TG_CKPT_DIR": str(self.workdir / "ckpt"),
            "TG_CKPT_EVERY": "5",
            "TG_GLOBAL_BATCH": "8",
            # Eight ranks training flat out take 1.5 of this machine's 2 cores for the whole
            # test; the test counts a handful of steps, so a slower pace costs it nothing
            # and leaves the CPU to the controller, the agents and the restart it times.
            "TG_STEP_SLEEP_S": "0.25",
            "TG_PG_TIMEOUT_S": "30",
            "TG_LOG": str(self.workdir / "loss.jsonl"),
            "OMP_NUM_THREADS": "1",
        }
        command = [*container.get("command", []), *container.get("args", [])]
        assert command[0] == "torchrun", command
        argv = [sys.executable, "-m", "torch.distributed.run", *options, *command[1:]]
        log = (self.workdir / f"{name}.log").open("ab")
        return subprocess.Popen(
            argv,
            env=clean_env(env),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def running_nodes(self) -> set[str]:
        return {c.node for c in self.containers.values() if c.proc.poll() is None}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for c in self.containers.values():
            _kill(c.proc)


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


class GangCluster:
    """Five Nodes and their agents, the controller, the workload and the kubelet."""

    def __init__(self, workdir: Path, cluster: FakeCluster, workload: Workload) -> None:
        self.workdir, self.cluster, self.workload = workdir, cluster, workload
        self.base = E2ECluster(workdir, f"sqlite:///{workdir / 'tg.db'}")
        self.sockets = {n: str(workdir / f"{n}.sock") for n in NODES}
        self.fault_files = {n: workdir / f"{n}.faults" for n in NODES}
        self.kubelet = Kubelet(cluster, workload, workdir, self.sockets)
        self.failed = False  # a wait timed out: keep the work directory for a look

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
                # Five agents sample and report for the whole test: at the e2e pace of
                # 0.2 s / 0.5 s they were a tenth of its CPU. An XID is reported at once
                # whatever the interval (agents.daemon), and nothing here waits on the
                # cadence; commands still reach the ranks within a second.
                *("--sample-interval", "0.5", "--report-interval", "1.0"),
                *("--sim-fault-file", str(self.fault_files[node])),
            )
            self.base.procs.start(node, argv, env=clean_env())
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
        w = self.workload
        # Through JSON, as the API server stores it: YAML anchors (one template for several
        # replicas) become separate objects.
        doc = json.loads(json.dumps(yaml.safe_load(w.manifest)))
        self.cluster.put(w.group, w.plural, doc)
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
        child = base.procs.start("controller", argv, env=clean_env(env))
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
        """Wait for ``predicate``; on time-out fail with the story so far: the actions,
        Events, the pods' logs and the processes' logs (the work directory is kept)."""
        if wait_until(predicate, timeout_s=timeout_s, interval_s=0.2):
            return
        self.failed = True
        actions = "\n".join(f"{a['kind']} {a['status']}: {a['outcome']}" for a in self.actions())
        pods = "\n".join(
            f"--- {p.name}\n" + p.read_text()[-1500:]
            for p in sorted(self.workdir.glob(f"{JOB}-*.log"))
        )
        story = f"actions:\n{actions}\nevents: {self.events()}\npods:\n{pods}"
        try:
            self.base.wait(what, lambda: False, timeout_s=0.1)  # raises with process logs
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{story}\n(work directory {self.workdir})") from None

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


@contextlib.contextmanager
def gang_cluster(workload: Workload, prefix: str) -> Iterator[GangCluster]:
    """A started :class:`GangCluster` for ``workload``, torn down at the end."""
    # Not pytest's tmp_path: other pytest sessions on this machine rotate the numbered base
    # directories away (only the newest three are kept) while these long tests still run.
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    with FakeCluster.running() as cluster:
        c = GangCluster(workdir, cluster, workload)
        try:
            c.start()
            yield c
        finally:
            c.close()
    if not c.failed:
        shutil.rmtree(workdir, ignore_errors=True)


BAD = "k8s-node-1"


def train_then_xid(c: GangCluster) -> float:
    """Generation 0 trains on four nodes (the spare idles); then a fatal XID 79 lands on
    :data:`BAD`'s simulated driver. Returns when it was written (``time.time()``)."""
    c.wait("generation 0 trains", lambda: len(c.generation(0)) >= 8, 240)
    first = c.kubelet.running_nodes()
    assert first == set(NODES[:4]), first  # the scheduler spread the gang; the spare idles
    with c.fault_files[BAD].open("a") as f:
        f.write("kind=xid,code=79,gpu=0,at=0\n")
    return time.time()


def assert_quarantined_and_resumed(c: GangCluster) -> dict[str, Any]:
    """What every workload kind must show once generation 1 trains: the bad node
    cordoned, tainted and marked by trainguard, a Node Event, and training resumed from
    the protective checkpoint (or a newer one) at the same world size, no step skipped,
    the same losses for steps run again. Returns generation 1's first record."""
    gen0, gen1 = c.generation(0), c.generation(1)
    node = c.cluster.get("", "nodes", "", BAD)
    assert node is not None and node["spec"]["unschedulable"] is True
    assert any(t["key"] == "trainguard.io/unhealthy" for t in node["spec"]["taints"])
    healthy = {x["type"]: x["status"] for x in node["status"]["conditions"]}
    assert healthy["TrainguardHealthy"] == "False"
    resumed = gen1[0]
    assert resumed["world_size"] == 8 and resumed["dp"] == 4 and resumed["tp"] == 2
    assert resumed["resumed_from"] is not None and resumed["step"] == resumed["resumed_from"]
    protective = [
        int(a["outcome"].split()[3])
        for a in c.actions()
        if a["kind"] == "checkpoint" and a["status"] == "succeeded"
    ]
    assert protective and resumed["resumed_from"] >= protective[0], protective
    assert resumed["resumed_from"] <= max(r["step"] for r in gen0) + 1
    assert resumed["loss"] < gen0[0]["loss"]  # it continued, it did not start over
    again = {r["step"]: r["loss"] for r in gen0}
    assert all(abs(r["loss"] - again[r["step"]]) < 1e-6 for r in gen1 if r["step"] in again)
    assert ("Node", BAD, "TrainguardQuarantined") in c.events(), c.events()
    return resumed


def report_times(c: GangCluster, kind: str, xid_at: float, began: float) -> None:
    resumed = c.generation(1)[0]
    restart = next(a for a in c.actions() if a["kind"] == "restart_job")
    print(
        f"{kind} e2e: XID -> restart {restart['created_unix_s'] - xid_at:.1f} s, XID -> first "
        f"step of generation 1 {resumed['time_unix_s'] - xid_at:.1f} s, "
        f"whole test {time.monotonic() - began:.1f} s after start-up",
        flush=True,
    )
