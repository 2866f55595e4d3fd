"""Per-server power traces: the simulator's input, read from CSV or Parquet.

Schema, one row per server per time step (long format, what a metrics export gives)::

    time_s, server, gpu_power_w, priority, workload[, other_power_w]

``gpu_power_w`` is the sum over the server's GPUs at full clocks (nothing capped);
``other_power_w`` (CPUs, fans, NICs) does not respond to GPU clocks and defaults to 0.
Every server must cover the same evenly spaced time steps, and keep one priority and one
workload kind for the whole trace.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from power.config import Priority, WorkloadKind
from power.errors import TraceError

FloatArray = npt.NDArray[np.float64]
COLUMNS = ("time_s", "server", "gpu_power_w", "priority", "workload")
OPTIONAL = ("other_power_w",)


@dataclass(slots=True)
class ServerTrace:
    name: str
    priority: Priority
    workload: WorkloadKind
    gpu_power_w: FloatArray
    other_power_w: FloatArray


@dataclass(slots=True)
class Trace:
    step_s: float
    start_s: float
    servers: list[ServerTrace]

    @property
    def n_steps(self) -> int:
        return int(self.servers[0].gpu_power_w.shape[0]) if self.servers else 0

    def steps(self, start: int, stop: int) -> Trace:
        """The part of the trace from step ``start`` up to (not including) ``stop``."""
        return Trace(
            step_s=self.step_s,
            start_s=self.start_s + start * self.step_s,
            servers=[
                ServerTrace(
                    name=s.name,
                    priority=s.priority,
                    workload=s.workload,
                    gpu_power_w=s.gpu_power_w[start:stop],
                    other_power_w=s.other_power_w[start:stop],
                )
                for s in self.servers
            ],
        )

    def row_power_w(self, count: int | None = None) -> FloatArray:
        chosen = self.servers if count is None else self.servers[:count]
        total = np.zeros(self.n_steps)
        for s in chosen:
            total += s.gpu_power_w + s.other_power_w
        return total


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return _from_columns(_read_parquet(p), str(p))
    if suffix == ".csv":
        return _from_columns(_read_csv(p), str(p))
    raise TraceError(f"{p}: unknown trace format {suffix!r}, expected .csv or .parquet")


def _read_csv(p: Path) -> dict[str, list[str]]:
    """The CSV's columns by header name. ``utf-8-sig``: Excel writes a byte-order mark
    before the header, which plain UTF-8 would glue onto ``time_s`` ("missing column").
    A malformed CSV (a field over the csv module's 128 KiB limit, a NUL byte) is a
    :class:`TraceError` naming the line, not the csv module's bare ``Error``."""
    reader = None
    try:
        with p.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise TraceError(f"{p}: empty file, expected a header {','.join(COLUMNS)}")
            header = [h.strip() for h in header]
            _check_header(header, str(p))
            cols: dict[str, list[str]] = {h: [] for h in header}
            for lineno, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) != len(header):
                    raise TraceError(f"{p}:{lineno}: expected {len(header)} fields, got {len(row)}")
                for h, v in zip(header, row, strict=True):
                    cols[h].append(v)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: cannot read: {exc}") from None
    except csv.Error as exc:
        where = f"{p}:{reader.line_num}" if reader is not None else str(p)
        raise TraceError(f"{where}: not valid CSV: {exc}") from None
    return cols


def _read_parquet(p: Path) -> dict[str, list[str]]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - pyarrow is a declared extra
        raise TraceError(f"{p}: Parquet needs pyarrow (pip install 'trainguard[power]')") from None
    try:
        table = pq.read_table(p)
    except Exception as exc:  # pyarrow raises many types for a corrupt file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(f"{p}: not a readable Parquet file: {first}") from None
    _check_header(list(table.column_names), str(p))
    return {name: [str(v) for v in table.column(name).to_pylist()] for name in table.column_names}


def _check_header(header: list[str], where: str) -> None:
    """Every required column, no unknown one, none twice: a column given twice would
    leave the reader unsure which one holds the data (and once broke it outright)."""
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise TraceError(f"{where}: column {twice[0]!r} appears more than once")
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{where}: missing column {missing[0]!r}; need {', '.join(COLUMNS)}")
    unknown = [c for c in header if c not in COLUMNS + OPTIONAL]
    if unknown:
        raise TraceError(f"{where}: unknown column {unknown[0]!r}")


def _num(value: str, where: str, column: str, *, nonneg: bool) -> float:
    try:
        x = float(value)
    except ValueError:
        raise TraceError(f"{where}: {column} must be a number, got {value!r}") from None
    if not math.isfinite(x) or (nonneg and x < 0):
        raise TraceError(f"{where}: {column} must be a finite non-negative number, got {value!r}")
    return x


