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

import httpx
import pytest
from kubernetes import client

from tests.actuators.fake_kube import FakeKube
from trainguard.cli.leader_label import LABEL, Labeler, leads

NS = "tg-system"
POD = "tg-trainguard-6c9f-abcde"


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
    def __init__(self) -> None:
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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"


@pytest.fixture
def metrics() -> Iterator[_Metrics]:
    m = _Metrics()
    thread = threading.Thread(target=m.server.serve_forever, daemon=True)
    thread.start()
    yield m
    m.server.shutdown()
    m.server.server_close()


@pytest.mark.slow
def test_label_follows_leadership_and_patches_only_on_change(metrics: _Metrics) -> None:
    with FakeKube.running() as kube, httpx.Client(timeout=2.0) as http:
        kube.put("", "pods", {"metadata": {"name": POD, "namespace": NS,
                                           "labels": {LABEL: "false", "app": "x"}}})  # fmt: skip
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=kube.url)))
        labeler = Labeler(core, POD, NS, http, metrics.url)

        def label() -> str:
            pod = kube.get("", "pods", NS, POD)
            assert pod is not None
            return str(pod["metadata"]["labels"][LABEL])

        def patches() -> int:
            return sum(1 for s in kube.served if s == ("", "pods", "patch"))

        assert labeler.tick() == "false" and label() == "false"
        metrics.value = 1.0  # won the lock
        assert labeler.tick() == "true" and label() == "true"
        count = patches()
        labeler.tick()
        assert patches() == count  # unchanged leadership: no API write
        metrics.up = False  # controller not answering: stop taking traffic
        assert labeler.tick() == "false" and label() == "false"
        metrics.up, metrics.value = True, 1.0
        kube.forbidden.add(("", "pods", "patch"))  # RBAC missing: retried every tick
        assert labeler.tick() == "true" and label() == "false"
        kube.forbidden.clear()
        assert labeler.tick() == "true" and label() == "true"
        assert kube.get("", "pods", NS, POD)["metadata"]["labels"]["app"] == "x"  # type: ignore[index]
