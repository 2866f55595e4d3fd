"""Reach the controller the way kubectl reaches a Service: through the API server's proxy.

``kubectl trainguard nodes --context prod -n trainguard`` needs no port-forward and no
controller URL: the plugin reads the user's kubeconfig with the official ``kubernetes``
client (so every kubeconfig form works: certificate and key files or data, tokens, exec
credential plugins, ``insecure-skip-tls-verify``), and sends the API
calls to::

    https://<api-server>/api/v1/namespaces/<namespace>/services/<service>:http/proxy/api/v1/...

The API server authenticates the user (their kubeconfig credentials) and authorizes
``get``/``create`` on ``services/proxy`` in that namespace, then forwards the request to the
controller Service. It strips the ``Authorization`` header it authenticated, so the
controller's own token travels in ``X-Trainguard-Token`` (:data:`TOKEN_HEADER`) instead.

kubectl's own global flags may stand anywhere on the command line (``kubectl get pods -n
x``), so :func:`hoist_kube_flags` moves ``--kubeconfig``, ``--context``, ``-n/--namespace``
and ``--service`` in front of the command word, where the root command declares them.

The ``kubernetes`` package is imported only here, only when a command goes through the API
server, so ``trainguard nodes --server URL`` stays fast.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import yaml

from trainguard.cli.errors import BadInput
from trainguard.kube_client_logs import client_logged_errors, unusable_kubeconfig

NAMESPACE_ENV = "TRAINGUARD_NAMESPACE"
SERVICE_ENV = "TRAINGUARD_SERVICE"
#: The namespace docs/kubernetes.md installs the release into.
DEFAULT_NAMESPACE = "trainguard"
#: The controller Service of a release named ``trainguard`` (the chart's full name).
DEFAULT_SERVICE = "trainguard"
#: The Service port name the chart gives the controller API.
SERVICE_PORT_NAME = "http"
#: The API server removes ``Authorization`` before proxying; the controller reads this one.
TOKEN_HEADER = "X-Trainguard-Token"

#: Flags kubectl users type anywhere on the line, with their value.
KUBE_VALUE_FLAGS = frozenset({"--kubeconfig", "--context", "-n", "--namespace", "--service"})
#: kubectl's ``-s/--server`` names the API server; ours names the controller. ``-s`` is
#: refused with a hint rather than silently sending the API server's URL our requests.
KUBECTL_SERVER_SHORT = "-s"


@dataclass(frozen=True, slots=True)
class KubeFlags:
    """What the user gave of ``--kubeconfig``, ``--context``, ``-n``, ``--service``."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None
    service: str | None = None

    @property
    def given(self) -> bool:
        return any((self.kubeconfig, self.context, self.namespace, self.service))


@dataclass(frozen=True, slots=True)
class ProxyEndpoint:
    """Everything an HTTP client needs to call the controller through the API server."""

    base_url: str
    verify: ssl.SSLContext | bool
    headers: dict[str, str] = field(default_factory=dict)
    #: For messages: ``service trainguard/trainguard via https://api:6443 (context prod)``.
    description: str = ""


def hoist_kube_flags(argv: Sequence[str]) -> list[str]:
    """Move kubectl-style global flags (and their values) in front of the command word.

    ``nodes -n tg -o json`` becomes ``-n tg nodes -o json``. Arguments after ``--`` are
    left alone. ``-s`` is refused (exit 2): in kubectl it is the API server's address.
    """
    hoisted: list[str] = []
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if arg.startswith(KUBECTL_SERVER_SHORT) and not arg.startswith("--"):
            raise BadInput(
                "-s is kubectl's API-server flag; trainguard reaches the API server through "
                "your kubeconfig (--kubeconfig, --context, -n), or a controller directly "
                "with --server URL"
            )
        name = arg.split("=", 1)[0]
        if name in KUBE_VALUE_FLAGS and name != arg:  # --context=prod
            # kubectl (pflag) reads -n=prod as "prod"; click would take "=prod": say -nprod.
            short = not name.startswith("--") and len(arg) > len(name) + 1
            hoisted.append(name + arg[len(name) + 1 :] if short else arg)
        elif name in KUBE_VALUE_FLAGS:  # --context prod
            if i + 1 >= len(args):
                raise BadInput(f"{arg} needs a value")
            hoisted.extend(args[i : i + 2])
            i += 1
        elif arg.startswith("-n") and not arg.startswith("--"):  # -ntrainguard, like kubectl
            hoisted.append(arg)
        else:
            rest.append(arg)
        i += 1
    return hoisted + rest


def _check_name(kind: str, value: str) -> str:
    """A DNS-1123 label, as namespaces and Service names are; refused before any request."""
    ok = 0 < len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()
    ok = ok and all(c.islower() or c.isdigit() or c == "-" for c in value)
    if not ok:
        raise BadInput(f'invalid {kind} "{value}": expected a lowercase DNS label')
    return value


