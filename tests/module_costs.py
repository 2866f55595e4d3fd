"""Each test module's measured wall seconds under ``make test``: the order xdist hands them out.

The scheduler (tests/conftest.py) gives whole modules to whichever worker is free, longest
first. Guessed from marks alone (a slow test ~3.8 s, any other ~0.28 s), the modules that wait
on a live controller's timers (the remediation engine's, the agent daemon's, leader
failover) looked short: they ran last, four at a time, and the 2-core machine sat 20-60 %
idle through the last two minutes of the run (vmstat, 27 Nov). Measured, they go early,
beside the modules that keep the CPU busy, and the tail is the quick pure modules.

The table is a hint, not a contract: a module missing from it (a new one) is estimated from
its marks; a stale figure only moves a module in the queue. Rebuild it from a run's CPU log::

    TRAINGUARD_TEST_CPU_LOG=/tmp/cpu.tsv make test
    .venv/bin/python -m tests.module_costs /tmp/cpu.tsv
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("module_costs.json")


def load(table: Path = TABLE) -> dict[str, float]:
    """Module path -> measured wall seconds; empty when the table is missing or unreadable
    (the order then falls back to the marks' estimate: slower, never wrong)."""
    try:
        raw = json.loads(table.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
    }


def from_cpu_logs(logs: list[Path]) -> dict[str, float]:
    """Sum each module's per-test wall seconds (column 2 of ``TRAINGUARD_TEST_CPU_LOG``)."""
    walls: dict[str, float] = defaultdict(float)
    for log in logs:
        for line in log.read_text(encoding="utf-8").splitlines():
            fields = line.split("\t")
            if len(fields) < 2:
                continue
            walls[fields[0].split("::", 1)[0]] += float(fields[1])
    return {module: round(seconds, 1) for module, seconds in sorted(walls.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.module_costs CPU_LOG (the TRAINGUARD_TEST_CPU_LOG of a "
              "whole make test run; its .gw* files are read)", file=sys.stderr)  # fmt: skip
        return 2
    base = Path(argv[0])
    logs = sorted(base.parent.glob(base.name + ".gw*")) or ([base] if base.exists() else [])
    if not logs:
        print(f"no CPU log at {base} or {base}.gw*", file=sys.stderr)
        return 2
    table = from_cpu_logs(logs)
    TABLE.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{TABLE}: {len(table)} modules, {sum(table.values()):.0f} s of wall in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
