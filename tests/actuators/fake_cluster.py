"""The fake API server made faithful where trainguard's Kubernetes package depends on it.

:class:`FakeCluster` extends :class:`tests.actuators.fake_kube.FakeKube` (which stays the
small server the actuator's older tests use) with what a real API server does and a naive
client would get wrong:

* ``PUT`` (replace) with a ``metadata.resourceVersion`` precondition: 409 ``Conflict`` when
  stale, as for patches; ``coordination.k8s.io/v1`` Leases and ``policy/v1``
  PodDisruptionBudgets are served.
* Strategic merge patches (``application/strategic-merge-patch+json``) with the merge keys
  of the real types trainguard touches: ``conditions`` by ``type``, ``containers``/``env``
  by ``name``, ``ownerReferences`` by ``uid``, ``finalizers`` as a set, ``$patch: delete``
  on list elements and ``$deleteFromPrimitiveList/<field>``; lists without a merge key
  (``taints``) are replaced, as in the real ``NodeSpec``.
* The ``nodes/status`` subresource: a patch there may change only ``status``.
* The eviction subresource computes PodDisruptionBudgets (``minAvailable`` /
  ``maxUnavailable`` as integers over the budget's matching Running pods): 429
  ``TooManyRequests`` with a ``DisruptionBudget`` cause when evicting would break one.
* Watches (``?watch=true``) stream ``ADDED``/``MODIFIED``/``DELETED`` from a bounded event
  history, ``BOOKMARK`` events when asked (``allowWatchBookmarks``), and an ``ERROR``
  event with a 410 ``Expired`` Status for a resourceVersion older than the history.
* Deletion honours finalizers (``deletionTimestamp`` set, object kept until its last
  finalizer goes) and garbage-collects dependents by ``ownerReferences`` uid (a JobSet's
  child Jobs, then their pods), ``propagationPolicy=Orphan`` only drops the references.
* Every object a client creates, patches or replaces, and every Eviction it posts, is
  checked against the schema of the chart's Kubernetes version (built-in kinds) or its
  project's published model (JobSet, TrainJob, PyTorchJob): ``tests.actuators.k8s_schema``.
  A failing write answers 422 ``Invalid`` and is kept in :attr:`FakeCluster.invalid_writes`;
  :meth:`FakeCluster.running` fails the test at its end if any was made (an Event the
  actuator could not write would otherwise pass unnoticed as ``event_error``).
* Enough of the Job and JobSet controllers and the scheduler for gang restarts
  (``fake_controllers.py``): a deleted
  or evicted pod fails its Job when ``backoffLimit`` is 0 (an eviction not, when the
  podFailurePolicy ignores ``DisruptionTarget``); :meth:`FakeCluster.reconcile_jobset`
  creates the child Jobs and their pods on schedulable, untainted nodes and, when a child
  Job failed, recreates them all (``status.restarts`` + 1) until
  ``failurePolicy.maxRestarts``, then fails the JobSet; and it acts as the Kubeflow Training
  Operator would: :meth:`FakeCluster.reconcile_pytorchjob` recreates a PyTorchJob's deleted
  pods (and Failed ones its ``restartPolicy: ExitCode`` retries) from the current spec,
  with the operator's labels, torchrun environment (``PET_*``) and pod ``restartPolicy``.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.actuators import fake_kube
from tests.actuators.fake_controllers import WorkloadControllers
from tests.actuators.fake_kube import ApiError, FakeKube, Key, _Handler, merge_patch
from tests.actuators.k8s_schema import schema_errors

fake_kube.KINDS.update(
    {
        ("coordination.k8s.io", "leases"): ("coordination.k8s.io/v1", "Lease"),
        ("policy", "poddisruptionbudgets"): ("policy/v1", "PodDisruptionBudget"),
        ("apps", "daemonsets"): ("apps/v1", "DaemonSet"),
        ("trainer.kubeflow.org", "trainjobs"): ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
    }
)

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
#: List fields merged by a key in strategic merge patches (as in the real Go types).
MERGE_KEYS = {
    "conditions": "type",
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "ownerReferences": "uid",
    "tolerations": "key",
}
#: Lists of scalars that strategic merge patches union instead of replacing.
SET_LISTS = {"finalizers"}
_BUILTIN_GROUPS = {"", "batch", "coordination.k8s.io", "policy", "apps"}


def strategic_merge(target: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch over plain JSON: like RFC 7386 except keyed and set lists."""
    if isinstance(patch, list):
        if field in MERGE_KEYS and isinstance(target, list):
            return _merge_keyed(target, patch, MERGE_KEYS[field])
        if field in SET_LISTS and isinstance(target, list):
            return target + [v for v in patch if v not in target]
        return copy.deepcopy(patch)
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            out[name] = [v for v in out.get(name) or [] if v not in value]
        elif key.startswith("$"):
            continue
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge(out.get(key), value, key)
    return out


