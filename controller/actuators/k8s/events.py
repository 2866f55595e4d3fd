"""Kubernetes Events for every detection and action, so ``kubectl describe`` tells it.

An Event is a courtesy to the people reading the cluster: failing to write one never fails
the action it describes (the caller gets the error back as a string to record). Events
about Nodes (cluster-scoped) go to ``node_event_namespace`` (``default``), the only place
the API server accepts them; events about a workload go to the workload's namespace.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import UTC, datetime
from typing import Any, Final

from kubernetes import client

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.api import Kube

COMPONENT: Final = "trainguard"


class EventRecorder:
    def __init__(self, kube: Kube, *, node_event_namespace: str = "default") -> None:
        self.kube = kube
        self.node_event_namespace = node_event_namespace
        self.instance = os.environ.get("POD_NAME") or socket.gethostname()

    async def emit(
        self, obj: dict[str, Any], reason: str, message: str, *, warning: bool = False
    ) -> str | None:
        """A core/v1 Event about ``obj``; answers the error as one line, or ``None``."""
        meta, now = obj["metadata"], datetime.now(UTC)
        namespace = meta.get("namespace") or self.node_event_namespace
        involved = client.V1ObjectReference(
            api_version=obj.get("apiVersion"),
            kind=obj.get("kind"),
            name=meta["name"],
            namespace=meta.get("namespace"),
            uid=meta.get("uid"),
        )
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{meta['name']}.{time.time_ns():x}", namespace=namespace
            ),
            involved_object=involved,
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT,
            reporting_instance=self.instance[:128],
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        what = f"create event {reason} for {obj.get('kind')} {meta['name']}"
        try:
            await self.kube.write(what, self.kube.core.create_namespaced_event, namespace, body)
        except ActuatorError as exc:
            return str(exc)
        return None


__all__ = ["COMPONENT", "EventRecorder"]
