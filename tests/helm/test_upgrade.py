"""``helm upgrade`` from the previous chart to this one, played out with real processes.

No Kubernetes runs here, so the test plays the parts Kubernetes would, from the rendered
manifests of both chart versions (the previous one from git history):

- every *container* is a real process started with the command and environment of its
  manifest (Secret references resolved from the rendered Secrets, ``$(VAR)`` expanded as
  the kubelet does); every *pod* gets its own loopback address (127.0.0.x, one port for all,
  as pods share a port on their own IPs), and a real PostgreSQL database holds the state;
- the pods are objects in a stateful fake API server (tests/actuators/fake_kube.py), which
  the leader-label sidecar and hook (real ``trainguard leader-label`` processes) list and
  label through the official client;
- the Service is its selector: a poller picks, for each request, a random pod that matches
  the selector of the Service in force and whose last readiness probe (``/readyz``, every
  0.25 s) passed, and calls
  ``GET /api/v1/status`` on it, 20 times a second, as kube-proxy would spread them;
- the upgrade runs the new release's hooks in weight order (migration Job, then the
  leader-label Job), switches the Service, then rolls the Deployment the way its strategy
  allows (``maxSurge: 1, maxUnavailable: 1``: one new pod, one old pod removed; the old
  leader last, as it is the longest Ready).

What it cannot show: both releases run this tree's code (only the manifests differ), so
the schema does not actually move between them; and pod scheduling and image pulls, which
take longer on a cluster, are instant here.
"""

from __future__ import annotations

import base64
import itertools
import os
import random
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests import http_calls
from tests.actuators.fake_kube import FakeKube
from tests.cli.cli_k8s_tools import ToolUnavailable, helm
from trainguard.cli.procs import ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ROOT = Path(__file__).resolve().parents[2]
#: The chart before issue 22: migrations in an init container, the Service routing by
#: readiness (a standby answered /readyz with 503), maxUnavailable 0.
OLD_CHART_REV = "4c85d64^"
RELEASE, NAMESPACE = "tg", "gpu-ops"
PG_ADMIN = os.environ.get("TRAINGUARD_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
#: The longest the API may go without one successful answer.
MAX_GAP_S = 1.0
POLL_INTERVAL_S = 0.05


@pytest.fixture
def pg_url() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    admin = PG_ADMIN.replace("postgresql+psycopg://", "postgresql://")
    try:
        conn = psycopg.connect(admin, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"PostgreSQL not reachable: {str(exc).splitlines()[0]}")
    name = f"trainguard_upgrade_{secrets.token_hex(4)}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _charts(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the previous chart comes from git history; no git checkout here")
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", OLD_CHART_REV, "helm/trainguard"],
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    return old / "helm" / "trainguard", ROOT / "helm" / "trainguard"