def _merge_keyed(target: list[Any], patch: list[Any], key: str) -> list[Any]:
    out = [copy.deepcopy(t) for t in target]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(422, "Invalid", f"strategic merge: list element without {key!r}")
        at = next((i for i, t in enumerate(out) if t.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                out.pop(at)
        elif at is None:
            out.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            out[at] = strategic_merge(out[at], item)
    return out


def _label_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


class _Store(dict[Key, dict[str, Any]]):
    """The object store; every write is also a watch event (the server's history)."""

    def __init__(self, owner: FakeCluster) -> None:
        super().__init__()
        self.owner = owner

    def __setitem__(self, key: Key, obj: dict[str, Any]) -> None:
        kind = "MODIFIED" if key in self else "ADDED"
        super().__setitem__(key, obj)
        self.owner._record(kind, key, obj)

    def __delitem__(self, key: Key) -> None:
        obj = self[key]
        super().__delitem__(key)
        self.owner._record("DELETED", key, obj)

    def pop(self, key: Key, *default: Any) -> Any:
        if key not in self and default:
            return default[0]
        obj = self[key]
        del self[key]
        return obj


class FakeCluster(WorkloadControllers, FakeKube):
    def __init__(self) -> None:
        super().__init__()
        # The base server treats every named group but batch as a CRD; these are built in.
        self.crd_groups |= {"trainer.kubeflow.org"} | (_BUILTIN_GROUPS - {""})
        #: (event type, key, object) in the order they happened. The base server sets an
        #: object's resourceVersion just after storing it (and shares nested dicts between
        #: versions), so each entry is copied at the next write or read, not at once.
        self.history: list[tuple[str, Key, dict[str, Any]]] = []
        self._unfrozen = 0
        #: Events older than the newest ``history_limit`` are compacted (watches from
        #: before them get 410 Gone).
        self.history_limit = 1000
        self.changed = threading.Condition(self.lock)
        self.objects = _Store(self)
        #: Seconds between BOOKMARK events on watches that asked for them.
        self.bookmark_interval_s = 0.2
        #: Check every client write against the schema (``k8s_schema``).
        self.validate_writes = True
        #: "<method> <path>: <why>" for each write that failed the check.
        self.invalid_writes: list[str] = []
        #: (group, resource, verb) -> how many more such calls succeed before each answers
        #: 500: a failure half-way through a sequence of calls.
        self.faults: dict[tuple[str, str, str], int] = {}
        #: (group, resource, verb) -> what other writers do just before each such call is
        #: served, in order (``None``: nothing that time): ``fn(cluster, key)`` may change
        #: the object, so a resourceVersion-guarded write answers 409 as on a busy cluster.
        self.concurrent_writes: dict[tuple[str, str, str], list[Any]] = {}

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[FakeCluster]:
        kube = cls()
        handler = type("Handler", (_ClusterHandler,), {"kube": kube})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        kube._server = server
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield kube
        finally:
            server.shutdown()
            server.server_close()
        assert not kube.invalid_writes, f"invalid writes: {kube.invalid_writes}"

    # -- history -----------------------------------------------------------------------

    def _freeze(self) -> None:
        for i in range(len(self.history) - self._unfrozen, len(self.history)):
            kind, key, obj = self.history[i]
            self.history[i] = (kind, key, copy.deepcopy(obj))
        self._unfrozen = 0

    def _record(self, kind: str, key: Key, obj: dict[str, Any]) -> None:
        self._freeze()
        if kind == "DELETED":
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = self._next_rv()
        self.history.append((kind, key, obj))
        self._unfrozen = 1
        del self.history[: -self.history_limit]
        self.changed.notify_all()

    def compact(self) -> None:
        """Forget the event history, as etcd compaction does (older watches get 410)."""
        with self.lock:
            self._next_rv()
            self.history.clear()
            self._unfrozen = 0

    def oldest_rv(self) -> int:
        with self.lock:
            return _rv_of(self.history[0][2]) if self.history else self._rv

    # -- requests ----------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any, ctype: str) -> Any:
        """Serve one request; a client's write must leave a schema-valid object."""
        if self.validate_writes and method == "POST" and path.endswith("/eviction"):
            self._check_schema(method, path, {"apiVersion": "policy/v1", "kind": "Eviction"}, body)
        result = self._serve_request(method, path, query, body, ctype)
        if (
            self.validate_writes
            and method in ("POST", "PATCH", "PUT")
            and not path.endswith("/eviction")
            and isinstance(result, dict)
            and result.get("kind") not in (None, "Status", "TokenReview")
        ):
            self._check_schema(method, path, {}, result)
        return result

    def _check_schema(
        self, method: str, path: str, defaults: dict[str, Any], obj: dict[str, Any]
    ) -> None:
        errors = schema_errors({**defaults, **(obj or {})})
        if errors:
            what = f"{method} {path}: {'; '.join(errors[:3])}"
            self.invalid_writes.append(what)
            raise ApiError(422, "Invalid", f"schema check failed: {what}")

    def _serve_request(
        self, method: str, path: str, query: dict[str, str], body: Any, ctype: str
    ) -> Any:
        parts = [p for p in path.split("/") if p]
        group = "" if parts[:2] == ["api", "v1"] else (parts[1] if len(parts) > 1 else "")
        rest = parts[2:] if group == "" else parts[3:]
        ns = ""
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            ns, rest = rest[1], rest[2:]
        if not rest:
            return super().handle(method, path, query, body, ctype)
        plural, name, sub = rest[0], (rest[1:2] or [""])[0], (rest[2:3] or [""])[0]
        if group and group not in _BUILTIN_GROUPS | self.crd_groups:
            return super().handle(method, path, query, body, ctype)
        key = (group, plural, ns, name)
        resource = f"{plural}/{sub}" if sub else plural
        with self.lock:
            if method == "PUT":
                self._serve_check(group, resource, "update", name, key)
                return self._replace(key, body)
            if method == "DELETE" and name and not sub:
                self._serve_check(group, resource, "delete", name, key)
                gone = self._delete(key, query, body)
                if plural == "pods":
                    self._pod_failed(gone, evicted=False)
                return gone
            if method == "PATCH" and sub == "status":
                self._serve_check(group, resource, "patch", name, key)
                return self._patch_status(key, body, ctype)
            if method == "PATCH" and ctype == STRATEGIC and not sub:
                self._serve_check(group, resource, "patch", name, key)
                return self._strategic(key, body)
            if method == "PATCH" and not sub and key in self.objects:
                self._serve_check(group, resource, "patch", name, key)
                return self._patch_finalized(key, body, ctype)
            if method == "POST" and sub == "eviction":
                self._serve_check(group, resource, "create", name, key)
                return self._evict(ns, name)
        return super().handle(method, path, query, body, ctype)

    def _serve_check(
        self, group: str, resource: str, verb: str, name: str, key: Any = None
    ) -> None:
        self.served.append((group, resource, verb))
        pending = self.concurrent_writes.get((group, resource, verb))
        if pending:
            other = pending.pop(0)
            if other is not None:
                other(self, key)
        left = self.faults.get((group, resource, verb))
        if left is not None:
            if left <= 0:
                raise ApiError(500, "InternalError", f"injected fault on {verb} {resource}")
            self.faults[(group, resource, verb)] = left - 1
        if (group, resource, verb) in self.forbidden:
            raise ApiError(
                403,
                "Forbidden",
                f'{resource} "{name}" is forbidden: User "system:serviceaccount:tg:trainguard"'
                f' cannot {verb} resource "{resource}" in API group "{group}"',
            )

    def _stale(self, key: Key, body: Any) -> None:
        want = (body or {}).get("metadata", {}).get("resourceVersion")
        have = self.objects[key]["metadata"]["resourceVersion"]
        if want not in (None, "") and want != have:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )

    def _store(self, key: Key, new: dict[str, Any]) -> dict[str, Any]:
        new["metadata"]["resourceVersion"] = self._next_rv()
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.objects[key]
            self._collect(key, new)
        else:
            self.objects[key] = new
        return copy.deepcopy(new)

    def _replace(self, key: Key, body: dict[str, Any]) -> Any:
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        self._stale(key, body)
        old = self.objects[key]
        new = copy.deepcopy(body)
        for kept in ("uid", "creationTimestamp", "deletionTimestamp", "namespace"):
            if kept in old["metadata"]:
                new["metadata"][kept] = old["metadata"][kept]
        return self._store(key, new)

    def _strategic(self, key: Key, body: Any) -> Any:
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        if key[0] not in _BUILTIN_GROUPS:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                "include: application/json-patch+json, application/merge-patch+json, "
                "application/apply-patch+yaml",
            )
        self._stale(key, body)
        new = strategic_merge(self.objects[key], body)
        new["metadata"]["resourceVersion"] = self.objects[key]["metadata"]["resourceVersion"]
        return self._store(key, new)

    def _patch_finalized(self, key: Key, body: Any, ctype: str) -> Any:
        """Merge patches through the base server, then drop an object whose deletion only
        waited for the finalizer the patch removed."""
        out = self._patch(key, body, ctype)
        obj = self.objects[key]
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            del self.objects[key]
            self._collect(key, obj)
        return out

    def _patch_status(self, key: Key, body: Any, ctype: str) -> Any:
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        self._stale(key, body)
        old = self.objects[key]
        status_only = {"status": (body or {}).get("status", {})}
        if ctype == STRATEGIC:
            new = strategic_merge(old, status_only)
        elif ctype == MERGE:
            new = merge_patch(old, status_only)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
        return self._store(key, new)

    def _delete(self, key: Key, query: dict[str, str], body: Any) -> Any:
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'{key[1]} "{key[3]}" not found')
        obj = self.objects[key]
        policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
        if obj["metadata"].get("finalizers"):
            if not obj["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:01Z"
                self._store(key, new)
            return copy.deepcopy(self.objects[key])
        del self.objects[key]
        self._collect(key, obj, orphan=policy == "Orphan")
        return obj

    def _collect(self, key: Key, obj: dict[str, Any], *, orphan: bool = False) -> None:
        """The garbage collector: dependents of a deleted owner go too (or lose the ref)."""
        uid = obj["metadata"].get("uid")
        for dep_key, dep in list(self.objects.items()):
            refs = dep["metadata"].get("ownerReferences") or []
            if dep_key[2] != key[2] or not any(r.get("uid") == uid for r in refs):
                continue
            if orphan:
                new = copy.deepcopy(dep)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                self._store(dep_key, new)
            else:
                self._delete(dep_key, {}, None)

    def _evict(self, ns: str, name: str) -> Any:
        pod = self.objects.get(("", "pods", ns, name))
        if pod is not None:
            for (g, p, pns, _), pdb in list(self.objects.items()):
                if (g, p, pns) == ("policy", "poddisruptionbudgets", ns):
                    self._check_budget(pdb, pod)
        out = super()._evict(ns, name)
        if pod is not None:
            self._pod_failed(pod, evicted=True)
        return out

    def _check_budget(self, pdb: dict[str, Any], pod: dict[str, Any]) -> None:
        selector = pdb["spec"].get("selector") or {}
        if not _label_match(selector, pod["metadata"].get("labels") or {}):
            return
        covered = [
            p
            for (g, pl, pns, _), p in self.objects.items()
            if (g, pl, pns) == ("", "pods", pod["metadata"].get("namespace", ""))
            and _label_match(selector, p["metadata"].get("labels") or {})
        ]
        healthy = sum(1 for p in covered if p.get("status", {}).get("phase") == "Running")
        spec = pdb["spec"]
        if "minAvailable" in spec:
            allowed = healthy - int(spec["minAvailable"])
        else:
            allowed = int(spec.get("maxUnavailable", 0)) - (len(covered) - healthy)
        if allowed <= 0:
            name = pdb["metadata"]["name"]
            raise ApiError(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {name} needs "
                        f"{spec.get('minAvailable', '?')} healthy pods and has {healthy} "
                        "currently",
                    }
                ],
            )

    # -- watch -------------------------------------------------------------------------

    def watch_events(
        self, group: str, plural: str, ns: str, query: dict[str, str]
    ) -> Iterator[dict[str, Any]]:
        """The events a watch sends, until ``timeoutSeconds`` (default 5) pass."""
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 5)
        kind = fake_kube.KINDS[(group, plural)]
        with self.lock:
            self._freeze()
            self.served.append((group, plural, "watch"))
            expired = since and since < self.oldest_rv() - 1
            initial = [] if since else self.items(group, plural, ns or None)
            since = since or self._rv
        if expired:
            yield {"type": "ERROR", "object": _gone(since)}
            return
        for obj in initial:  # no resourceVersion: the current state as ADDED, then changes
            yield {"type": "ADDED", "object": obj}
        next_bookmark = time.monotonic() + self.bookmark_interval_s
        while time.monotonic() < deadline:
            with self.lock:
                self._freeze()
                fresh = [
                    (_rv_of(o), t, copy.deepcopy(o))
                    for t, k, o in self.history
                    if _rv_of(o) > since and k[:2] == (group, plural) and (not ns or k[2] == ns)
                ]
                if not fresh:
                    self.changed.wait(min(self.bookmark_interval_s, 0.1))
                current = self._rv
            for rv, etype, obj in fresh:
                since = max(since, rv)
                yield {"type": etype, "object": obj}
            if bookmarks and time.monotonic() >= next_bookmark:
                next_bookmark = time.monotonic() + self.bookmark_interval_s
                since = max(since, current)
                yield {
                    "type": "BOOKMARK",
                    "object": {
                        "apiVersion": kind[0],
                        "kind": kind[1],
                        "metadata": {"resourceVersion": str(since)},
                    },
                }


def _rv_of(obj: dict[str, Any]) -> int:
    return int(obj["metadata"].get("resourceVersion") or 0)


def _refs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["metadata"].get("ownerReferences") or [])


def _gone(since: int) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {since}",
        "reason": "Expired",
        "code": 410,
    }


class _ClusterHandler(_Handler):
    kube: FakeCluster

    def _serve(self) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if self.command != "GET" or query.get("watch") not in ("true", "1"):
            super()._serve()
            return
        parts = [p for p in url.path.split("/") if p]
        group = "" if parts[:2] == ["api", "v1"] else parts[1]
        rest = parts[2:] if group == "" else parts[3:]
        ns = rest[1] if rest[:1] == ["namespaces"] else ""
        plural = rest[2] if ns else rest[0]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in self.kube.watch_events(group, plural, ns, query):
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve
