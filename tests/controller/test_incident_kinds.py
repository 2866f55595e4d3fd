"""The incident kind registry names every kind a producer opens (policies are checked
against it, so a kind missing here could not be given a rule)."""

from __future__ import annotations

import re
import typing

import pytest

from controller.logic.detection.c4d.findings import FindingKind
from controller.logic.detection.evidence_kinds import EVIDENCE_BY_KIND
from controller.logic.incident_kinds import KNOWN_KINDS, IncidentKind, unknown_kind_error
from controller.logic.remediation.rules import DEFAULT_RULES, Policy
from controller.services.power.loop import INCIDENT_KINDS
from power.tick_io import PolicyIncidentKind


def test_every_producer_kind_is_registered() -> None:
    assert {k.value for k in FindingKind} <= KNOWN_KINDS
    assert set(EVIDENCE_BY_KIND) <= KNOWN_KINDS
    # The power policy's incidents each map to a registered kind, none left to a fallback.
    assert set(INCIDENT_KINDS) == set(typing.get_args(PolicyIncidentKind))
    assert {kind for kind, _ in INCIDENT_KINDS.values()} <= KNOWN_KINDS


def test_every_registered_kind_has_a_rule_that_can_match_it() -> None:
    for kind in IncidentKind:
        assert unknown_kind_error(kind) is None
        assert Policy().rule_for(kind, "critical") is not None  # the default '*' at least
    assert all(unknown_kind_error(rule.kind) is None for rule in DEFAULT_RULES)


@pytest.mark.parametrize("kind", ["", "gpu_fault ", "GPU_FAULT", "power_", "x" * 64])
def test_near_misses_are_unknown(kind: str) -> None:
    error = unknown_kind_error(kind)
    assert error is not None and "\n" not in error and "known kinds:" in error


def test_the_docs_list_every_kind() -> None:
    """docs/remediation.md lists the kinds a rule may name; a kind added here is added there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "remediation.md").read_text()
    listed = text[text.index("The kinds are") :].split("(one list in")[0]
    assert {k.value for k in IncidentKind} == set(re.findall(r"`([a-z_]+)`", listed))
