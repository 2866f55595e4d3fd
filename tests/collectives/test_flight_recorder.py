"""Flight Recorder as a hang's evidence: a real gloo hang, dumps on command, the analysis.

Three ranks run one all_reduce per step with torch's Flight Recorder on; rank 2 hangs before
the all_reduce of step 4. The agent stand-in then relays a ``JobDumpTrace`` command: every
rank answers with its buffer although the training threads are stuck (ranks 0 and 1 inside
gloo's all_reduce, rank 2 in the injected hang), and :func:`collectives.flight.analyze` over
the three dumps names the collective where they diverged and the rank that never entered
it, which must agree with what trainguard's own in-flight reports say.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from collectives import flight
from trainguard.wire import JobDumpTrace

pytestmark = pytest.mark.slow


def test_a_gloo_hang_is_located_by_the_ranks_flight_recorder_dumps(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    agent = collectives_agent
    fault = [{"kind": "hang", "rank": 2, "at_step": 4, "op": "all_reduce", "where": "before"}]
    agent.commands.append((3, JobDumpTrace(id="fr1", job="test-job", incident_id="i-1")))
    ranks = rank_launcher(
        "loop",
        3,
        tmp_path,
        socket_path=agent.path,
        env={
            "TRAINGUARD_FAULTS": json.dumps(fault),
            "TORCH_FR_BUFFER_SIZE": "200",
            "TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S": "0.5",
            "TRAINGUARD_COLLECTIVES_WATCHDOG_INTERVAL_S": "0.1",
            "TRAINGUARD_COLLECTIVES_TRACE_DUMP_DIR": str(tmp_path / "fr"),
        },
    )

    def traces() -> dict[int, Any]:
        return {t.rank: t for _, b in agent.records() for t in b.traces}

    def stuck_reported() -> bool:
        return {x.rank for x in agent.inflight() if x.op == "all_reduce"} >= {0, 1}

    try:
        assert agent.wait_for(lambda: (2, 3) in agent.steps(), 60), ranks.stderr(2)[-2000:]
        assert agent.wait_for(lambda: len(traces()) == 3, 30), ranks.stderr(0)[-2000:]
        assert agent.wait_for(stuck_reported, 30)
        assert [p.poll() for p in ranks.procs] == [None, None, None]  # still hung
    finally:
        ranks.kill()
    dumps = traces()
    assert all(t.enabled and t.command_id == "fr1" and not t.error for t in dumps.values())
    assert all(Path(t.path).is_file() for t in dumps.values())  # full dumps kept on the node
    members: dict[str, list[int]] = {}
    for t in dumps.values():
        members.update(t.pg_ranks)
    (div,) = flight.analyze({r: {"entries": t.entries} for r, t in dumps.items()}, members)
    assert (div.entered, div.missing) == ([0, 1], [2])
    assert flight.family(div.op) == "all_reduce" and div.input_sizes == [[8]]
    # trainguard's own verdict, from the in-flight reports: the ranks stuck in the call, and
    # the group's members that never reported it
    stuck = [x for x in agent.inflight() if x.op == "all_reduce"]
    (seq,) = {x.seq for x in stuck}
    (group_ranks,) = {tuple(x.group_ranks) for x in stuck}
    entered = sorted({x.rank for x in stuck})
    assert (entered, sorted(set(group_ranks) - set(entered))) == (div.entered, div.missing)
    assert div.seq == seq  # the wrapper numbers the world group as Flight Recorder does


def test_analysis_of_dumps_in_step_finds_nothing_and_a_lagging_group_is_named() -> None:
    def entry(group: str, seq: int, t: int = 0) -> dict[str, Any]:
        return {
            "process_group": [group, ""],
            "collective_seq_id": seq,
            "profiling_name": "gloo:all_reduce",
            "input_sizes": [[4]],
            "output_sizes": [[4]],
            "time_created_ns": t,
            "state": "completed",
        }

    in_step = {r: {"entries": [entry("0", 1), entry("0", 2)]} for r in range(3)}
    assert flight.analyze(in_step) == []
    lagging = {
        0: {"entries": [entry("0", 1), entry("1", 1, 5), entry("1", 2, 9)]},
        1: {"entries": [entry("0", 1), entry("1", 1, 6)]},
        2: {"entries": [entry("0", 1)]},
    }
    (div,) = flight.analyze(lagging, {"0": [0, 1, 2], "1": [0, 1, 2]})
    assert (div.group, div.seq, div.entered, div.missing) == ("1", 2, [0], [1, 2])
    assert div.to_dict()["op"] == "gloo:all_reduce"
