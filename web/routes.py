"""Serve the operator dashboard: three static files under ``/ui/``, and ``/`` sends there.

The page is read-only and talks to the JSON API from the browser (``web/static/app.js``),
so nothing here touches controller state: mounting needs only the FastAPI app. The files
are read once when the app is built (a missing one fails start-up, not a request) and are
served with fixed content types and a Content-Security-Policy that allows nothing but this
origin: no inline script, no third-party code, no frames.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

#: Where the dashboard lives; ``/`` and ``/ui`` redirect to it.
UI_PATH = "/ui/"

#: URL under ``/ui/`` -> (packaged file under ``web/static``, content type).
_ASSETS: dict[str, tuple[str, str]] = {
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "app.css": ("app.css", "text/css; charset=utf-8"),
}

#: Only this origin, for everything: the page, its script and style, and its API calls.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate every load, so a controller upgrade never runs with a stale script.
    "Cache-Control": "no-cache",
}


def _read_asset(filename: str) -> bytes:
    return resources.files("web").joinpath("static", filename).read_bytes()


def _asset_endpoint(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return Response(content=body, media_type=media_type, headers=_HEADERS)

    return serve


async def _to_ui() -> RedirectResponse:
    return RedirectResponse(UI_PATH, status_code=307)


def mount_dashboard(app: FastAPI) -> None:
    """Add the dashboard's routes to ``app`` (kept out of the OpenAPI schema)."""
    for name, (filename, media_type) in _ASSETS.items():
        endpoint = _asset_endpoint(_read_asset(filename), media_type)
        app.add_api_route(
            UI_PATH + name,
            endpoint,
            methods=["GET", "HEAD"],
            include_in_schema=False,
            name=f"dashboard:{filename}",
        )
    for path in ("/", UI_PATH.rstrip("/")):
        app.add_api_route(path, _to_ui, methods=["GET", "HEAD"], include_in_schema=False)


__all__ = ["CONTENT_SECURITY_POLICY", "UI_PATH", "mount_dashboard"]
