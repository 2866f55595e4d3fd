"""What the kubernetes client *logs* instead of raising while it loads a kubeconfig.

An exec credential plugin that is missing or fails is reported by ``logging.error`` on the
root logger (which, with no handler there, also installs one printing ``ERROR:root:...``)
and the client goes on without credentials: the next request then fails as "connection
refused" or 401, far from the cause. The controller's actuator and the kubectl plugin
both load kubeconfigs and refuse such a file in one line, so they collect those records
here, off the log. Both also check first, with :func:`unusable_kubeconfig`, the files the
client will open: its ``open()`` waits on a FIFO for ever and it parses a file of any size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from trainguard.textfile import Unreadable, check_file


def unusable_kubeconfig(given: str | None = None) -> tuple[str, str] | None:
    """The first kubeconfig file the client would open that is not a regular file of sane
    size (a FIFO, a device, a directory, a huge file), with why; None when there is none.

    ``given`` (``--kubeconfig``) must exist; a ``$KUBECONFIG`` entry that does not is
    skipped, as the client and kubectl skip it (the default ``~/.kube/config`` too)."""
    listed = os.environ.get("KUBECONFIG") or os.path.join("~", ".kube", "config")
    for path in filter(None, [given] if given else listed.split(os.pathsep)):
        try:
            check_file(os.path.expanduser(path))
        except Unreadable as exc:
            if not exc.missing or given:
                return path, exc.reason
    return None


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
