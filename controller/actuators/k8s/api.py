"""One way to call the Kubernetes API: in a thread, errors as one line, writes fenced.

The official client is synchronous, so each call runs in :func:`asyncio.to_thread`.
Every failure becomes a :class:`KubernetesApiError` carrying the HTTP status, retryable for
409/429/5xx and an unreachable API server. Every *write* first asks the fence (the lease
elector's :meth:`~controller.actuators.k8s.lease.LeaseElector.check`): a replica that is no
longer sure it leads raises :class:`Fenced` instead of writing.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import urllib3
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.actuators.base import ActuatorError
from controller.actuators.kube_objects import KubernetesApiError, api_error
from controller.errors import BadConfig
from trainguard.kube_client_logs import client_logged_errors, unusable_kubeconfig

MERGE_PATCH: Final = "application/merge-patch+json"
STRATEGIC_PATCH: Final = "application/strategic-merge-patch+json"


class KubeconfigError(BadConfig):
    """The kubeconfig exists but cannot be used (not YAML, not a kubeconfig, bad base64 or
    certificates, a failing exec credential plugin): the operator's file, so the start is
    refused in one line naming it (exit 2). Not an :class:`ActuatorError`, which the
    wiring turns into a generic failure (exit 1)."""


def _check_tls_files(cfg: client.Configuration, where: str) -> None:
    """Load the CA and client certificate the kubeconfig gave, as every request would: a
    broken one fails here, in one line, not as an SSL error on each API call."""
    ca, cert, key = cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file
    what = "certificate-authority"
    try:
        if ca:
            ssl.create_default_context(cafile=ca)
        if cert:
            what = "client certificate or key"
            ssl.create_default_context().load_cert_chain(cert, key or None)
    except (ssl.SSLError, OSError) as exc:
        raise KubeconfigError(
            f"kubeconfig {where}: its {what} cannot be loaded ({_one_line(exc)}): expected PEM data"
        ) from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_api_client(api_url: str = "") -> client.ApiClient:
    """A client on ``api_url`` when given (tests: the fake API server), else in-cluster
    ServiceAccount credentials when running in a pod, else the kubeconfig ($KUBECONFIG read
    now: the client reads it once, at import).

    No kubeconfig at all: one-line :class:`ActuatorError`. A kubeconfig that cannot be
    used: one-line :class:`KubeconfigError` naming it and what is wrong; the client's own
    errors (a YAML ``ParserError``, ``TypeError: list indices...`` for a list at the top,
    an ``SSLError`` on the first call, a logged exec-plugin failure) say neither.
    """
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
        return client.ApiClient(cfg)
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return client.ApiClient(cfg)
    except ConfigException:
        pass
    path = os.environ.get("KUBECONFIG")
    where = path or "~/.kube/config"
    if not any(os.path.exists(os.path.expanduser(p)) for p in where.split(os.pathsep) if p):
        raise ActuatorError(
            f"no Kubernetes credentials: not in a pod and no kubeconfig ({where} does not "
            "exist); set KUBECONFIG or run the controller in the cluster"
        )
    if (unusable := unusable_kubeconfig()) is not None:  # a FIFO would hang the client
        path, why = unusable
        raise KubeconfigError(f"kubeconfig {path} cannot be used: {why}")
    try:
        with client_logged_errors() as logged:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path, client_configuration=cfg
            )
    except (TypeError, KeyError, AttributeError) as exc:
        # The client indexes whatever the YAML held: its message is a Python internal.
        raise KubeconfigError(
            f"kubeconfig {where} is not a kubeconfig (expected a YAML mapping with clusters, "
            "contexts and users)"
        ) from exc
    except (ConfigException, OSError, ValueError, yaml.YAMLError) as exc:
        raise KubeconfigError(f"kubeconfig {where} cannot be used: {_one_line(exc)}") from exc
    if logged:
        raise KubeconfigError(f"kubeconfig {where}: its exec credential plugin failed: {logged[0]}")
    _check_tls_files(cfg, where)
    return client.ApiClient(cfg)


class Fenced(ActuatorError):
    """This replica may no longer be the leader: it must not write."""


def plain(value: Any) -> Any:
    """A model's ``to_dict`` output without its unset (``None``) fields."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return value


class Kube:
    """The typed APIs over one ``ApiClient``, and :meth:`read` / :meth:`write`."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        #: Called before every write; raises :class:`Fenced` when this replica must not
        #: write (set by the lease elector in cluster mode; ``None``: always allowed).
        self.fence: Callable[[], None] | None = None
        #: Every write made, as ``what`` strings (tests and the dry-run report read it).
        self.writes: list[str] = []

    async def read(self, what: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        return await self._call(what, fn, *args, **kw)

    async def write(self, what: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        if self.fence is not None:
            self.fence()
        self.writes.append(what)
        return await self._call(what, fn, *args, **kw)

    async def _call(self, what: str, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Any:
        """Run one client call in a thread; answer plain camelCase dicts, as the API sent."""
        try:
            result = await asyncio.to_thread(fn, *args, **kw)
        except ApiException as exc:
            raise api_error(what, exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise KubernetesApiError(
                f"{what}: Kubernetes API unreachable ({exc}); retry", status=0, retryable=True
            ) from exc
        except ValueError as exc:  # the client could not parse the answer into its models
            raise KubernetesApiError(
                f"{what}: unexpected answer from the Kubernetes API ({exc})",
                status=0,
                retryable=False,
            ) from exc
        return plain(result.to_dict(serialize=True)) if hasattr(result, "to_dict") else result

    async def close(self) -> None:
        await asyncio.to_thread(self.api_client.close)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


__all__ = [
    "MERGE_PATCH",
    "STRATEGIC_PATCH",
    "Fenced",
    "Kube",
    "KubeconfigError",
    "KubernetesApiError",
    "api_error",
    "plain",
]
