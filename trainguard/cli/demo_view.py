"""What ``trainguard demo`` prints at the end: the faults table and its checks."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from trainguard.cli.drill import FaultOutcome
from trainguard.cli.output import Column, cell, field, table_of

#: Fault to training resumed, the target on this machine; slower rows are marked.
RECOVERY_TARGET_S = 60.0


@dataclass(frozen=True, slots=True)
class Check:
    """One thing the demo promised; all must hold for exit status 0."""

    ok: bool
    text: str


def _seconds(key: str) -> Column:
    def show(item: dict[str, object], _now: float) -> str:
        value = item.get(key)
        if not isinstance(value, int | float):
            return cell(value)
        late = key == "recover_s" and value > RECOVERY_TARGET_S
        return f"{value:.1f}" + (" (> target)" if late else "")

    return Column(key.upper().replace("_", "-"), show)


FAULTS = (
    Column("FAULT", field("fault")),
    Column(
        "CULPRIT",
        lambda i, _n: f"{i['node']}" + (f" rank {i['rank']}" if i.get("rank") is not None else ""),
    ),
    Column("INCIDENT", field("incident")),
    _seconds("detect_s"),
    _seconds("recover_s"),
    Column("STEPS-LOST", field("steps_lost")),
    Column("WORLD", lambda i, _n: f"{cell(i.get('world_before'))} -> {cell(i.get('world_after'))}"),
    Column("RESUMED-FROM", field("resumed_from")),
)


def fault_table(outcomes: list[FaultOutcome]) -> str:
    return table_of([o.as_dict() for o in outcomes], FAULTS, wide=True, now_unix_s=0.0)


def print_checks(console: Console, checks: list[Check]) -> None:
    console.out("checks:", highlight=False)
    for check in checks:
        console.out(f"  {'ok  ' if check.ok else 'FAIL'}  {check.text}", highlight=False)


__all__ = ["RECOVERY_TARGET_S", "Check", "fault_table", "print_checks"]
