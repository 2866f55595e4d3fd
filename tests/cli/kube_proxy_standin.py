"""A real HTTPS server standing in for the Kubernetes API server's service proxy.

It does what kube-apiserver does for ``/api/v1/namespaces/NS/services/NAME:PORT/proxy/...``
as far as a client can tell: TLS with its own CA, authentication by bearer token or client
certificate (401 ``Status`` otherwise), ``404`` ``Status`` for an unknown Service, ``503``
``Status`` when the Service has no ready endpoint, and forwarding to the backend with the
``Authorization`` header removed (the API server strips the credential it authenticated).
Certificates come from the ``openssl`` command, so no Python crypto package is needed.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
from base64 import b64encode
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests import http_calls

PREFIX = "/api/v1/namespaces/"


class OpensslMissing(Exception):
    pass


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(root: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (CN=alice)."""
    if shutil.which("openssl") is None:
        raise OpensslMissing("no openssl command")
    ca, ca_key = root / "ca.crt", root / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=standin-ca", "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    made = {}
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        key, csr, crt = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.crt"
        cn = "kube-apiserver" if name == "server" else "alice"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                 "-keyout", str(key), "-out", str(csr))  # fmt: skip
        extfile = root / f"{name}.ext"
        extfile.write_text(ext + "\n")
        signing = ["-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2"]
        _openssl("x509", "-req", "-in", str(csr), *signing, "-out", str(crt),
                 "-extfile", str(extfile))  # fmt: skip
        made[name] = (crt, key)
    return Pki(ca, *made["server"], *made["client"])


@dataclass
class ProxyStandin:
    """The server's knobs and what it saw; ``backend`` is where the Service's pods answer."""

    backend: str
    namespace: str
    service: str
    token: str
    port_name: str = "http"
    url: str = ""
    seen: list[dict[str, Any]] = field(default_factory=list)
    endpoints_ready: bool = True


def _status(code: int, reason: str, message: str, kind: str = "services") -> bytes:
    return json.dumps(
        {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
         "message": message, "reason": reason, "details": {"kind": kind}, "code": code}
    ).encode()  # fmt: skip


def _handler(state: ProxyStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authenticated(self) -> str | None:
            if self.headers.get("Authorization") == f"Bearer {state.token}":
                return "token-user"
            cert = self.connection.getpeercert()  # type: ignore[attr-defined]
            if cert:
                subject = dict(item[0] for item in cert["subject"])
                return str(subject.get("commonName"))
            return None

        def _handle(self) -> None:
            user = self._authenticated()
            if user is None:
                self._reply(401, _status(401, "Unauthorized", "Unauthorized"))
                return
            path, _, query = self.path.partition("?")
            parts = path.removeprefix(PREFIX).split("/", 4)
            if (
                not path.startswith(PREFIX)
                or len(parts) < 4
                or parts[1:4:2]
                != [
                    "services",
                    "proxy",
                ]
            ):
                self._reply(404, _status(404, "NotFound", "the server could not find it"))
                return
            namespace, target = parts[0], parts[2]
            name, _, port = target.partition(":")
            if (namespace, name) != (state.namespace, state.service) or port != state.port_name:
                msg = f'services "{name}" not found'
                self._reply(404, _status(404, "NotFound", msg))
                return
            if not state.endpoints_ready:
                msg = f'no endpoints available for service "{name}"'
                self._reply(503, _status(503, "ServiceUnavailable", msg))
                return
            rest = "/" + (parts[4] if len(parts) > 4 else "")
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            forwarded = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in ("authorization", "host", "content-length", "connection")
            }
            state.seen.append({"user": user, "method": self.command, "path": rest,
                               "headers": forwarded})  # fmt: skip
            url = state.backend + rest + (f"?{query}" if query else "")
            answer = http_calls.request(self.command, url, headers=forwarded, content=body)
            self._reply(
                answer.status_code,
                answer.content,
                answer.headers.get("content-type", "application/octet-stream"),
            )

        do_GET = _handle
        do_POST = _handle

    return Handler


class ProxyServer:
    """Runs :class:`ProxyStandin` over TLS on an ephemeral port in a thread."""

    def __init__(self, state: ProxyStandin, pki: Pki) -> None:
        self.state = state
        self.pki = pki
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki.server_cert, pki.server_key)
        ctx.load_verify_locations(pki.ca)
        ctx.verify_mode = ssl.CERT_OPTIONAL  # token users present no certificate
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        state.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    def __enter__(self) -> ProxyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _b64(path: Path) -> str:
    return b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server_url: str, pki: Pki, token: str) -> Path:
    """Contexts ``token`` (bearer token user), ``cert`` (client certificate user, current),
    and ``wrong-ca`` (a CA that did not sign the server: TLS must fail)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "standin",
                "cluster": {"server": server_url, "certificate-authority-data": _b64(pki.ca)},
            },
            {
                "name": "wrong-ca",
                "cluster": {
                    "server": server_url,
                    "certificate-authority-data": _b64(pki.client_cert),
                },
            },
        ],
        "users": [
            {"name": "token-user", "user": {"token": token}},
            {
                "name": "cert-user",
                "user": {
                    "client-certificate-data": _b64(pki.client_cert),
                    "client-key-data": _b64(pki.client_key),
                },
            },
        ],
        "contexts": [
            {"name": "token", "context": {"cluster": "standin", "user": "token-user"}},
            {"name": "cert", "context": {"cluster": "standin", "user": "cert-user"}},
            {"name": "wrong-ca", "context": {"cluster": "wrong-ca", "user": "token-user"}},
        ],
        "current-context": "cert",
    }
    path.write_text(yaml.safe_dump(config))
    return path
