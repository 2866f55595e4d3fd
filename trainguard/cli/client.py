"""A small synchronous client of the controller's ``/api/v1``, shared by the CLI and the demo.

It returns the API's JSON objects unchanged (``-o json`` prints exactly what the server
sent) and turns every transport or HTTP failure into a :mod:`trainguard.cli.errors`
exception whose message tells the user what to do next.

Two ways in: a controller URL (``--server``), or the Kubernetes API server's service proxy
(:mod:`trainguard.cli.kubeproxy`), where the API server's own refusals (a ``Status`` object:
unknown Service, no ready endpoint, credentials refused) are told apart from the
controller's answers.
"""

from __future__ import annotations

import re
import ssl
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import ValidationError

from trainguard.cli import replies
from trainguard.cli.errors import BadInput, NotFound, ServerError, Unauthorized, Unreachable
from trainguard.cli.kubeproxy import TOKEN_HEADER, ProxyEndpoint
from trainguard.tls import default_context
from trainguard.urls import shown_url
from trainguard.wire import API_PREFIX, NAME_PATTERN

DEFAULT_SERVER = "http://127.0.0.1:8470"
#: Page size when walking a list endpoint; the server's default and maximum page.
PAGE_SIZE = 500

JsonObject = dict[str, Any]

_TOKEN_SOURCE = "--token or TRAINGUARD_TOKEN"

_NODE_NAME = re.compile(NAME_PATTERN)

R = TypeVar("R", bound=replies.Reply)


def check_server_url(server: str) -> str:
    """Normalise ``--server``; a URL without scheme or host is a usage error, not an outage."""
    url = server.strip().rstrip("/")
    try:  # each step may refuse: "http://[::1" (split), "[zz]" (host), ":99999" (port)
        parts = urlsplit(url)
        hostname, _ = parts.hostname, parts.port
    except ValueError as exc:
        raise BadInput(f'invalid controller URL "{shown_url(server)}": {exc}') from exc
    if parts.scheme not in ("http", "https") or not hostname:
        raise BadInput(
            f'invalid controller URL "{shown_url(server)}" (--server or TRAINGUARD_SERVER): '
            "expected http(s)://HOST[:PORT]"
        )
    return url


def check_token(token: str | None) -> str | None:
    """The controller token as it will be sent, or ``None`` when none was given.

    Surrounding whitespace is dropped, as kubectl does for a token file: a token read from
    a Kubernetes Secret or a file usually ends in a newline. What is left must be visible
    ASCII, or it could not travel in an HTTP header (an inner line break would even add a
    header of its own). The message never repeats the token: it is a secret.
    """
    if not token:
        return None
    cleaned = token.strip()
    if not cleaned:
        raise BadInput(f"the token ({_TOKEN_SOURCE}) is blank")
    if not all("!" <= char <= "~" for char in cleaned):
        raise BadInput(
            f"invalid token ({_TOKEN_SOURCE}): it may hold only visible ASCII characters, "
            "no spaces or line breaks inside it"
        )
    return cleaned


def segment(value: str, what: str) -> str:
    """``value`` as one path segment of a request. An empty name is a usage error, not a
    request: ``/nodes/`` is another endpoint (the list, after a redirect) and ``/nodes/a/b``
    would be ``a``'s sub-resource, so names are checked and quoted before any request."""
    if not value.strip():
        raise BadInput(f"{what} must not be empty")
    if value in (".", ".."):  # a client would fold them into the path ("/nodes/.." = "/")
        return value.replace(".", "%2E")
    return quote(value, safe="")


def node_name(value: str) -> str:
    """A node name the controller can hold: the rule it checks agent credentials and reports
    against (``trainguard.wire.NAME_PATTERN``, a lowercase DNS subdomain of at most 253
    characters). Checked before a request so ``../x`` is a usage error, not "Not Found";
    every command that names a node asks it. What passes is one path segment as it is
    (letters, digits, '-' and '.' need no quoting, and '.' or '..' do not pass)."""
    segment(value, "node name")
    if len(value) > 253 or not _NODE_NAME.fullmatch(value):
        raise BadInput(
            f"invalid node name {replies.printable(repr(value), 80)}: expected a lowercase "
            "DNS name (a-z, 0-9, '-' and '.', starting and ending with a letter or digit, "
            "at most 253 characters)"
        )
    return value


