"""A write made for the API commits after the reports submitted before it.

Ingest shows a report's rows in memory from the moment it submits them to the group
commit, which waits ``ingest_flush_interval_s`` for batch-mates. An operator's command for
a node whose first report was still waiting referenced a node row that was not there yet:
the database refused it (foreign key) and the API answered 409 for a node it had just
listed. Seen once in a loaded run of the power bench; here the batch window is made long
so the race is certain without the ordering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests import http_calls
from tests.waiting import wait_for


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_a_command_for_a_node_whose_first_report_waits_for_its_batch_is_accepted(  # type: ignore[no-untyped-def]
    controller_factory, ctl_report: Callable[..., dict[str, Any]]
) -> None:
    live = controller_factory(ingest_flush_interval_s=3.0)
    answers: list[int] = []

    def first_report() -> None:
        with http_calls.client(base_url=live.url, headers=live.headers("agent"), timeout=30) as c:
            answers.append(c.post("/api/v1/reports", json=ctl_report("w1", 0)).status_code)

    reporter = threading.Thread(target=first_report)
    reporter.start()
    # The node is shown while its report waits for the batch window.
    wait_for(lambda: live.controller.state.nodes.get("w1"), timeout_s=10)
    assert not answers
    with http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=30) as op:
        body = {"kind": "set_power_limit", "gpu_index": 0, "limit_w": 300.0}
        created = op.post("/api/v1/nodes/w1/commands", json=body)
    reporter.join(timeout=30)
    assert created.status_code == 201, created.text
    assert answers == [200]
