"""Flight Recorder dumps are what agents relay: they must not put a rank that does not
exist, or a wrong one, in a hang incident's verdict (found in review of bdaf5ee, which
bounded the rank references of the wire)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from controller.services.flight_evidence import flight_evidence
from trainguard import wire


def _entry(seq: int) -> dict[str, Any]:
    return {
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[8]],
        "output_sizes": [[8]],
        "time_created_ns": seq,
        "state": "scheduled",
        "retired": seq < 6,
    }


def _dump(rank: int, last: int, members: list[int]) -> wire.FlightRecorderDump:
    return wire.FlightRecorderDump(
        job="llm",
        rank=rank,
        command_id="c",
        enabled=True,
        entries=[_entry(s) for s in range(1, last + 1)],
        pg_ranks={"0": members},
    )


HANG_OF_2 = SimpleNamespace(kind="hang", ranks=[2])
JOB = {0, 1, 2}


def test_a_dump_from_a_rank_not_of_the_job_is_left_out() -> None:
    dumps = {r: _dump(r, last, [0, 1, 2]) for r, last in ((0, 6), (1, 6), (2, 5))}
    dumps[999] = _dump(999, 1, [0, 1, 2, 999])
    fr = flight_evidence(dumps, JOB, HANG_OF_2)  # type: ignore[arg-type]
    assert fr.dumps_from == [0, 1, 2]
    assert fr.divergences[0].missing == [2] and "999" not in fr.verdict


def test_one_dump_cannot_rewrite_a_groups_members() -> None:
    """Rank 0's dump leaves rank 2 out of group 0: the two other dumps outvote it."""
    dumps = {
        0: _dump(0, 6, [0, 1]),
        1: _dump(1, 6, [0, 1, 2]),
        2: _dump(2, 5, [0, 1, 2]),
    }
    for order in (dumps, dict(reversed(list(dumps.items())))):
        fr = flight_evidence(order, JOB, HANG_OF_2)  # type: ignore[arg-type]
        assert fr.divergences[0].missing == [2], fr.verdict
        assert fr.agrees_with_trainguard is True