def _render(helm_bin: Path, chart: Path, values: dict[str, Any], tmp: Path) -> list[Any]:
    values_file = tmp / f"values-{secrets.token_hex(3)}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    proc = subprocess.run(
        [str(helm_bin), "template", RELEASE, str(chart), "-n", NAMESPACE, "-f", str(values_file)],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(docs: list[Any], kind: str, name: str | None = None) -> Any:
    (doc,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


@dataclass
class Pod:
    name: str
    ip: str
    template: dict[str, Any]
    children: list[str] = field(default_factory=list)


class Cluster:
    """The parts of Kubernetes the upgrade needs, played by processes and a fake API."""

    def __init__(self, kube: FakeKube, procs: ProcessSet, port: int, tmp: Path) -> None:
        self.kube, self.procs, self.port, self.tmp = kube, procs, port, tmp
        self.pods: dict[str, Pod] = {}
        self.secrets: dict[tuple[str, str], str] = {}
        self.service: dict[str, str] = {}
        self.readiness: dict[str, bool] = {}
        self._next_ip = 2
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
        }))  # fmt: skip

    def learn_secrets(self, docs: list[Any]) -> None:
        for doc in docs:
            if doc["kind"] == "Secret":
                for key, value in doc["data"].items():
                    name = doc["metadata"]["name"]
                    self.secrets[(name, key)] = base64.b64decode(value).decode()

    def _env(self, container: dict[str, Any], pod: Pod | None) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = str(entry["value"])
                continue
            source = entry["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[entry["name"]] = self.secrets[(ref["name"], ref["key"])]
            elif source["fieldRef"]["fieldPath"] == "metadata.namespace":
                env[entry["name"]] = NAMESPACE
            elif source["fieldRef"]["fieldPath"] == "metadata.name" and pod:
                env[entry["name"]] = pod.name
        if pod is not None:  # the pod's own address; every pod listens on the same port
            env |= {"TRAINGUARD_HOST": pod.ip, "TRAINGUARD_PORT": str(self.port)}
        return env

    def _argv(self, container: dict[str, Any], env: dict[str, str]) -> list[str]:
        command = [
            re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["command"]
        ]
        assert command[0] == "trainguard"
        if command[1] == "leader-label":  # talks to the fake API server, on the test's port
            command[command.index("--port") + 1] = str(self.port)
            command += ["--kubeconfig", str(self.kubeconfig)]
        return cli_argv(*command[1:])

    def run_job(self, job: dict[str, Any]) -> None:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        env = self._env(container, None)
        proc = subprocess.run(self._argv(container, env), env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, f"{job['metadata']['name']}: {proc.stdout}{proc.stderr}"

    def start_pod(self, template: dict[str, Any], name: str) -> Pod:
        pod = Pod(name, f"127.0.0.{self._next_ip}", template)
        self._next_ip += 1
        spec = template["spec"]
        for init in spec.get("initContainers", []):  # run to completion, in order
            env = self._env(init, pod)
            proc = subprocess.run(self._argv(init, env), env=env, capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
            assert proc.returncode == 0, proc.stdout + proc.stderr
        for container in spec["containers"]:
            env = self._env(container, pod)
            child = f"{name}-{container['name']}"
            self.procs.start(child, self._argv(container, env), env=env)
            pod.children.append(child)
        labels = dict(template["metadata"]["labels"])
        self.kube.put("", "pods", {
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "status": {"phase": "Running", "podIP": pod.ip},
        })  # fmt: skip
        self.pods[name] = pod
        return pod

    def delete_pod(self, name: str) -> None:
        """Terminating: out of the Service at once, then SIGTERM and the grace period."""
        pod = self.pods.pop(name)
        with self.kube.lock:
            self.kube.objects.pop(("", "pods", NAMESPACE, name), None)
        for child in reversed(pod.children):
            self.procs.stop(child, timeout_s=30)

    def url(self, pod: Pod) -> str:
        return f"http://{pod.ip}:{self.port}"

    def ready(self, pod: Pod) -> bool:
        try:
            return http_calls.get(f"{self.url(pod)}/readyz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self, pod: Pod) -> bool:
        """Liveness (``/healthz``): up, whether it leads or not."""
        try:
            return http_calls.get(f"{self.url(pod)}/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def labels(self, pod: Pod) -> dict[str, str]:
        obj = self.kube.get("", "pods", NAMESPACE, pod.name)
        return dict(obj["metadata"]["labels"]) if obj else {}

    def probe(self, stop: threading.Event) -> None:
        """The kubelet's readiness probes (every 0.25 s here; the chart's period is 5 s)."""
        while not stop.wait(0.25):
            for pod in list(self.pods.values()):
                self.readiness[pod.name] = self.ready(pod)

    def endpoints(self) -> list[Pod]:
        """Ready pods matching the Service's selector; a deleted pod is gone at once."""
        pods = list(self.pods.values())
        selected = [p for p in pods if self.service.items() <= self.labels(p).items()]
        return [p for p in selected if self.readiness.get(p.name)]


class Poller(threading.Thread):
    """Calls the API through the Service 20 times a second; records what answered."""

    def __init__(self, cluster: Cluster, token: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.token = cluster, token
        self.results: list[tuple[float, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        with http_calls.client(
            timeout=1.0, headers={"Authorization": f"Bearer {self.token}"}
        ) as http:
            while not self.stop_event.wait(POLL_INTERVAL_S):
                endpoints = self.cluster.endpoints()
                if not endpoints:
                    self.results.append((time.monotonic(), 0))
                    continue
                pod = random.choice(endpoints)
                try:
                    code = http.get(f"{self.cluster.url(pod)}/api/v1/status").status_code
                except httpx.HTTPError:
                    code = 0
                self.results.append((time.monotonic(), code))

    def longest_gap_s(self) -> float:
        ok = [t for t, code in self.results if code == 200]
        assert ok, "the API never answered"
        edges = [self.results[0][0], *ok, self.results[-1][0]]
        return max(b - a for a, b in itertools.pairwise(edges))


def test_upgrade_from_the_previous_chart_keeps_the_api_answering(
    pg_url: str, tmp_path: Path
) -> None:
    try:
        helm_bin = helm()
    except ToolUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"no helm here: {exc}")
    old_chart, new_chart = _charts(tmp_path)
    viewer = secrets.token_urlsafe(24)
    values: dict[str, Any] = {
        "auth": {"tokens": [
            {"name": "agents", "role": "agent", "token": secrets.token_urlsafe(24)},
            {"name": "sre", "role": "viewer", "token": viewer},
        ]},
        "database": {"url": pg_url},
        "agent": {"enabled": False},
        # The actuator is not what is upgraded here, and it would need cluster credentials.
        # The chart's own leader timings (leaderRetryIntervalSeconds, leaderLabel).
        "controller": {"replicas": 2, "actuator": "none"},
    }  # fmt: skip
    old_docs = _render(helm_bin, old_chart, values, tmp_path)
    # One shared agent token for the new chart (the old one knows no other): the controllers
    # run outside a cluster here, where the new default identity (TokenReview of projected
    # tokens) has no API server to ask.
    shared = {**values, "auth": {**values["auth"], "agentIdentity": "sharedToken"}}
    new_docs = _render(helm_bin, new_chart, shared, tmp_path)
    old_template = _one(old_docs, "Deployment")["spec"]["template"]
    new_deployment = _one(new_docs, "Deployment")
    assert new_deployment["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 1, "maxUnavailable": 1,
    }  # fmt: skip
    hooks = sorted(
        (d for d in new_docs if d["kind"] == "Job"),
        key=lambda d: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]),
    )
    assert [h["metadata"]["name"] for h in hooks] == [
        f"{RELEASE}-trainguard-migrate", f"{RELEASE}-trainguard-leader-hook",
    ]  # fmt: skip

    with FakeKube.running() as kube, ProcessSet(tmp_path / "logs") as procs:
        cluster = Cluster(kube, procs, free_port(), tmp_path)
        # -- the previous release, installed and serving --------------------------------
        cluster.learn_secrets(old_docs)
        cluster.service = _one(old_docs, "Service", f"{RELEASE}-trainguard")["spec"]["selector"]
        a = cluster.start_pod(old_template, "tg-old-a")
        assert wait_until(lambda: cluster.ready(a), timeout_s=60), procs[
            "tg-old-a-controller"
        ].log_tail(30)
        b = cluster.start_pod(old_template, "tg-old-b")
        assert wait_until(lambda: cluster.alive(b), timeout_s=60)
        probes_stop = threading.Event()
        threading.Thread(target=cluster.probe, args=(probes_stop,), daemon=True).start()
        poller = Poller(cluster, viewer)
        poller.start()
        time.sleep(2.0)

        # -- helm upgrade: hooks in weight order, then the objects ------------------------
        cluster.learn_secrets(new_docs)
        for hook in hooks:
            cluster.run_job(hook)
        assert cluster.labels(a)["trainguard.io/leader"] == "true"  # the hook labelled it
        assert cluster.labels(b)["trainguard.io/leader"] == "false"
        cluster.service = _one(new_docs, "Service", f"{RELEASE}-trainguard")["spec"]["selector"]
        template = new_deployment["spec"]["template"]
        # maxSurge 1 + maxUnavailable 1: a new pod, and the youngest old pod goes at once.
        n1 = cluster.start_pod(template, "tg-new-1")
        cluster.delete_pod("tg-old-b")
        assert wait_until(lambda: cluster.ready(n1), timeout_s=60), procs[
            "tg-new-1-controller"
        ].log_tail(30)
        n2 = cluster.start_pod(template, "tg-new-2")
        handover = time.monotonic()
        cluster.delete_pod("tg-old-a")  # the old leader: a standby takes over
        stopped_s = time.monotonic() - handover

        def new_leaders() -> int:
            return sum(cluster.labels(p).get("trainguard.io/leader") == "true" for p in (n1, n2))

        assert wait_until(lambda: new_leaders() == 1, timeout_s=10, interval_s=0.02)
        labelled_s = time.monotonic() - handover
        (leader,) = [
            p.name for p in (n1, n2) if cluster.labels(p).get("trainguard.io/leader") == "true"
        ]
        assert wait_until(lambda: cluster.ready(n2), timeout_s=60)
        time.sleep(2.0)
        poller.stop_event.set()
        poller.join()
        probes_stop.set()

    gap = poller.longest_gap_s()
    codes = [code for _, code in poller.results]
    print(f"upgrade: {len(codes)} calls, {codes.count(200)} answered 200, "
          f"{codes.count(503)} 503, {codes.count(0)} no endpoint/unreachable; "
          f"longest gap without an answer {gap:.2f} s; hand-over: old leader exited after "
          f"{stopped_s:.2f} s, new leader {leader} labelled after {labelled_s:.2f} s")  # fmt: skip
    assert gap <= MAX_GAP_S, f"the API did not answer for {gap:.2f} s"
    assert codes[-5:] == [200] * 5
