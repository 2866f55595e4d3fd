"""``trainguard leader-label``: mirror each controller replica's leadership into its pod label.

Replicas of the controller elect one leader on PostgreSQL; a standby answers API calls
with 503. For a rollout to finish, a healthy standby must be Ready, so readiness cannot
be what keeps users and agents on the leader. Instead every controller pod of the release
carries ``trainguard.io/leader: "true"|"false"`` and the chart's Service selects
``"true"``. This command keeps those labels right: it lists the release's controller pods,
reads each one's ``trainguard_controller_leader`` gauge from ``http://<pod IP>:<port>/metrics``
(no token needed) and patches the label where it differs.

It runs as a sidecar in every controller pod (each one keeps *all* the release's pods
labelled, so a pod of the previous release, which has no sidecar, is labelled too), and
once (``--once``) as a pre-upgrade hook, so that the old leader carries the label before the
upgraded Service starts selecting by it.

Failure modes err towards "not leader": a pod that is not Running, has no IP, does not
answer or lacks the gauge is labelled "false"; a failed patch is retried on the next tick.
A replica that loses the lock flips within one interval; until then its StandbyGate answers
503 with ``Retry-After``, which agents and the CLI retry.
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
from trainguard.tls import default_context

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
    """Keeps the leader label of every selected pod right; :meth:`tick` once a turn."""

    core: Any  # kubernetes.client.CoreV1Api
    namespace: str
    selector: str
    http: httpx.Client
    port: int = 8470

    def wanted(self, pod: Any) -> str:
        ip = pod.status.pod_ip if pod.status else None
        running = pod.status is not None and pod.status.phase == "Running"
        if not ip or not running or pod.metadata.deletion_timestamp:
            return "false"
        url = f"http://{ip}:{self.port}/metrics"
        return "true" if read_leadership(self.http, url) else "false"

    def set_label(self, pod: str, value: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"labels": {LABEL: value}}}
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, body, _content_type=MERGE_PATCH)
        except (ApiException, OSError) as exc:
            reason = getattr(exc, "status", None) or type(exc).__name__
            log.warning("cannot label pod %s/%s: %s", self.namespace, pod, reason)
            return False
        log.info("pod %s/%s: %s=%s", self.namespace, pod, LABEL, value)
        return True

    def tick(self) -> dict[str, str]:
        """One pass: pod name -> the label it should carry (patched where it differs)."""
        from kubernetes.client.exceptions import ApiException

        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        except (ApiException, OSError) as exc:
            reason = getattr(exc, "status", None) or type(exc).__name__
            log.warning("cannot list pods in %s: %s", self.namespace, reason)
            return {}
        result: dict[str, str] = {}
        for pod in pods.items:
            name = pod.metadata.name
            result[name] = self.wanted(pod)
            if (pod.metadata.labels or {}).get(LABEL) != result[name]:
                self.set_label(name, result[name])
        return result


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
    ctx: typer.Context,
    selector: Annotated[
        str,
        typer.Option(
            "--selector", help="Label selector of the release's controller pods (a=b,c=d)."
        ),
    ],
    namespace: Annotated[
        str | None,
        typer.Option("--pod-namespace", envvar="POD_NAMESPACE", help="Their namespace."),
    ] = None,
    port: Annotated[
        int, typer.Option("--port", min=1, max=65535, help="The controllers' HTTP port.")
    ] = 8470,
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, max=60.0, help="Seconds between passes.")
    ] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="One pass, then exit.")] = False,
) -> None:
    """Label the release's controller pods trainguard.io/leader=true|false as they lead.

    In a pod it uses the pod's ServiceAccount; elsewhere the global --kubeconfig.
    """
    root = ctx.find_root().obj
    kube = root.get("kube") if isinstance(root, dict) else None
    kubeconfig = getattr(kube, "kubeconfig", None)
    if not namespace:
        raise BadInput("leader-label needs --pod-namespace (or POD_NAMESPACE)")
    logging.basicConfig(level=os.environ.get("TRAINGUARD_LOG_LEVEL", "INFO").upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with httpx.Client(timeout=min(2.0, interval * 2 + 0.5), verify=default_context()) as http:
        labeler = Labeler(_core_api(kubeconfig), namespace, selector, http, port)
        labeler.tick()
        while not once and not stop.wait(interval):
            labeler.tick()


def register(app: typer.Typer) -> None:
    app.command("leader-label", rich_help_panel="Run")(leader_label)


__all__ = ["GAUGE", "LABEL", "Labeler", "leader_label", "leads", "register"]