def resolve(flags: KubeFlags) -> ProxyEndpoint:
    """Load the kubeconfig as kubectl would and build the service-proxy endpoint."""
    try:
        from kubernetes.client import Configuration
        from kubernetes.config import ConfigException, list_kube_config_contexts, load_kube_config
    except ImportError as exc:  # pragma: no cover - kubernetes is a core dependency
        raise BadInput(f"going through the API server needs `kubernetes`: {exc}") from exc

    namespace = _check_name(
        "namespace", flags.namespace or os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE
    )
    service = _check_name(
        "service", flags.service or os.environ.get(SERVICE_ENV) or DEFAULT_SERVICE
    )
    cfg = Configuration()
    where = flags.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    if (unusable := unusable_kubeconfig(flags.kubeconfig)) is not None:
        path, why = unusable
        raise BadInput(
            f"cannot use kubeconfig {path}: {why} (set --kubeconfig/--context, "
            "or --server URL to reach a controller directly)"
        )
    try:
        with client_logged_errors() as logged:
            load_kube_config(  # type: ignore[no-untyped-call]
                config_file=flags.kubeconfig,
                context=flags.context,
                client_configuration=cfg,
                persist_config=False,
            )
        current = list_kube_config_contexts(flags.kubeconfig)[1]  # type: ignore[no-untyped-call]
        context = flags.context or str(current["name"])
    except (
        ConfigException,
        OSError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        yaml.YAMLError,
    ) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, KeyError | TypeError | AttributeError | yaml.YAMLError):
            # The kubernetes client indexes what the YAML gave it (a string, a list, a
            # mapping without "name"): its message is a Python internal, not about the file.
            raise BadInput(
                f"{where} is not a kubeconfig (expected YAML with clusters, contexts and "
                "users; set --kubeconfig, or --server URL to reach a controller directly)"
            ) from exc
        raise BadInput(
            f"cannot use kubeconfig {where}: {detail} (set --kubeconfig/--context, "
            "or --server URL to reach a controller directly)"
        ) from exc
    if logged:  # without credentials the request would fail as something else
        raise BadInput(f"kubeconfig {where}: its exec credential plugin failed: {logged[0]}")
    host = str(cfg.host).rstrip("/")
    parts = urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f'kubeconfig context "{context}" has no usable server URL: "{host}"')
    headers: dict[str, str] = {}
    # Token, exec-plugin and auth-provider credentials, refreshed by the client's own hook.
    settings: Any = cfg.auth_settings()  # a TypedDict of {type, in, key, value}
    for setting in settings.values():
        if setting.get("in") == "header" and setting.get("value"):
            headers[str(setting["key"]).title()] = str(setting["value"])
    if "Authorization" not in headers and (cfg.username or cfg.password):
        headers["Authorization"] = str(cfg.get_basic_auth_token())
    path = (
        f"/api/v1/namespaces/{quote(namespace)}/services/{quote(service)}:{SERVICE_PORT_NAME}/proxy"
    )
    return ProxyEndpoint(
        base_url=host + path,
        verify=_tls(cfg, where) if parts.scheme == "https" else False,
        headers=headers,
        description=f"service {namespace}/{service} via {host} (context {context})",
    )


def _tls(cfg: object, where: str) -> ssl.SSLContext | bool:
    """The TLS settings the kubeconfig asked for: CA, client certificate, skip-verify.

    A CA or client certificate that does not load is one line naming the kubeconfig (exit
    2), not Python's ``SSLError: [SSL] PEM lib``. ``tls-server-name`` is not honoured: the
    name checked is the server URL's host.
    """
    verify = bool(getattr(cfg, "verify_ssl", True))
    ca = getattr(cfg, "ssl_ca_cert", None)
    what = "certificate-authority"
    try:
        ctx = ssl.create_default_context(cafile=ca) if verify else ssl._create_unverified_context()
        cert, key = getattr(cfg, "cert_file", None), getattr(cfg, "key_file", None)
        if cert:
            what = "client certificate or key"
            ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise BadInput(
            f"kubeconfig {where}: its {what} cannot be loaded ({detail}): expected PEM data"
        ) from exc
    return ctx


def is_kubectl_plugin(prog: str | None) -> bool:
    """Run as ``kubectl trainguard``: the user expects kubectl's way of finding the cluster."""
    return bool(prog) and str(prog).startswith("kubectl ")


__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_SERVICE",
    "NAMESPACE_ENV",
    "SERVICE_ENV",
    "TOKEN_HEADER",
    "KubeFlags",
    "ProxyEndpoint",
    "hoist_kube_flags",
    "is_kubectl_plugin",
    "resolve",
]
