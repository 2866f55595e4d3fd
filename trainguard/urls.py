"""URLs as messages may show them: without the credentials a configured URL can carry.

A Prometheus or webhook URL (controller settings), a ``--server`` (the CLI) may hold a
password in its user info (``https://user:password@host``, sent as basic auth) or a token
in its query string. Logs, API answers, action rows and error lines name the URL through
:func:`shown_url`, so the reader sees where it points and nothing that opens it.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def shown_url(url: str) -> str:
    """``url`` without the secrets it may carry: the password of its user info and the
    values of its query string become ``***``; the rest stays as written (scheme, host,
    port, path), so the reader still sees where it points. A URL without either is returned
    unchanged. A secret in the path itself cannot be told apart and stays."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL that can be taken apart: shown only if it hides nothing
        return url if "@" not in url and "?" not in url else "<url>"
    if parts.password is None and not parts.query:
        return url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and parts.password is not None:
        hostport = f"{userinfo.partition(':')[0]}:***@{hostport}"
    elif at:
        hostport = f"{userinfo}@{hostport}"
    query = "&".join(
        f"{pair.partition('=')[0]}=***" if "=" in pair else "***"
        for pair in parts.query.split("&")
        if pair
    )
    return urlunsplit((parts.scheme, hostport, parts.path, query, parts.fragment))


__all__ = ["shown_url"]
