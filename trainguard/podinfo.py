"""Which Kubernetes pod a rank runs in, from the downward API (torch-free, job side).

A rank reports its pod and namespace in its hello and in its rank events, so the
controller learns a job's placement (rank -> pod -> node) from the job itself instead of
from labels nobody can put on a template shared by all workers. The pod template maps
them with the downward API (docs/kubernetes.md)::

    env:
      - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
      - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}

``TRAINGUARD_POD_NAME`` / ``TRAINGUARD_POD_NAMESPACE`` win when set (for templates that
already use ``POD_NAME`` for something else); the namespace falls back to the service
account's namespace file that every pod has mounted by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def pod_identity(
    environ: Mapping[str, str], namespace_file: Path = SA_NAMESPACE_FILE
) -> tuple[str, str]:
    """``(pod, namespace)``; empty strings outside Kubernetes."""
    pod = environ.get("TRAINGUARD_POD_NAME") or environ.get("POD_NAME") or ""
    ns = environ.get("TRAINGUARD_POD_NAMESPACE") or environ.get("POD_NAMESPACE") or ""
    if pod and not ns:
        try:
            ns = namespace_file.read_text().strip()
        except OSError:
            ns = ""
    return pod[:253], ns[:63]


__all__ = ["pod_identity"]
