"""A small stateful Kubernetes API server for driving the real ``kubernetes`` client.

It keeps objects in memory and serves the REST subset the Kubernetes actuator uses: nodes,
pods (list with label/field selectors, delete, the eviction subresource), events (create),
batch/v1 Jobs and custom resources under ``/apis/<group>/<version>/namespaces/<ns>/<plural>``.
Patches are JSON merge patches (RFC 7386), the only kind the actuator sends; a
``metadata.resourceVersion`` in a patch is a precondition (409 when stale), as on a real API
server. Errors are ``Status`` objects with the real codes and reasons.

A little controller behaviour is simulated because the actuator depends on it: suspending a
Job, JobSet or PyTorchJob deletes its pods (and clears a Job's ``status.startTime`` /
``active``), and a batch Job's pod template may change only while it is suspended and
not started, its ``completions`` only on Indexed Jobs and together with ``parallelism``.

Every request is recorded as ``(group, resource, verb)`` in :attr:`FakeKube.served`, so a
test can check the calls against the actuator's RBAC rules; :attr:`FakeKube.forbidden`
makes chosen ones answer 403.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

Key = tuple[str, str, str, str]  # (group, plural, namespace, name); group "" is core

KINDS = {
    ("", "nodes"): ("v1", "Node"),
    ("", "pods"): ("v1", "Pod"),
    ("", "events"): ("v1", "Event"),
    ("batch", "jobs"): ("batch/v1", "Job"),
    ("jobset.x-k8s.io", "jobsets"): ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    ("kubeflow.org", "pytorchjobs"): ("kubeflow.org/v1", "PyTorchJob"),
}
SUSPEND_PATH = {
    "jobs": ("spec", "suspend"),
    "jobsets": ("spec", "suspend"),
    "pytorchjobs": ("spec", "runPolicy", "suspend"),
    "trainjobs": ("spec", "suspend"),
}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, causes: Any = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.causes = code, reason, causes

    def status(self) -> dict[str, Any]:
        details = {"causes": self.causes} if self.causes else {}
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": str(self),
            "reason": self.reason,
            "details": details,
            "code": self.code,
        }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, ``null`` deletes, everything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


def _field_value(obj: dict[str, Any], path: str) -> Any:
    return _dig(obj, tuple(path.split(".")))


class FakeKube:
    """The server; ``with FakeKube.running() as kube:`` gives one on an ephemeral port."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.served: list[tuple[str, str, str]] = []
        self.forbidden: set[tuple[str, str, str]] = set()
        #: Pod names whose eviction a PodDisruptionBudget refuses (429).
        self.pdb_blocked: set[str] = set()
        #: Groups whose CRDs are installed; a removed group answers 404 like a missing CRD.
        self.crd_groups: set[str] = {"jobset.x-k8s.io", "kubeflow.org"}
        #: Whether suspending a workload removes its pods at once (False: the pods stay,
        #: as while a real controller has not caught up yet).
        self.instant_controller = True
        #: Service-account tokens the fake API server knows, for ``TokenReview``: token ->
        #: (username, audiences, node the token is bound to or None).
        self.sa_tokens: dict[str, tuple[str, list[str], str | None]] = {}
        self.lock = threading.RLock()
        self._rv = 0
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[FakeKube]:
        kube = cls()
        handler = type("Handler", (_Handler,), {"kube": kube})
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

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- store -------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def put(self, group: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (filling apiVersion, kind, uid, resourceVersion) and return it."""
        with self.lock:
            api_version, kind = KINDS[(group, plural)]
            obj = copy.deepcopy(obj)
            obj.setdefault("apiVersion", api_version)
            obj.setdefault("kind", kind)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
            meta["resourceVersion"] = self._next_rv()
            ns = meta.get("namespace", "") if plural != "nodes" else ""
            self.objects[(group, plural, ns, meta["name"])] = obj
            return obj

    def get(self, group: str, plural: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(self.objects.get((group, plural, ns, name)))

    def items(self, group: str, plural: str, ns: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [
                copy.deepcopy(o)
                for (g, p, n, _), o in sorted(self.objects.items())
                if g == group and p == plural and (ns is None or n == ns)
            ]

    def _owned_pods(self, group: str, plural: str, ns: str, name: str) -> list[Key]:
        """Pods whose controller chain (pod -> Job -> JobSet -> TrainJob) reaches the given
        workload."""
        kind = KINDS[(group, plural)][1]
        out = []
        for key, pod in self.objects.items():
            if key[1] != "pods" or key[2] != ns:
                continue
            chain = [(r["kind"], r["name"]) for r in pod["metadata"].get("ownerReferences", [])]
            for ref_kind, ref_name in chain:  # grows while walked: each owner's owners
                parent = {"Job": ("batch", "jobs"), "JobSet": ("jobset.x-k8s.io", "jobsets")}
                if ref_kind in parent:
                    obj = self.objects.get((*parent[ref_kind], ns, ref_name), {})
                    refs = obj.get("metadata", {}).get("ownerReferences", [])
                    chain += [(r["kind"], r["name"]) for r in refs]
            if (kind, name) in chain:
                out.append(key)
        return out

    # -- request handling --------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], body: Any, ctype: str) -> Any:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif parts and parts[0] == "apis" and len(parts) >= 3:
            group, rest = parts[1], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find {path}")
        ns = ""
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            ns, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1:2] or [""])[0], (rest[2:3] or [""])[0]
        if (group, plural) == ("authentication.k8s.io", "tokenreviews") and method == "POST":
            with self.lock:
                self.served.append((group, plural, "create"))
            return self._review(body)
        resource = f"{plural}/{sub}" if sub else plural
        verb = {"GET": "get" if name else "list", "POST": "create", "PATCH": "patch"}.get(
            method, method.lower()
        )
        with self.lock:
            self.served.append((group, resource, verb))
            if (group, resource, verb) in self.forbidden:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{resource} "{name}" is forbidden: User "system:serviceaccount:tg:trainguard"'
                    f' cannot {verb} resource "{resource}" in API group "{group}"',
                )
            if (group, plural) not in KINDS or (group and group not in self.crd_groups | {"batch"}):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if sub == "eviction" and verb == "create":
                return self._evict(ns, name)
            if verb == "list":
                return self._list(group, plural, ns, query)
            if verb == "create":
                return self._create(group, plural, ns, body)
            key = (group, plural, ns, name)
            if key not in self.objects:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            if verb == "get":
                return copy.deepcopy(self.objects[key])
            if verb == "delete":
                return self.objects.pop(key)
            if verb == "patch":
                return self._patch(key, body, ctype)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported by the fake")

    def _review(self, body: dict[str, Any]) -> dict[str, Any]:
        """Like the API server: authenticated only for a known token whose audiences meet the
        requested ones; a bound pod's node is in ``user.extra``."""
        spec = body.get("spec") or {}
        known = self.sa_tokens.get(spec.get("token", ""))
        wanted = spec.get("audiences") or []
        status: dict[str, Any] = {"authenticated": False, "error": "invalid bearer token"}
        if known is not None and (not wanted or set(wanted) & set(known[1])):
            username, audiences, node = known
            extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
            status = {
                "authenticated": True,
                "user": {
                    "username": username,
                    "groups": ["system:serviceaccounts"],
                    "extra": extra,
                },
                "audiences": [a for a in audiences if not wanted or a in wanted],
            }
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": spec,
            "status": status,
        }

    def _list(self, group: str, plural: str, ns: str, query: dict[str, str]) -> Any:
        items = [
            o
            for o in self.items(group, plural, ns if plural != "nodes" else None)
            if _selector_matches(query.get("labelSelector", ""), o["metadata"].get("labels", {}))
        ]
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            path, value = term.split("=", 1)
            items = [o for o in items if str(_field_value(o, path)) == value]
        api_version, kind = KINDS[(group, plural)]
        return {
            "apiVersion": api_version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _create(self, group: str, plural: str, ns: str, body: dict[str, Any]) -> Any:
        if plural == "events":
            involved = body.get("involvedObject", {})
            if involved.get("namespace", "") not in ("", ns) or (
                not involved.get("namespace") and ns != "default"
            ):
                raise ApiError(
                    422,
                    "Invalid",
                    "Event is invalid: involvedObject.namespace: does not match event.namespace",
                )
            if not body.get("metadata", {}).get("name"):
                raise ApiError(422, "Invalid", "Event is invalid: metadata.name: Required value")
        body.setdefault("metadata", {})["namespace"] = ns
        if (group, plural, ns, body["metadata"]["name"]) in self.objects:
            raise ApiError(
                409, "AlreadyExists", f'{plural} "{body["metadata"]["name"]}" already exists'
            )
        return self.put(group, plural, body)

    def _evict(self, ns: str, name: str) -> Any:
        key = ("", "pods", ns, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        if name in self.pdb_blocked:
            raise ApiError(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": "The disruption budget trainer needs 4 healthy pods and has 4",
                    }
                ],
            )
        del self.objects[key]
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }

    def _patch(self, key: Key, body: Any, ctype: str) -> Any:
        if ctype != "application/merge-patch+json":
            raise ApiError(
                415, "UnsupportedMediaType", f"the fake serves merge patches, not {ctype}"
            )
        old = self.objects[key]
        want_rv = _dig(body, ("metadata", "resourceVersion"))
        if want_rv is not None and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        new = merge_patch(old, body)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if key[1] == "jobs":
            self._validate_job_update(old, new)
        group, plural, ns, name = key
        self.objects[key] = new
        new["metadata"]["resourceVersion"] = self._next_rv()
        path = SUSPEND_PATH.get(plural)
        if path and self.instant_controller and _dig(new, path) and not _dig(old, path):
            # The workload's controller reacts to suspension: its pods go away.
            for pod in self._owned_pods(group, plural, ns, name):
                del self.objects[pod]
            if plural == "jobs":
                status = new.setdefault("status", {})
                status.pop("startTime", None)
                status["active"] = 0
        return copy.deepcopy(new)

    @staticmethod
    def _validate_job_update(old: dict[str, Any], new: dict[str, Any]) -> None:
        os_, ns_ = old["spec"], new["spec"]
        mutable_template = os_.get("suspend") and not old.get("status", {}).get("startTime")
        if os_["template"] != ns_["template"] and not mutable_template:
            raise ApiError(
                422,
                "Invalid",
                "Job.batch is invalid: spec.template: Invalid value: field is immutable",
            )
        if os_.get("completions") != ns_.get("completions") and (
            ns_.get("completionMode") != "Indexed"
            or ns_.get("completions") != ns_.get("parallelism")
        ):
            raise ApiError(
                422,
                "Invalid",
                "Job.batch is invalid: spec.completions: Invalid value: field is immutable",
            )


class _Handler(BaseHTTPRequestHandler):
    kube: FakeKube
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: the body is written after the headers; with Nagle on it waited for the
    # client's delayed ACK (~40 ms a request on a kept-alive connection).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            body = json.loads(raw) if raw else None
            result = self.kube.handle(self.command, url.path, query, body, ctype)
            code = 201 if self.command == "POST" else 200
        except ApiError as exc:
            result, code = exc.status(), exc.code
        payload = json.dumps(result).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve
