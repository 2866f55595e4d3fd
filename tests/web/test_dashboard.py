"""The operator dashboard: served by a live controller, read by a real headless Chromium.

The HTTP tests check what the controller serves (routes, content types, headers, no
third-party URLs). The browser tests post agent reports, open the page, sign in with a
viewer token and read the tables as an operator would; API strings must render as text.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import httpx
import pytest

STATIC = resources.files("web").joinpath("static")
ASSETS = {"": "text/html", "app.js": "text/javascript", "app.css": "text/css"}
SCREENSHOT = "/tmp/dashboard.png"
#: Text a hostile client could put in a free-text field; it must show up verbatim.
HOSTILE = '<img src=x onerror="window.__pwned=1"><b>bold</b>'


# ----------------------------------------------------------------------------- HTTP


def test_root_and_bare_ui_redirect_to_the_dashboard(live_controller) -> None:
    for path in ("/", "/ui"):
        r = httpx.get(live_controller.url + path, follow_redirects=False, timeout=10)
        assert r.status_code == 307, path
        assert r.headers["location"] == "/ui/"
    r = httpx.get(live_controller.url + "/", follow_redirects=True, timeout=10)
    assert r.status_code == 200 and str(r.url).endswith("/ui/")


def test_assets_have_their_content_types_and_safe_headers(live_controller) -> None:
    for name, media_type in ASSETS.items():
        r = httpx.get(f"{live_controller.url}/ui/{name}", timeout=10)
        assert r.status_code == 200, name
        assert r.headers["content-type"].split(";")[0] == media_type, name
        assert r.headers["x-content-type-options"] == "nosniff"
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "connect-src 'self'" in csp
        head = httpx.head(f"{live_controller.url}/ui/{name}", timeout=10)
        assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{live_controller.url}/ui/nope.js", timeout=10).status_code == 404


def test_page_needs_no_token_but_the_api_does(live_controller) -> None:
    assert httpx.get(f"{live_controller.url}/ui/", timeout=10).status_code == 200
    assert httpx.get(f"{live_controller.url}/api/v1/nodes", timeout=10).status_code == 401


def test_page_loads_only_its_own_files(live_controller) -> None:
    html = httpx.get(f"{live_controller.url}/ui/", timeout=10).text
    assert html.lstrip().lower().startswith("<!doctype html>")
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert sorted(refs) == ["app.css", "app.js"]
    for name in ("index.html", "app.js", "app.css"):
        text = STATIC.joinpath(name).read_text()
        assert not re.search(r"https?://|\bwss?://|@import|url\(", text), name
    # The served page is the packaged one.
    assert html == STATIC.joinpath("index.html").read_text()


def test_script_never_parses_api_text_as_html() -> None:
    script = STATIC.joinpath("app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    assert "localStorage" not in script  # the token stays in sessionStorage


def test_dashboard_stays_out_of_the_api_schema(live_controller) -> None:
    paths = httpx.get(f"{live_controller.url}/openapi.json", timeout=10).json()["paths"]
    assert not [p for p in paths if p == "/" or p.startswith("/ui")]


# ----------------------------------------------------------------------------- browser


def _seed(live: Any, web_report: Callable[..., Any], web_post: Callable[..., None]) -> None:
    """One node with a fatal XID on GPU 3, one healthy node running a job's two ranks, and
    that node isolated by an operator with a hostile reason."""
    now = time.time()
    xid = {3: {"xid_events": [{"code": 79, "time_unix_s": now}]}}
    web_post(live, web_report("gpu-node-a", 0, gpu_overrides=xid))
    steps = [
        {
            "job": "llm-pretrain",
            "rank": rank,
            "world_size": 2,
            "step": step,
            "step_time_s": 0.5,
            "compute_time_s": 0.4,
            "collective_wait_s": 0.1,
            "gpu_index": rank,
            "end_unix_s": now - 3 + step * 0.5,
        }
        for step in range(1, 5)
        for rank in (0, 1)
    ]
    web_post(live, web_report("gpu-node-b", 0, steps=steps))
    r = httpx.post(
        f"{live.url}/api/v1/nodes/gpu-node-b/isolate",
        json={"reason": HOSTILE},
        headers=live.headers("operator"),
        timeout=10,
    )
    assert r.status_code == 200, r.text


def _sign_in(page: Any, token: str) -> None:
    page.fill("#token", token)
    page.click("#login button[type=submit]")


def test_operator_sees_the_faulty_node_and_its_incident(
    live_controller, web_report, web_post, browser_page
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    live = live_controller
    _seed(live, web_report, web_post)
    errors: list[str] = []
    console: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: console.append(msg.text))

    page.goto(live.url + "/")
    assert page.url == live.url + "/ui/"
    # No token yet and no anonymous read: the page asks for one.
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#banner")).to_contain_text("needs a token")

    _sign_in(page, live.viewer_token)
    node_a = page.locator('#nodes tr[data-node="gpu-node-a"]')
    expect(node_a).to_contain_text("unhealthy")
    expect(node_a).to_contain_text("XID 79 on GPU 3: GPU has fallen off the bus")
    expect(node_a).to_contain_text("(1 bad)")
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator("#banner")).to_be_hidden()

    incident = page.locator("#incidents tbody tr").first
    expect(incident).to_contain_text("gpu_fault")
    expect(incident).to_contain_text("critical")
    expect(incident).to_contain_text("gpu-node-a · GPU 3")
    expect(page.locator("#card-incidents")).to_have_text("1")
    expect(page.locator("#card-nodes-detail")).to_contain_text("1 unhealthy")
    expect(page.locator("#card-gpus")).to_have_text("8")

    job = page.locator('#jobs tr[data-job="llm-pretrain"]')
    expect(job).to_contain_text("2/2")
    expect(job).to_contain_text("4")
    expect(page.locator("#actions tbody")).to_contain_text("isolate_node")

    # The hostile isolation reason is shown as text, in the nodes table and nowhere as markup.
    node_b = page.locator('#nodes tr[data-node="gpu-node-b"] td.reason .isolated')
    expect(node_b).to_have_text(f"isolated: {HOSTILE}")
    assert page.locator("main img, main b").count() == 0
    assert page.evaluate("window.__pwned") is None

    # The token is kept in this tab's sessionStorage only: not in the URL, not logged.
    token = live.viewer_token
    assert page.evaluate("sessionStorage.getItem('trainguard.token')") == token
    assert page.evaluate("localStorage.length") == 0
    assert token not in page.url
    assert not [m for m in console if token in m]
    assert not [m for m in console if "Content Security Policy" in m], console
    assert not errors, errors

    page.screenshot(path=SCREENSHOT, full_page=True)

    # It keeps polling: a new fault shows up without a reload.
    web_post(
        live,
        web_report(
            "gpu-node-c",
            0,
            gpu_overrides={1: {"xid_events": [{"code": 48, "time_unix_s": time.time()}]}},
        ),
    )
    expect(page.locator('#nodes tr[data-node="gpu-node-c"]')).to_contain_text("XID 48")
    expect(page.locator("#card-incidents")).to_have_text("2")

    # The controller goes away: one line says so, and the last data stays (dimmed).
    live.stop()
    expect(page.locator("#banner")).to_contain_text("Controller unreachable", timeout=20_000)
    expect(page.locator("#content")).to_have_class(re.compile(r"\bstale\b"))
    expect(node_a).to_contain_text("unhealthy")
    assert not errors, errors


@pytest.mark.parametrize(
    ("role", "status"), [(None, 401), ("agent", 403)], ids=["unknown-token", "agent-token"]
)
def test_a_refused_token_says_so_and_asks_again(
    live_controller, browser_page, role: str | None, status: int
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.goto(live_controller.url + "/ui/")
    token = "not-a-real-token-0123456789" if role is None else live_controller.agent_token
    _sign_in(page, token)
    banner = page.locator("#banner")
    expect(banner).to_contain_text(f"Token refused (HTTP {status})")
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('trainguard.token')") is None
    expect(page.locator("#nodes tbody tr")).to_have_count(0)

    # The right token then works, without a reload.
    _sign_in(page, live_controller.viewer_token)
    expect(page.locator("#nodes tbody")).to_contain_text("no node has reported yet")
    expect(banner).to_be_hidden()


def test_anonymous_read_needs_no_token(controller_factory, web_report, web_post, browser_page):
    from playwright.sync_api import expect

    live = controller_factory(allow_anonymous_read=True)
    web_post(live, web_report("gpu-node-z", 0))
    page = browser_page
    page.goto(live.url + "/ui/")
    expect(page.locator('#nodes tr[data-node="gpu-node-z"]')).to_contain_text("healthy")
    expect(page.locator("#login")).to_be_hidden()
    expect(page.locator("#signout")).to_be_hidden()
