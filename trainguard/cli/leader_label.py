"""``trainguard leader-label``: mirror a controller's leadership into its pod's label.

Replicas of the controller elect one leader on PostgreSQL; a standby answers API calls
with 503. For a rollout to finish, a healthy standby must be Ready, so readiness cannot
be what keeps users and agents on the leader. Instead, this sidecar (one per controller
pod, helm value ``controller.leaderLabel``) reads the controller's
``trainguard_controller_leader`` gauge from ``/metrics`` (no token needed) and patches its
own pod's ``trainguard.io/leader`` label to ``"true"`` or ``"false"``; the chart's Service
selects ``"true"``.

Failure modes, each erring towards "not leader": ``/metrics`` unreachable or the gauge
missing reads as "false"; a failed patch is retried on the next tick; on SIGTERM the label
goes to "false" first. A replica that loses the lock flips to "false" within one interval;
until then its StandbyGate answers 503 with ``Retry-After``, which agents and the CLI retry.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import typer

from trainguard.cli.errors import BadInput

LABEL = "trainguard.io/leader"
GAUGE = "trainguard_controller_leader"
MERGE_PATCH = "application/merge-patch+json"

log = logging.getLogger("trainguard.leader_label")


def leads(metrics_text: str) -> bool:
    """Whether a Prometheus exposition says this replica leads (gauge at 1)."""
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name == GAUGE or name.startswith(GAUGE + "{"):
            try:
                return float(value.split()[0]) >= 1.0
            except (ValueError, IndexError):
                return False
    return False


def read_leadership(http: httpx.Client, metrics_url: str) -> bool:
    try:
        reply = http.get(metrics_url)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and leads(reply.text)


@dataclass(slots=True)
class Labeler:
    """Keeps one pod's label equal to its controller's leadership; :meth:`tick` once a turn."""

    core: Any  # kubernetes.client.CoreV1Api
    pod: str
    namespace: str
    http: httpx.Client
    metrics_url: str
    applied: str | None = None

    def set_label(self, value: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"labels": {LABEL: value}}}
        try:
            self.core.patch_namespaced_pod(
                self.pod, self.namespace, body, _content_type=MERGE_PATCH
            )
        except (ApiException, OSError) as exc:
            reason = getattr(exc, "status", None) or type(exc).__name__
            log.warning("cannot label pod %s/%s: %s", self.namespace, self.pod, reason)
            return False
        self.applied = value
        return True

    def tick(self) -> str:
        """Read leadership, patch the label when it changed; returns the wanted value."""
        wanted = "true" if read_leadership(self.http, self.metrics_url) else "false"
        if wanted != self.applied and self.set_label(wanted):
            log.info("pod %s/%s: %s=%s", self.namespace, self.pod, LABEL, wanted)
        return wanted


def _core_api(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException as exc:
        raise BadInput(f"leader-label: no Kubernetes credentials: {exc}") from exc
    return client.CoreV1Api()


def leader_label(
    metrics_url: Annotated[
        str, typer.Option("--metrics-url", help="The controller's /metrics in this pod.")
    ] = "http://127.0.0.1:8470/metrics",
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, max=60.0, help="Seconds between checks.")
    ] = 1.0,
    pod: Annotated[
        str | None, typer.Option("--pod", envvar="POD_NAME", help="This pod's name.")
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option("--pod-namespace", envvar="POD_NAMESPACE", help="This pod's namespace."),
    ] = None,
    kubeconfig: Annotated[
        str | None,
        typer.Option("--kubeconfig", help="Outside a pod: a kubeconfig instead of in-cluster."),
    ] = None,
) -> None:
    """Sidecar: label this controller pod trainguard.io/leader=true|false as it leads."""
    if not pod or not namespace:
        raise BadInput("leader-label needs --pod and --pod-namespace (or POD_NAME, POD_NAMESPACE)")
    logging.basicConfig(level=os.environ.get("TRAINGUARD_LOG_LEVEL", "INFO").upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with httpx.Client(timeout=min(2.0, interval * 2 + 0.5)) as http:
        labeler = Labeler(_core_api(kubeconfig), pod, namespace, http, metrics_url)
        while not stop.is_set():
            labeler.tick()
            stop.wait(interval)
        labeler.set_label("false")  # leaving: take no more traffic


def register(app: typer.Typer) -> None:
    app.command("leader-label", rich_help_panel="Run")(leader_label)


__all__ = ["GAUGE", "LABEL", "Labeler", "leader_label", "leads", "register"]
