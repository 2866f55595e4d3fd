"""The leader-label sidecar: the pod label follows the controller's leader gauge.

The label is patched through the real ``kubernetes`` client against the stateful fake API
server of the actuator tests; the gauge comes from a real HTTP server whose answer the test
flips, as a replica winning and losing the lock would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client

from tests import http_calls
from tests.actuators.fake_kube import FakeKube
from trainguard.cli.leader_label import LABEL, Labeler, leads

NS = "tg-system"


@pytest.mark.parametrize(
    ("text", "leader"),
    [
        ("# HELP trainguard_controller_leader x\ntrainguard_controller_leader 1.0\n", True),
        ("trainguard_controller_leader 0.0\n", False),
        ("trainguard_controller_leader_other 1.0\ntrainguard_nodes 3\n", False),
        ('trainguard_controller_leader{pod="a"} 1\n', True),
        ("", False),
    ],
)
def test_gauge_is_read_from_the_exposition(text: str, leader: bool) -> None:
    assert leads(text) is leader


class _Metrics:
    """A controller pod's /metrics on its own loopback address (pods share the port)."""

    def __init__(self, ip: str, port: int = 0) -> None:
        self.value = 0.0
        self.up = True
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if not outer.up:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = f"trainguard_controller_leader {outer.value}\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((ip, port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SELECTOR = "app.kubernetes.io/instance=tg,app.kubernetes.io/component=controller"
LABELS = {"app.kubernetes.io/instance": "tg", "app.kubernetes.io/component": "controller"}


@pytest.fixture
def pods() -> Iterator[dict[str, _Metrics]]:
    """Three controller pods: 127.0.0.2-4, one shared port (as in a cluster)."""
    first = _Metrics("127.0.0.2")
    made = {"tg-a": first, "tg-b": _Metrics("127.0.0.3", first.port),
            "tg-c": _Metrics("127.0.0.4", first.port)}  # fmt: skip
    yield made
    for m in made.values():
        m.close()


@pytest.mark.slow
def test_labels_follow_leadership_across_the_release(pods: dict[str, _Metrics]) -> None:
    with FakeKube.running() as kube, http_calls.client(timeout=2.0) as http:
        port = pods["tg-a"].port
        for i, name in enumerate(pods):
            # tg-a is a pod of the previous release: no label yet (no sidecar).
            labels = dict(LABELS) if name == "tg-a" else {**LABELS, LABEL: "false"}
            status = {"phase": "Running", "podIP": f"127.0.0.{i + 2}"}
            meta = {"name": name, "namespace": NS, "labels": labels}
            kube.put("", "pods", {"metadata": meta, "status": status})
        kube.put("", "pods", {"metadata": {"name": "other", "namespace": NS, "labels": {}},
                              "status": {"phase": "Running", "podIP": "127.0.0.9"}})  # fmt: skip
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=kube.url)))
        labeler = Labeler(core, NS, SELECTOR, http, port)

        def labels() -> dict[str, str | None]:
            found = {}
            for name in (*pods, "other"):
                pod = kube.get("", "pods", NS, name)
                assert pod is not None
                found[name] = pod["metadata"]["labels"].get(LABEL)
            return found

        def patches() -> int:
            return sum(1 for s in kube.served if s == ("", "pods", "patch"))

        pods["tg-a"].value = 1.0  # the old release's leader
        assert labeler.tick() == {"tg-a": "true", "tg-b": "false", "tg-c": "false"}
        assert labels() == {"tg-a": "true", "tg-b": "false", "tg-c": "false", "other": None}
        count = patches()
        labeler.tick()
        assert patches() == count  # nothing changed: no API write
        # Hand-over: tg-a stops answering (terminating), tg-c wins the lock.
        pods["tg-a"].up, pods["tg-c"].value = False, 1.0
        labeler.tick()
        assert labels() == {"tg-a": "false", "tg-b": "false", "tg-c": "true", "other": None}
        # A pod that is not Running is never the leader, whatever it answers.
        kube.put("", "pods", {"metadata": {"name": "tg-c", "namespace": NS,
                                           "labels": {**LABELS, LABEL: "true"}},
                              "status": {"phase": "Pending", "podIP": "127.0.0.4"}})  # fmt: skip
        assert labeler.tick()["tg-c"] == "false" and labels()["tg-c"] == "false"
        # RBAC missing: nothing changes, and the next pass retries.
        pods["tg-b"].value = 1.0
        kube.forbidden.add(("", "pods", "patch"))
        labeler.tick()
        assert labels()["tg-b"] == "false"
        kube.forbidden.clear()
        labeler.tick()
        assert labels()["tg-b"] == "true"
