"""The one "a restart already covered this" predicate (``JobBook.restarted_since``), on plain
data: the engine's absorb rule and the restart step's skip both read it."""

from __future__ import annotations

from controller.logic.remediation.goodput import GoodputLedger
from controller.logic.remediation.placement import Placement
from controller.services.remediation.records import JobBook
from controller.services.remediation.steps.restart import restarted_since
from controller.state import IncidentState


def _book(last_restart: float | None) -> JobBook:
    return JobBook(ledger=GoodputLedger("j"), last_restart_unix_s=last_restart)


def _incident(opened: float, node: str | None = None) -> IncidentState:
    return IncidentState(
        id=1,
        kind="straggler",
        severity="warning",
        state="open",
        summary="",
        dedupe_key="k",
        opened_unix_s=opened,
        updated_unix_s=opened,
        node=node,
        job="j",
    )


def test_restarted_since_is_a_restart_at_or_after_the_time() -> None:
    assert not _book(None).restarted_since(100.0)  # never restarted
    assert not _book(99.9).restarted_since(100.0)  # restarted before
    assert _book(100.0).restarted_since(100.0)  # at the very time: covered
    assert _book(100.1).restarted_since(100.0)
    assert not _book(100.0).restarted_since(None)  # no time to compare with


def test_the_restart_step_skips_by_the_same_predicate() -> None:
    current = Placement(job="j", nodes=("a", "b"), ranks_per_node=8, generation=2)
    # At the incident's opening, exactly as the book's predicate says.
    assert restarted_since(_book(100.0), _incident(100.0), current) is not None
    assert restarted_since(_book(99.9), _incident(100.0), current) is None
    assert restarted_since(_book(None), _incident(100.0), current) is None
    # A restart that kept the incident's node did not cover it; one that left it out did.
    assert restarted_since(_book(101.0), _incident(100.0, node="a"), current) is None
    skipped = restarted_since(_book(101.0), _incident(100.0, node="c"), current)
    assert skipped is not None and "without c" in skipped
