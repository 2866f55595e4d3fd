"""The remediation engine's memory of decisions is bounded by the open incidents.

It keeps, per incident, what it decided (acted, alerted, no rule ...) and whether its
alert was raised, so an open incident is not acted on twice. Only open incidents are ever
looked at, yet both maps kept every incident the controller had seen, for good: months of
stragglers and XIDs, one entry each, in the leader's memory.
"""

from __future__ import annotations

import pytest

from tests.remediation.test_engine import (
    ENGINE,
    STRAGGLER_POLICY,
    on_loop,
    open_incident,
    policy_file,
    straggler_evidence,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]


def test_decisions_of_closed_incidents_are_forgotten(controller_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(policy_file=policy_file(tmp_path, STRAGGLER_POLICY))
    engine = live.controller.remediation
    ids = [
        open_incident(live, "straggler", node="n1", evidence=straggler_evidence(4.0))
        for _ in range(6)
    ] + [open_incident(live, "comm_slow", node="n2") for _ in range(6)]
    # Each is looked at: the stragglers alerted (too cheap to act on yet), the others
    # alerted and decided (their rule only alerts).
    wait_for(lambda: all(i in engine.decided or i in engine.alerted for i in ids))
    kept = ids[0]
    for incident in ids[1:]:
        state = live.controller.state.incidents[incident]
        on_loop(live, live.controller.incidents.resolve(state, note="resolved by the test"))
    live.wait_ticks(ENGINE, 2)
    assert set(engine.decided) <= {kept} and engine.alerted <= {kept}
    assert kept in engine.decided or kept in engine.alerted  # the open one is remembered
    live.wait_ticks(ENGINE, 2)
    assert kept in engine.alerted or kept in engine.decided  # and not acted on again
