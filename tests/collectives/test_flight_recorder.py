"""Flight Recorder analysis over dumps (pure). The real gloo hang, with the ranks' dumps
taken on command while they are stuck, is in test_multirank.py's hang test."""

from __future__ import annotations

from typing import Any

from collectives import flight


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