def _reason(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    if "refused" in lowered:
        return "connection refused"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return "unknown host"
    return text.splitlines()[0]


def _said_why(reason: str) -> None:
    """An operator's action carries its reason (recorded and shown): a blank one is refused
    before any request."""
    if not reason.strip():
        raise BadInput("--reason must not be empty: say why (it is recorded and shown)")


class ApiClient:
    """Synchronous API client; use as a context manager so the connection pool is closed."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        proxy: ProxyEndpoint | None = None,
    ) -> None:
        self._token = check_token(token)
        self._proxy = proxy
        headers = {"Accept": "application/json"}
        verify: ssl.SSLContext | bool = default_context()
        if proxy is None:
            self.server = check_server_url(server)
            self.where = f"controller at {shown_url(self.server)}"  # no password in errors
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
        else:
            self.server = proxy.base_url
            self.where = f"controller ({proxy.description})"
            headers |= proxy.headers  # the API server's credentials
            if self._token:
                headers[TOKEN_HEADER] = self._token
            verify = proxy.verify
        self._http = httpx.Client(
            base_url=self.server, headers=headers, timeout=timeout_s, verify=verify
        )

    @classmethod
    def through(cls, proxy: ProxyEndpoint, token: str | None = None) -> ApiClient:
        """A client that reaches the controller through the API server's service proxy."""
        return cls(proxy.base_url, token, proxy=proxy)

    def _unreachable_hint(self) -> str:
        if self._proxy is not None:
            return "check --context and -n/--service, or reach it directly with --server URL"
        return (
            "is it running? In a cluster use your kubeconfig (--context, -n) "
            "or `kubectl port-forward`"
        )

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ transport

    def _get(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        *,
        expect: type[replies.Reply] = replies.AnyObject,
    ) -> Any:
        return self._request("GET", path, params=params, expect=expect)

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        expect: type[replies.Reply] = replies.AnyObject,
    ) -> Any:
        """The answer's JSON, unchanged, once it has the shape ``expect`` describes."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, params=clean, json=body)
        except httpx.TimeoutException as exc:
            raise Unreachable(
                f"{self.where} did not answer in time ({type(exc).__name__}); "
                f"{self._unreachable_hint()}"
            ) from exc
        except httpx.LocalProtocolError as exc:
            # The request could not be written, never an outage; httpx's message quotes
            # the offending header value, which may be a credential: it is not shown.
            raise BadInput(
                f"cannot send the request to {self.where}: a header is not valid HTTP "
                "(check the token and your kubeconfig's credentials)"
            ) from exc
        except httpx.TransportError as exc:
            raise Unreachable(
                f"cannot reach {self.where}: {_reason(exc)}; {self._unreachable_hint()}"
            ) from exc
        self._raise_for_status(response)
        try:
            answer = response.json()
        except ValueError as exc:
            raise ServerError(f"{self.where} sent a non-JSON answer to {method} {path}") from exc
        self._check(answer, expect, method, path)
        return answer

    def _check(self, answer: Any, expect: type[R], method: str, path: str) -> R:
        try:
            return expect.model_validate(answer)
        except ValidationError as exc:
            raise ServerError(
                f"{self.where} sent an unexpected answer to {method} {path}: {replies.problem(exc)}"
            ) from exc

    def _raise_for_status(self, response: httpx.Response) -> None:
        status = response.status_code
        if 300 <= status < 400:  # not followed: a redirect is never an answer of the API
            request = response.request
            raise ServerError(
                f"{self.where} redirected {request.method} {request.url.path} to "
                f"{response.headers.get('location', '?')} instead of answering; check --server"
            )
        if status < 400:
            return
        if self._proxy is not None:
            self._raise_for_api_server(response)
        detail = _detail(response)
        if status == 401:
            if self._token:
                raise Unauthorized(
                    "unauthorized: the controller rejected the token "
                    "(check --token or TRAINGUARD_TOKEN)"
                )
            raise Unauthorized("unauthorized: set --token or TRAINGUARD_TOKEN")
        if status == 403:
            raise Unauthorized(f"forbidden: the token's role may not do this ({detail})")
        if status == 404:
            raise NotFound(detail)
        if 400 <= status < 500:
            raise BadInput(f"controller rejected the request: {detail}")
        raise ServerError(f"{self.where} answered {status}: {detail}")

    def _raise_for_api_server(self, response: httpx.Response) -> None:
        """The API server's own refusals come as a ``Status`` object, never as ``detail``."""
        body = _json(response)
        if not isinstance(body, dict) or body.get("kind") != "Status":
            return
        assert self._proxy is not None
        message = replies.printable(str(body.get("message") or response.reason_phrase))
        where = self._proxy.description
        status = response.status_code
        if status == 401:
            raise Unauthorized(
                f"the API server rejected your kubeconfig credentials ({where}): {message}"
            )
        if status == 403:
            raise Unauthorized(
                f"the API server forbids the service proxy ({where}): {message}; "
                "you need get and create on services/proxy in that namespace"
            )
        if status == 404:
            raise Unreachable(
                f"no controller Service: {message} ({where}); "
                "set -n/--namespace and --service to where the chart is installed"
            )
        if status in (502, 503):
            raise Unreachable(
                f"no ready controller behind {where}: {message}; "
                "see `kubectl get pods` in that namespace"
            )
        raise ServerError(f"the API server answered {status} ({where}): {message}")

    def _list(self, path: str, params: dict[str, Any] | None = None) -> list[JsonObject]:
        """Walk every page of a ``{"data", "count"}`` list endpoint."""
        items: list[JsonObject] = []
        offset = 0
        while True:
            answer = self._get(
                path, {**(params or {}), "limit": PAGE_SIZE, "offset": offset}, expect=replies.Page
            )
            data: list[JsonObject] = answer["data"]
            items.extend(data)
            if not data or len(items) >= answer["count"]:
                return items
            offset += len(data)

    # ------------------------------------------------------------------ endpoints

    def ready(self) -> bool:
        """``/readyz`` answered 200; transport errors mean "not yet", not a failure."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def status(self) -> JsonObject:
        result: JsonObject = self._get(f"{API_PREFIX}/status", expect=replies.Status)
        return result

    def nodes(self, health: str | None = None) -> list[JsonObject]:
        return self._list(f"{API_PREFIX}/nodes", {"health": health})

    def node(self, name: str, history_s: float | None = None) -> JsonObject:
        try:
            result: JsonObject = self._get(
                f"{API_PREFIX}/nodes/{node_name(name)}",
                {"history_s": history_s},
                expect=replies.Node,
            )
        except NotFound as exc:
            raise NotFound(f'node "{name}" not found') from exc
        return result

    def jobs(self, *, history: bool = False) -> list[JsonObject]:
        """The jobs in the controller's memory; with ``history``, every job its database
        holds (those that left memory after ``job_retention_s`` with source ``history``)."""
        return self._list(f"{API_PREFIX}/jobs", {"history": "true" if history else None})

    def job(self, name: str) -> JsonObject:
        """One job with its ranks: live, or as stored once it left memory (``ended``)."""
        try:
            result: JsonObject = self._get(
                f"{API_PREFIX}/jobs/{segment(name, 'job name')}", expect=replies.Job
            )
        except NotFound as exc:
            raise NotFound(f'job "{replies.printable(name, 80)}" not found') from exc
        return result

    def incidents(
        self,
        *,
        state: str | None = None,
        kind: str | None = None,
        node: str | None = None,
        job: str | None = None,
    ) -> list[JsonObject]:
        if node is not None:  # a name no node can have would match nothing, silently
            node_name(node)
        if job is not None and not job.strip():
            raise BadInput("job name must not be empty")
        params = {"state": state, "kind": kind, "node": node, "job": job}
        return self._list(f"{API_PREFIX}/incidents", params)

    def actions(self) -> list[JsonObject]:
        return self._list(f"{API_PREFIX}/actions")

    def remediation(self) -> JsonObject:
        result: JsonObject = self._get(f"{API_PREFIX}/remediation")
        return result

    def goodput(self, job: str) -> JsonObject:
        result: JsonObject = self._get(f"{API_PREFIX}/jobs/{segment(job, 'job name')}/goodput")
        return result

    def start_preflight(self, node: str, expected_nic_rate_gbps: float | None) -> JsonObject:
        """``POST /nodes/{node}/preflight``: the agent runs its checks; returns the command."""
        body = (
            {"expected_nic_rate_gbps": expected_nic_rate_gbps} if expected_nic_rate_gbps else None
        )
        result: JsonObject = self._request(
            "POST",
            f"{API_PREFIX}/nodes/{node_name(node)}/preflight",
            body=body,
            expect=replies.Command,
        )
        return result

    def preflight(self, node: str, command_id: str) -> JsonObject:
        """``GET /nodes/{node}/preflight/{id}``: that preflight's command, status and verdict."""
        node_path = f"{API_PREFIX}/nodes/{node_name(node)}"
        path = f"{node_path}/preflight/{segment(command_id, 'command id')}"
        result: JsonObject = self._get(path, expect=replies.Command)
        return result

    def agent_credentials(self, node: str, *, revoke: bool = False) -> JsonObject:
        """``POST /agent-credentials/{node}`` issues (or rotates) the node's agent token and
        returns it once; ``DELETE`` (``revoke``) ends every token of the node now."""
        path = f"{API_PREFIX}/agent-credentials/{node_name(node)}"
        method = "DELETE" if revoke else "POST"
        expect = replies.AgentTokensRevoked if revoke else replies.AgentTokenIssued
        result: JsonObject = self._request(method, path, expect=expect)
        return result

    def set_isolation(self, node: str, *, isolate: bool, reason: str | None) -> JsonObject:
        """Isolate or release ``node``; the answer must confirm the node's new state."""
        verb = "isolate" if isolate else "release"
        if isolate or reason is not None:
            _said_why(reason or "")
        body = {"reason": reason} if reason else None
        path = f"{API_PREFIX}/nodes/{node_name(node)}/{verb}"
        result: JsonObject = self._request("POST", path, body=body, expect=replies.Isolation)
        if result["isolated"] is not isolate or result["node"] != node:
            raise ServerError(
                f"{self.where} sent an unexpected answer to POST {path}: it does not confirm "
                f"the {verb} (node {replies.printable(repr(result['node']), 80)}, "
                f"isolated {str(result['isolated']).lower()})"
            )
        return result

    def restart_job(self, job: str, *, reason: str) -> JsonObject:
        """``POST /jobs/{job}/restart``: synchronous, the answer says what the restart did."""
        _said_why(reason)
        path = f"{API_PREFIX}/jobs/{segment(job, 'job name')}/restart"
        result: JsonObject = self._request(
            "POST", path, body={"reason": reason}, expect=replies.Restart
        )
        if result["job"] != job:
            raise ServerError(
                f"{self.where} sent an unexpected answer to POST {path}: it restarted "
                f"{replies.printable(repr(result['job']), 80)}"
            )
        return result

    def approve(self, action_id: int) -> JsonObject:
        """``POST /actions/{id}/approve``: carry out a dry run the policy only recorded."""
        if not 1 <= action_id <= 2**62:
            raise BadInput(f"action id must be a positive integer, got {action_id}")
        path = f"{API_PREFIX}/actions/{action_id}/approve"
        result: JsonObject = self._request("POST", path, expect=replies.Approval)
        return result

    def inject_faults(self, job: str, faults: list[JsonObject], reason: str = "") -> JsonObject:
        """A chaos drill: ``POST /jobs/{job}/faults`` (409 until every rank has reported)."""
        result: JsonObject = self._request(
            "POST",
            f"{API_PREFIX}/jobs/{segment(job, 'job name')}/faults",
            body={"faults": faults, "reason": reason},
        )
        return result

    def power_domains(self) -> JsonObject:
        """``GET /power/domains``: the tree with power, level and capped GPUs per domain."""
        result: JsonObject = self._get(f"{API_PREFIX}/power/domains")
        return result

    def plans(self) -> list[JsonObject]:
        return self._list(f"{API_PREFIX}/plans")

    def plan(self, plan_id: str) -> JsonObject:
        try:
            result: JsonObject = self._get(f"{API_PREFIX}/plans/{segment(plan_id, 'plan id')}")
        except NotFound as exc:
            raise NotFound(f'plan "{plan_id}" not found') from exc
        return result


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _detail(response: httpx.Response) -> str:
    """The answer's ``detail`` (or first line of text). Without one the status and who
    answered are all there is to go on: an empty error is most often from something in
    front of the controller (an ingress, a load balancer, another service on the port)."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return replies.printable(text.splitlines()[0]) if text else _no_detail(response)
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str) and detail.strip():
        return replies.printable(detail)
    if detail is not None and not isinstance(detail, str):
        return replies.printable(str(detail))
    return _no_detail(response)


def _no_detail(response: httpx.Response) -> str:
    status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
    url = response.request.url
    text = f"{status} with no detail, from {url.scheme}://{url.netloc.decode('ascii')}"
    server = response.headers.get("server", "").strip()
    return f"{text} (Server: {replies.printable(server, 80)})" if server else text


__all__ = [
    "DEFAULT_SERVER",
    "ApiClient",
    "JsonObject",
    "check_server_url",
    "check_token",
    "node_name",
]