def _from_columns(cols: dict[str, list[str]], where: str) -> Trace:
    n = len(cols["time_s"])
    if n == 0:
        raise TraceError(f"{where}: no data rows")
    is_csv = where.endswith(".csv")

    def line(i: int) -> str:
        return f"{where}:{i + 2}" if is_csv else f"{where} row {i}"

    per: dict[str, dict[str, object]] = {}
    times: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    other: dict[str, list[float]] = {}
    has_other = "other_power_w" in cols
    for i in range(n):
        name = cols["server"][i].strip()
        if not name:
            raise TraceError(f"{line(i)}: server is empty")
        t = _num(cols["time_s"][i], line(i), "time_s", nonneg=False)
        g = _num(cols["gpu_power_w"][i], line(i), "gpu_power_w", nonneg=True)
        o = (
            _num(cols["other_power_w"][i], line(i), "other_power_w", nonneg=True)
            if (has_other)
            else 0.0
        )
        try:
            prio = Priority(cols["priority"][i].strip().lower())
        except ValueError:
            raise TraceError(
                f"{line(i)}: priority must be one of {[p.value for p in Priority]}, "
                f"got {cols['priority'][i]!r}"
            ) from None
        try:
            kind = WorkloadKind(cols["workload"][i].strip().lower())
        except ValueError:
            raise TraceError(
                f"{line(i)}: workload must be one of {[k.value for k in WorkloadKind]}, "
                f"got {cols['workload'][i]!r}"
            ) from None
        meta = per.setdefault(name, {"priority": prio, "workload": kind})
        if meta["priority"] is not prio or meta["workload"] is not kind:
            raise TraceError(f"{line(i)}: server {name!r} changes priority or workload mid-trace")
        times.setdefault(name, []).append(t)
        gpu.setdefault(name, []).append(g)
        other.setdefault(name, []).append(o)
    names = list(per)
    ref = np.asarray(times[names[0]])
    order = np.argsort(ref, kind="stable")
    ref = ref[order]
    if len(ref) < 2:
        raise TraceError(f"{where}: need at least two time steps per server")
    steps = np.diff(ref)
    step = float(steps[0])
    if step <= 0 or not np.allclose(steps, step, rtol=1e-6, atol=1e-9):
        raise TraceError(f"{where}: time_s of server {names[0]!r} is not evenly spaced")
    servers: list[ServerTrace] = []
    for name in names:
        ts = np.asarray(times[name])
        idx = np.argsort(ts, kind="stable")
        if ts.shape != ref.shape or not np.allclose(ts[idx], ref, atol=1e-9):
            raise TraceError(
                f"{where}: server {name!r} does not cover the same time steps as {names[0]!r}"
            )
        servers.append(
            ServerTrace(
                name=name,
                priority=per[name]["priority"],  # type: ignore[arg-type]
                workload=per[name]["workload"],  # type: ignore[arg-type]
                gpu_power_w=np.asarray(gpu[name], dtype=np.float64)[idx],
                other_power_w=np.asarray(other[name], dtype=np.float64)[idx],
            )
        )
    return Trace(step_s=step, start_s=float(ref[0]), servers=servers)


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write CSV or Parquet (by suffix) atomically: a crash leaves the old file or none."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    times = trace.start_s + trace.step_s * np.arange(trace.n_steps)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        n = trace.n_steps
        table = pa.table(
            {
                "time_s": np.tile(times, len(trace.servers)),
                "server": [s.name for s in trace.servers for _ in range(n)],
                "gpu_power_w": np.concatenate([s.gpu_power_w for s in trace.servers]),
                "priority": [s.priority.value for s in trace.servers for _ in range(n)],
                "workload": [s.workload.value for s in trace.servers for _ in range(n)],
                "other_power_w": np.concatenate([s.other_power_w for s in trace.servers]),
            }
        )
        pq.write_table(table, tmp)
    elif suffix == ".csv":
        with tmp.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow([*COLUMNS, "other_power_w"])
            for s in trace.servers:
                for t, g, o in zip(times, s.gpu_power_w, s.other_power_w, strict=True):
                    w.writerow(
                        [
                            f"{t:g}",
                            s.name,
                            f"{g:.1f}",
                            s.priority.value,
                            s.workload.value,
                            f"{o:.1f}",
                        ]
                    )
    else:
        raise TraceError(f"{p}: unknown trace format {suffix!r}, expected .csv or .parquet")
    with tmp.open("rb+") as fh:
        import os

        os.fsync(fh.fileno())
    tmp.replace(p)
