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
#: Longest name the API server takes for an Event (a DNS subdomain).
EVENT_NAME_MAX = 253


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
                name=event_name(meta["name"], time.time_ns()), namespace=namespace
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


def event_name(obj_name: str, t_ns: int) -> str:
    """``<object>.<time in hex>``, as kubectl and client-go name Events, cut to the 253
    characters of a DNS subdomain: an Event about a node with a 253-character name would
    otherwise be refused by the API server and the story lost. The cut object name keeps
    ending in an alphanumeric character, as the name's rules require."""
    suffix = f".{t_ns:x}"
    head = obj_name[: EVENT_NAME_MAX - len(suffix)].rstrip(".-")
    return f"{head}{suffix}"


__all__ = ["COMPONENT", "EVENT_NAME_MAX", "EventRecorder", "event_name"]
