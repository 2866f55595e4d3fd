"""What the kubernetes client *logs* instead of raising while it loads a kubeconfig.

An exec credential plugin that is missing or fails is reported by ``logging.error`` on the
root logger (which, with no handler there, also installs one printing ``ERROR:root:...``)
and the client goes on without credentials: the next request then fails as "connection
refused" or 401, far from the cause. The controller's actuator and the kubectl plugin
both load kubeconfigs and refuse such a file in one line, so they collect those records
here, off the log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def client_logged_errors() -> Iterator[list[str]]:
    """The one-line messages the kubernetes client's config loader logged at ERROR or above
    inside the block (kept off the log), for the caller to raise."""
    import kubernetes.config

    package = os.path.dirname(kubernetes.config.__file__)
    messages: list[str] = []

    def swallow(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.pathname.startswith(package):
            messages.append(" ".join(record.getMessage().split()))
            return False
        return True

    root = logging.getLogger()
    quiet = logging.NullHandler()  # handlers present: logging.error() skips basicConfig()
    root.addHandler(quiet)
    root.addFilter(swallow)
    try:
        yield messages
    finally:
        root.removeFilter(swallow)
        root.removeHandler(quiet)
