"""One TLS trust store per process for every HTTP client trainguard makes.

httpx builds a new SSL context for each client it makes and loads the whole CA bundle into
it: about 25 ms of CPU each time on the machines we measured (0.08 ms for a client given a
ready context). The webhook and the Prometheus history reader make a client per call, the CLI
one per command, and a process that polls the API through ``httpx.get`` pays it per request.
The context is built once, the way httpx would build it (``SSL_CERT_FILE``/``SSL_CERT_DIR``
when set, else certifi's bundle), and shared: a context is safe to share between clients and
threads once built. A change to those variables after the first client is made is not seen
until the process restarts.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def default_context() -> ssl.SSLContext:
    """The verifying client context httpx would build for ``verify=True``, built once."""
    return httpx.create_ssl_context()


__all__ = ["default_context"]
