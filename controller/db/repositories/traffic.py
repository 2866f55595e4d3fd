"""Traffic plans and fabric link states: the one write path of ``traffic_plans`` and
``traffic_links``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert

from controller.db.models import TrafficLinkState, TrafficPlanVersion
from controller.db.repositories._dml import upsert


def insert_plan_versions(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        conn.execute(insert(TrafficPlanVersion), rows)


def upsert_links(conn: Connection, rows: list[dict[str, Any]]) -> None:
    upsert(conn, TrafficLinkState.__table__, rows)  # type: ignore[arg-type]
