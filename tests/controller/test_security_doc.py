"""docs/security.md's field limits are the code's: generated from the models, and nothing in
them is left unbounded (a new field without a limit fails here)."""

from __future__ import annotations

from controller.limits_doc import DOC, render, updated
from trainguard import limits


def test_security_doc_tables_match_the_code() -> None:
    text = DOC.read_text()
    assert updated(text) == text, "docs/security.md is out of date: python -m controller.limits_doc"


def test_every_field_is_bounded() -> None:
    table = render()
    for marker in ("UNBOUNDED", "NOT CHECKED FINITE", "UNCHECKED"):
        assert marker not in table, [line for line in table.splitlines() if marker in line]
    # The named limits are the module's values, not copies.
    assert f"| `Int32` | {limits.INT32_MIN} .. {limits.INT32_MAX} |" in table
    assert "`samples[].gpus[].temperature_c` | float | finite |" in table
    assert "`rules[].description` | str | len <= 512, no NUL, no lone surrogate |" in table
