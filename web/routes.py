"""Serve the operator dashboard: three built files under ``/ui/``, and ``/`` sends there.

The page talks to the JSON API from the browser, so nothing here touches controller state:
mounting needs only the FastAPI app. The files are built from ``web/frontend`` (npm,
esbuild; ``make web-assets``) into ``web/static`` and packaged with the wheel. They are
read once when the app is built and served with fixed content types and a
Content-Security-Policy that allows nothing but this origin: no inline script, no CDN, no
frames. A source checkout that has not built them serves a one-line page saying so (503)
rather than refusing to start the controller.
"""

from __future__ import annotations

import logging
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


log = logging.getLogger(__name__)

#: What a checkout without built assets answers instead of the dashboard.
NOT_BUILT = b"dashboard assets are not built: run `make web-assets` (npm ci + esbuild)\n"


def _read_asset(filename: str) -> bytes | None:
    try:
        return resources.files("web").joinpath("static", filename).read_bytes()
    except FileNotFoundError:
        return None


def _asset_endpoint(body: bytes | None, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        if body is None:
            return Response(NOT_BUILT, 503, media_type="text/plain", headers=_HEADERS)
        return Response(content=body, media_type=media_type, headers=_HEADERS)

    return serve


async def _to_ui() -> RedirectResponse:
    return RedirectResponse(UI_PATH, status_code=307)


def mount_dashboard(app: FastAPI) -> None:
    """Add the dashboard's routes to ``app`` (kept out of the OpenAPI schema)."""
    missing = []
    for name, (filename, media_type) in _ASSETS.items():
        body = _read_asset(filename)
        if body is None:
            missing.append(filename)
        endpoint = _asset_endpoint(body, media_type)
        app.add_api_route(
            UI_PATH + name,
            endpoint,
            methods=["GET", "HEAD"],
            include_in_schema=False,
            name=f"dashboard:{filename}",
        )
    if missing:
        log.warning(
            "dashboard assets missing; /ui/ answers 503 until `make web-assets` builds them",
            extra={"fields": {"missing": missing}},
        )
    for path in ("/", UI_PATH.rstrip("/")):
        app.add_api_route(path, _to_ui, methods=["GET", "HEAD"], include_in_schema=False)


__all__ = ["CONTENT_SECURITY_POLICY", "UI_PATH", "mount_dashboard"]
