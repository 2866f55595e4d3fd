"""The Nodes' own view of their health: a list+watch cache that survives 410 Gone.

Used as the second signal of :mod:`~controller.actuators.k8s.partition` (is the silent
agent's Node still ``Ready``?). It lists once, then watches from the list's
``resourceVersion`` with bookmarks (so a quiet watch still advances its
``resourceVersion`` and a reconnect does not replay history), and relists when the API
server answers 410 Gone (the version was compacted away), as client-go's reflector does.
"""

from __future__ import annotations

import asyncio

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from controller.actuators.k8s.api import Kube
from controller.actuators.kube_objects import node_ready


class NodeCache:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.ready: dict[str, bool | None] = {}
        self.resource_version = ""
        self.relists = 0

    async def relist(self) -> None:
        nodes = await self.kube.read("list nodes", self.kube.core.list_node)
        self.ready = {n["metadata"]["name"]: node_ready(n) for n in nodes.get("items") or []}
        self.resource_version = nodes["metadata"]["resourceVersion"]
        self.relists += 1

    async def watch_once(self, timeout_s: int = 30) -> None:
        """One watch call (lists first if needed); a 410 Gone relists."""
        if not self.resource_version:
            await self.relist()
        try:
            await asyncio.to_thread(self._watch, timeout_s)
        except ApiException as exc:
            if exc.status != 410:
                raise
            await self.relist()

    def _watch(self, timeout_s: int) -> None:
        w = watch.Watch()  # type: ignore[no-untyped-call]
        stream = w.stream(  # type: ignore[no-untyped-call]
            self.kube.core.list_node,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
        )
        for event in stream:
            kind, obj = event["type"], event["raw_object"]
            if kind in ("ADDED", "MODIFIED"):
                self.ready[obj["metadata"]["name"]] = node_ready(obj)
            elif kind == "DELETED":
                self.ready.pop(obj["metadata"]["name"], None)
            self.resource_version = obj["metadata"].get("resourceVersion") or (
                self.resource_version
            )


__all__ = ["NodeCache"]
