"""The job page refreshes its rank x step matrix with ``GET /jobs/{name}/steps?after=STEP``.

A 2,048-rank job's matrix is ~2.2 MB of JSON re-sent on every live change; with ``after``
the controller sends only newer steps, and says (``incremental``, ``reason``, ``epoch``)
when they cannot be merged onto what the page holds (docs/dashboard.md "Incremental
steps"). The API test posts step summaries through agent reports to a live controller;
the browser test lets new steps arrive under an open job page and checks that it asked
with ``after=`` and draws exactly what a fresh load of the page draws.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests import http_calls
from tests.web.conftest import BROWSER_TIMEOUT_MS, agent_report, open_page, post_report

WORLD = 4


def _steps(
    job: str, steps: range, *, ranks: range = range(WORLD), world: int = WORLD, end: float
) -> list[dict[str, Any]]:
    """One summary per (rank, step); step times differ by rank and step so every heatmap
    band and median is distinct."""
    return [
        {
            "job": job,
            "rank": r,
            "world_size": world,
            "step": s,
            "step_time_s": 1.0 + 0.05 * r + 0.01 * (s % 7),
            "compute_time_s": 0.8,
            "collective_wait_s": 0.2,
            "end_unix_s": end + 0.01 * s,
        }
        for s in steps
        for r in ranks
    ]


class _Poster:
    """Posts step summaries as one agent, its report sequence counting up."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.seq = 0

    def __call__(self, summaries: list[dict[str, Any]]) -> None:
        post_report(self.live, agent_report("node-a", self.seq, samples=1, steps=summaries))
        self.seq += 1


def _get(live: Any, job: str, **params: Any) -> Any:
    return http_calls.get(
        f"{live.url}/api/v1/jobs/{job}/steps",
        params=params,
        headers=live.headers("viewer"),
        timeout=10,
    )


def _read(live: Any, job: str, **params: Any) -> dict[str, Any]:
    r = _get(live, job, **params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_after_sends_only_newer_steps_and_says_when_they_cannot_be_merged(
    live_controller: Any,
) -> None:
    live, post = live_controller, _Poster(live_controller)
    old = time.time() - 60  # settled: no step is held back as still arriving
    post(_steps("inc", range(10), end=old))

    whole = _read(live, "inc")
    assert whole["steps"] == list(range(10)) and whole["incremental"] is False
    assert (whole["after"], whole["reason"], whole["first_step"]) == (None, None, 0)
    assert whole["next_after"] == 9
    epoch = whole["epoch"]

    post(_steps("inc", range(10, 13), end=old))
    delta = _read(live, "inc", after=9)
    assert delta["steps"] == [10, 11, 12]
    assert (delta["incremental"], delta["after"], delta["reason"]) == (True, 9, None)
    assert (delta["epoch"], delta["first_step"], delta["next_after"]) == (epoch, 0, 12)
    # Same shape, and the same values as the tail of a whole answer.
    now = _read(live, "inc")
    assert set(delta) == set(now)
    for key in ("end_unix_s", "median_s", "max_s"):
        assert delta[key] == now[key][-3:], key
    assert [(r["rank"], r["step_time_s"]) for r in delta["ranks"]] == [
        (r["rank"], r["step_time_s"][-3:]) for r in now["ranks"]
    ]
    assert _read(live, "inc", after=12)["steps"] == []  # nothing new: nothing sent

    # A step that is still arriving (rank 3 not in it yet, young) while a later one is whole:
    # the page is told to ask from before it, so it is sent again once complete.
    young = time.time()
    post(_steps("inc", range(13, 14), ranks=range(3), end=young))
    post(_steps("inc", range(14, 15), end=young))
    shown = _read(live, "inc", after=12)
    assert shown["steps"] == [13, 14] and shown["next_after"] == 12
    post(_steps("inc", range(13, 14), ranks=range(3, 4), end=young))
    assert _read(live, "inc", after=12)["next_after"] == 14

    # After more steps than the page shows: the whole window, marked as such.
    gap = _read(live, "inc", last=3, after=5)
    assert (gap["incremental"], gap["reason"], gap["steps"]) == (False, "gap", [12, 13, 14])
    assert gap["first_step"] == 12
    # A page ahead of everything kept (this controller restarted, or the job went lower).
    ahead = _read(live, "inc", after=50)
    assert (ahead["incremental"], ahead["reason"]) == (False, "steps_went_back")
    assert ahead["steps"] == list(range(15))
    assert _read(live, "inc", after=-1)["steps"] == list(range(15))

    # The job restarts from a checkpoint at step 8: its step numbers go back, and steps the
    # page holds are no longer this run's. The epoch says so on the next delta.
    epoch = _read(live, "inc", after=14)["epoch"]
    post(_steps("inc", range(9, 11), end=old))
    restarted = _read(live, "inc", after=14)
    assert restarted["epoch"] != epoch and restarted["steps"] == []

    # A new world size (a shrink) is a new epoch too.
    post(_steps("resize", range(3), end=old))
    before = _read(live, "resize")["epoch"]
    post(_steps("resize", range(3, 5), ranks=range(2), world=2, end=old))
    assert _read(live, "resize", after=2)["epoch"] != before


@pytest.mark.parametrize("after", ["-2", "x", "1.5", str(10**12 + 1)])
def test_a_bad_after_is_a_one_line_422(live_controller: Any, after: str) -> None:
    _Poster(live_controller)(_steps("inc", range(2), end=time.time() - 60))
    r = _get(live_controller, "inc", after=after)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith("query.after:") and "\n" not in detail, detail


@pytest.mark.slow
def test_the_job_page_asks_only_for_new_steps_and_draws_what_a_full_load_draws(
    live_controller: Any, chromium: Any
) -> None:
    from playwright.sync_api import expect

    live, post = live_controller, _Poster(live_controller)
    old = time.time() - 60
    post(_steps("inc", range(118), end=old))
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    try:
        asked: list[str] = []
        context.on("request", lambda r: asked.append(r.url) if "/steps" in r.url else None)
        page = open_page(context, live, live.viewer_token, "#/job/inc")
        heatmap = page.locator("canvas[aria-label^='Heatmap']")
        expect(heatmap).to_have_attribute("aria-label", re.compile(r"by 118 steps, steps 0 to 117"))
        assert asked and asked[0].endswith("/steps?last=120"), asked  # the first load: whole

        # New steps: the job's last step moves, the stream says "jobs" changed, the page
        # refreshes with after= its newest step and keeps the newest 120.
        post(_steps("inc", range(118, 126), end=old))
        expect(heatmap).to_have_attribute(
            "aria-label", re.compile(r"by 120 steps, steps 6 to 125"), timeout=BROWSER_TIMEOUT_MS
        )
        assert any(url.endswith("&after=117") for url in asked), asked
        assert all("&after=" in url for url in asked[1:]), asked  # no whole fetch since
        merged = page.evaluate("document.querySelector('.page.job canvas').toDataURL()")
        summary = page.locator(".hm-summary").inner_text()
        table = page.locator("table.ranks").inner_text()

        # A fresh load (one whole-window fetch) draws the same pixels and texts.
        page.reload()
        expect(heatmap).to_have_attribute("aria-label", re.compile(r"steps 6 to 125"))
        assert asked[-1].endswith("last=120"), asked
        assert page.evaluate("document.querySelector('.page.job canvas').toDataURL()") == merged
        assert page.locator(".hm-summary").inner_text() == summary
        assert page.locator("table.ranks").inner_text() == table
        assert not page.errors, page.errors
    finally:
        context.close()
