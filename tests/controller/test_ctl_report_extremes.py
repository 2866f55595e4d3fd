"""Hypothesis over the report format's extremes, posted as real reports to a live controller
on SQLite and PostgreSQL: every field at the edges of its declared limits (int32/int64 ends,
the largest and smallest doubles, inf/NaN, empty and longest strings, NUL, lone surrogates,
astral characters). A report is 200 and stored exactly as sent when every value is within
``trainguard.limits``, else 422 naming the field and nothing of it is stored; never 5xx."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from tests import http_calls
from trainguard import limits as L

pytestmark = pytest.mark.slow

INTS = {
    "count": (L.INT64_MAX, [0, 1, L.INT32_MAX + 1, L.INT64_MAX], [-1, L.INT64_MAX + 1, 2**80]),
    "count32": (L.INT32_MAX, [0, L.INT32_MAX], [-1, L.INT32_MAX + 1, L.INT64_MAX]),
}
FLOATS = {
    "nonneg": ([0.0, -0.0, 5e-324, 1.7976931348623157e308], [-1.0, math.inf, math.nan]),
    "finite": ([-1.7976931348623157e308, -5e-324, 0.0, 1e308], [math.inf, -math.inf, math.nan]),
    # A GPU's power: bounded, so the power policy's sums over a fleet stay finite.
    "gpu_watts": (
        [0.0, 5e-324, L.GPU_WATTS_MAX],
        [-1.0, math.nextafter(L.GPU_WATTS_MAX, math.inf), 1.7976931348623157e308, math.nan],
    ),
}


def _strings(max_len: int, *, min_len: int = 0) -> tuple[list[str], list[str]]:
    valid = ["x" * max_len, "é😀\u2028", "tab\tnewline\n"] + ([""] if min_len == 0 else [])
    invalid = ["x" * (max_len + 1), "a\x00b", "a\ud800b", "\udfff"]
    return valid, invalid


#: (path in the report, kind, valid values, invalid values)
FIELDS: list[tuple[tuple[Any, ...], list[Any], list[Any]]] = [
    (("node", "hostname"), *_strings(L.NAME_LEN)),
    (("node", "agent_version"), *_strings(L.TOKEN_LEN)),
    (("node", "driver_version"), *_strings(L.TOKEN_LEN)),
    (("node", "labels", "rack"), *_strings(L.NAME_LEN)),
    (("node", "gpus", 0, "uuid"), *_strings(L.LABEL_LEN, min_len=1)),
    (("node", "gpus", 0, "name"), *_strings(L.LABEL_LEN)),
    (("node", "gpus", 0, "memory_total_bytes"), *INTS["count"][1:]),
    (("spool_dropped_total",), *INTS["count"][1:]),
    (("seq",), *INTS["count"][1:]),
    (("sent_unix_s",), *FLOATS["nonneg"]),
    (("samples", 0, "gpus", 0, "power_w"), *FLOATS["gpu_watts"]),
    (("samples", 0, "gpus", 0, "temperature_c"), *FLOATS["finite"]),
    (("samples", 0, "gpus", 0, "ecc_uncorrected_total"), *INTS["count"][1:]),
    (("samples", 0, "gpus", 0, "sm_clock_mhz"), *INTS["count32"][1:]),
    (("samples", 0, "gpus", 0, "xid_events", 0, "detail"), *_strings(L.KEY_LEN)),
]

_names = itertools.count()


@st.composite
def reports(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
    """A report with every listed field at a valid extreme, and maybe one at an invalid one
    (returned, so the expected answer is known without asking pydantic)."""
    name = f"x-{next(_names)}"
    body: dict[str, Any] = {
        "node": {"name": name, "labels": {}, "gpus": [{"index": 0, "uuid": "u"}]},
        "agent_instance": "i",
        "samples": [
            {
                "time_unix_s": 1.0,
                "gpus": [{"index": 0, "xid_events": [{"code": 13, "time_unix_s": 1.0}]}],
            }
        ],
    }
    for path, valid, _invalid in FIELDS:
        _put(body, path, draw(st.sampled_from(valid)))
    bad: tuple[Any, ...] | None = None
    if draw(st.booleans()):
        path, _valid, invalid = draw(st.sampled_from(FIELDS))
        _put(body, path, draw(st.sampled_from(invalid)))
        bad = path
    return body, bad


def _put(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


@pytest.fixture
def db_engine(live_controller: Any) -> Any:
    engine = create_engine(live_controller.settings.database_url)
    yield engine
    engine.dispose()


def test_extremes_are_stored_exactly_or_refused_by_path(
    live_controller: Any, db_engine: Any
) -> None:
    headers = {**live_controller.headers("agent"), "Content-Type": "application/json"}
    client = http_calls.client(base_url=live_controller.url, timeout=10)
    seen = {"accepted": 0, "refused": 0}

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(reports())
    def run(case: tuple[dict[str, Any], tuple[Any, ...] | None]) -> None:
        body, bad = case
        # ensure_ascii: NUL and lone surrogates travel as \u escapes; NaN/Infinity as literals.
        raw = json.dumps(body, ensure_ascii=True, allow_nan=True)
        r = client.post("/api/v1/reports", content=raw, headers=headers)
        name = body["node"]["name"]
        with db_engine.connect() as conn:
            node = conn.execute(
                text(
                    "SELECT hostname, agent_version, driver_version, labels, spool_dropped_total"
                    " FROM nodes WHERE name = :n"
                ),
                {"n": name},
            ).one_or_none()
            gpu = conn.execute(
                text("SELECT uuid, name, memory_total_bytes FROM gpus WHERE node_name = :n"),
                {"n": name},
            ).one_or_none()
            cursor = conn.execute(
                text("SELECT last_seq FROM agent_cursors WHERE node_name = :n"), {"n": name}
            ).scalar_one_or_none()
        if bad is not None:
            assert r.status_code == 422, (bad, r.status_code, r.text[:300])
            where = ".".join(str(p) for p in ("body", *bad))
            assert r.json()["detail"].startswith(where), (where, r.json()["detail"])
            assert node is None and gpu is None and cursor is None
            seen["refused"] += 1
            return
        assert r.status_code == 200, (r.status_code, r.text[:300])
        n, g = body["node"], body["node"]["gpus"][0]
        assert node is not None and gpu is not None
        labels = node.labels if isinstance(node.labels, dict) else json.loads(node.labels)
        assert (node.hostname, node.agent_version, node.driver_version, labels) == (
            n["hostname"], n["agent_version"], n["driver_version"], n["labels"]
        )  # fmt: skip
        assert node.spool_dropped_total == body["spool_dropped_total"]
        assert (gpu.uuid, gpu.name, gpu.memory_total_bytes) == (
            g["uuid"], g["name"], g["memory_total_bytes"]
        )  # fmt: skip
        assert cursor == body["seq"]
        seen["accepted"] += 1

    try:
        run()
    finally:
        client.close()
    # Both outcomes were exercised (the strategy is not stuck on one side).
    assert seen["accepted"] >= 10 and seen["refused"] >= 10, seen
