"""The tests' own HTTP calls, sharing one TLS context per test process.

``httpx.get()`` and ``httpx.Client()`` each build an SSL context and load the CA bundle into
it (~25 ms of CPU). The suite's polling loops made thousands of them: a py-spy profile of
the controller, remediation and CLI tests found a fifth of their CPU there. Each call here
still gets a client of its own (no connection kept between calls or shared between threads,
as with ``httpx.get``); only the context is shared (:mod:`trainguard.tls`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from trainguard.tls import default_context


def client(**kwargs: Any) -> httpx.Client:
    """``httpx.Client(**kwargs)`` with the shared context (unless ``verify`` is given)."""
    kwargs.setdefault("verify", default_context())
    return httpx.Client(**kwargs)


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.request``: a one-call client (httpx's 5 s timeout unless ``timeout`` is given)."""
    with client() as http:
        return http.request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return request("PUT", url, **kwargs)


@contextlib.contextmanager
def stream(method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
    """``httpx.stream``: the response is open inside the ``with`` block."""
    with client() as http, http.stream(method, url, **kwargs) as response:
        yield response
