"""Two slow nodes of one job across a controller restart: the companion's incidents are
not acted on again by the new leader.

When the budget refuses the companion's isolation (n1), its incidents are decided as
``batched, isolation refused`` in the leader's memory only; the row that says so is n1's
``isolate_node`` row under the *first* incident's trigger. A new leader read back only the
rows under each incident's own trigger, so it acted on n1's incidents again: checkpoint,
isolate n1 (refused again) and a second restart onto the same nodes. It now reads the
refusal back (``history.refused_companions``). A companion that *was* isolated is not
marked: its incidents are absorbed as covered once the job resumes, whichever leader sees
the resume, and a restart in between does not make the new leader act on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import ENGINE, absorbed, actions
from tests.remediation.test_slow_node_once import enable, policy, resumed
from tests.remediation.test_two_slow_nodes import all_resolved, resolved, rows_of, two_slow_nodes
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]


def restart_controller(live: Any, actuator: RecordingActuator, body: dict[str, Any]) -> None:
    """Restart the controller on the same database (its policy file says ``enabled:
    false``), give the new engine the same actuator, then turn it on: its first tick loads
    what the earlier leader decided."""
    live.restart()
    live.controller.remediation.actuator = actuator
    enable(live, body)
    live.wait_ticks(ENGINE, 3)


def test_a_refused_companion_is_not_acted_on_after_a_restart(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """Old code: the new leader checkpointed, was refused n1 again, and restarted the job
    a second time onto n2, n1."""
    live, agents, actuator, on_n0, on_n1 = two_slow_nodes(controller_factory, tmp_path)
    body = policy(max_isolated_fraction=0.2)
    enable(live, body)
    resumed(live, agents, "n2")
    all_resolved(live, on_n0[1:])
    live.wait_ticks(ENGINE, 3)
    before = rows_of(live, on_n0 + on_n1)
    assert [p.nodes for p in actuator.restarts()] == [("n2", "n1")]
    # The refusal's row names every incident of n1 it decided, for a later leader.
    (row,) = [a for a in actions(live) if a["kind"] == "isolate_node" and a["target"] == "n1"]
    assert row["status"] == "skipped" and row["params"]["refused_incidents"] == on_n1, row
    restart_controller(live, actuator, body)
    engine = live.controller.remediation
    assert rows_of(live, on_n0 + on_n1) == before
    assert [p.nodes for p in actuator.restarts()] == [("n2", "n1")]
    assert all(i in engine.decided for i in on_n1), {i: engine.decided.get(i) for i in on_n1}
    assert engine.ctx.restarts.count("gpt") == 1
    assert not any(resolved(live, i) for i in on_n1)  # still left for a human


def test_an_isolated_companion_is_absorbed_after_a_restart_before_the_resume(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """The controller restarts after the one restart, before the job steps again: the new
    leader waits for the resume and then absorbs n1's incidents as covered."""
    live, agents, actuator, on_n0, on_n1 = two_slow_nodes(controller_factory, tmp_path)
    body = policy(max_isolated_fraction=0.5)
    enable(live, body)
    jobs = live.controller.remediation.jobs
    wait_for(lambda: "gpt" in jobs and jobs["gpt"].awaiting_resume is not None)
    restart_controller(live, actuator, body)
    resumed(live, agents, "n2")
    all_resolved(live, on_n0[1:] + on_n1)
    live.wait_ticks(ENGINE, 3)
    assert all(absorbed(live, i) for i in on_n0[1:] + on_n1)
    assert rows_of(live, on_n0 + on_n1) == [
        ("checkpoint", "skipped", "gpt"),
        ("isolate_node", "succeeded", "n0"),
        ("isolate_node", "succeeded", "n1"),
        ("restart_job", "succeeded", "gpt"),
    ]
    assert [p.nodes for p in actuator.restarts()] == [("n2", "n3")]
    assert live.controller.remediation.ctx.restarts.count("gpt") == 1  # read back, not redone
