"""The one declared set of value limits: the wire format, the ORM columns and the docs use it.

Why one place: every number and string an agent, a job or an operator sends ends up in a
database column. PostgreSQL refuses what SQLite silently keeps (an ``integer`` past 2**31,
a ``bigint`` past 2**63, NaN in places, NUL bytes and lone UTF-16 surrogates in ``text``),
and a value the database refuses after the controller accepted it becomes a 5xx, or a report
an agent retries forever. So values are checked at the door against the limits the columns
really have, with pydantic constrained types, and the door answers 422 naming the field.

Every type here is an ``Annotated`` pydantic type, so the checks run in pydantic-core (no
Python call per value on the report hot path) and appear in the OpenAPI schema. A Python
``str`` holding a lone surrogate fails any string constraint (``string_unicode``); a JSON body
holding one is refused by the JSON parser itself, and the controller re-reads such a body to
name the field (``controller.validation``). ``docs/security.md`` lists these limits; a test
checks that the page and this module agree.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# ---------------------------------------------------------------------- database ranges

#: PostgreSQL ``integer`` (SQLite integers hold 64 bits; the stricter one wins).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: PostgreSQL ``bigint``.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# ---------------------------------------------------------------------- string lengths

#: Kubernetes object names (nodes, jobs) and host names: DNS-1123, at most 253 characters.
NAME_LEN = 253
#: Enumerated states and kinds (health, status, severity, backend).
STATE_LEN = 16
#: Incident kinds, command kinds, traffic plan ids, hardware event kinds, sysfs states.
KIND_LEN = 32
#: Versions, agent instance ids, command ids, PCI bus ids, device names, action kinds.
TOKEN_LEN = 64
#: GPU model names and UUIDs, process-group ids, roles, action triggers.
LABEL_LEN = 128
#: Dedupe keys, action targets, fabric link names, one-line details.
KEY_LEN = 512
#: Error messages, reasons, file paths.
MESSAGE_LEN = 1024
#: Free text an operator writes (a policy's description, a chaos drill's note).
NOTE_LEN = 4096

#: Largest GPU, NIC port, NVLink or NUMA index accepted (real hardware stays far below).
INDEX_MAX = 65_535

#: Refuses NUL (PostgreSQL ``text`` cannot hold it); any string constraint also refuses lone
#: surrogates (not encodable as UTF-8).
NO_NUL = r"^[^\x00]*$"

# ---------------------------------------------------------------------- integer types

#: A value stored in an ``integer`` column.
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
#: A value stored in a ``bigint`` column.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
#: A count, total or size in bytes: never negative, stored as ``bigint``.
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: A small count or a rank, world size, pid, clock in MHz: never negative, ``integer``.
Count32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: A GPU / port / link index.
Index = Annotated[int, Field(ge=0, le=INDEX_MAX)]
#: An index where the kernel says -1 for "none" (sysfs ``numa_node``).
SignedIndex = Annotated[int, Field(ge=-1, le=INDEX_MAX)]

# ---------------------------------------------------------------------- float types

#: Any finite double (NaN and +-inf refused: JSON cannot carry them back out, and a
#: detector comparing against NaN decides nothing).
Finite = Annotated[float, Field(allow_inf_nan=False)]
#: A finite, non-negative quantity (seconds, watts, joules, Gbit/s, POSIX time).
NonNegFinite = Annotated[float, Field(ge=0, allow_inf_nan=False)]
#: A finite, strictly positive quantity (an interval, a power limit).
PosFinite = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: A percentage.
Percent = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]
#: Highest power one GPU may report (W): ten times today's largest boards. A reading above it
#: is no reading (the agent drops NVML's sentinels far below this); refusing it at the door
#: keeps the sums the power policy takes over thousands of GPUs finite (1.8e308 W twice is
#: inf, which PostgreSQL's JSON refuses in an incident's evidence).
GPU_WATTS_MAX = 100_000.0
#: Highest power one server may report (W, RAPL or its GPUs' sum).
NODE_WATTS_MAX = 10_000_000.0
#: A GPU's power or power limit.
GpuWatts = Annotated[float, Field(ge=0, le=GPU_WATTS_MAX, allow_inf_nan=False)]
#: A server's power.
NodeWatts = Annotated[float, Field(ge=0, le=NODE_WATTS_MAX, allow_inf_nan=False)]


# ---------------------------------------------------------------------- string types


#: Short texts, by the column they land in.
StateText = Annotated[str, Field(max_length=STATE_LEN, pattern=NO_NUL)]
KindText = Annotated[str, Field(max_length=KIND_LEN, pattern=NO_NUL)]
TokenText = Annotated[str, Field(max_length=TOKEN_LEN, pattern=NO_NUL)]
LabelText = Annotated[str, Field(max_length=LABEL_LEN, pattern=NO_NUL)]
KeyText = Annotated[str, Field(max_length=KEY_LEN, pattern=NO_NUL)]
MessageText = Annotated[str, Field(max_length=MESSAGE_LEN, pattern=NO_NUL)]
NoteText = Annotated[str, Field(max_length=NOTE_LEN, pattern=NO_NUL)]
NameText = Annotated[str, Field(max_length=NAME_LEN, pattern=NO_NUL)]

#: Every limit with its meaning, in the order docs/security.md lists them.
TABLE: tuple[tuple[str, str, str], ...] = (
    ("Int32", f"{INT32_MIN} .. {INT32_MAX}", "values stored in an integer column"),
    ("Int64", f"{INT64_MIN} .. {INT64_MAX}", "values stored in a bigint column"),
    ("Count", f"0 .. {INT64_MAX}", "counts, totals, sizes in bytes, sequence numbers, steps"),
    ("Count32", f"0 .. {INT32_MAX}", "ranks, world sizes, pids, clocks (MHz), XID codes"),
    ("Index", f"0 .. {INDEX_MAX}", "GPU, NIC port and NVLink indices"),
    ("SignedIndex", f"-1 .. {INDEX_MAX}", "NUMA node (-1: none)"),
    ("Finite", "finite double (no NaN, no +-inf)", "temperatures"),
    ("NonNegFinite", "0 .. max finite double", "seconds, joules, POSIX times, Gbit/s"),
    ("PosFinite", "> 0, finite", "intervals, power limits"),
    ("Percent", "0 .. 100, finite", "utilization"),
    ("GpuWatts", f"0 .. {GPU_WATTS_MAX:,.0f}, finite", "a GPU's power and power limits"),
    ("NodeWatts", f"0 .. {NODE_WATTS_MAX:,.0f}, finite", "a server's power"),
    ("StateText", f"<= {STATE_LEN} chars, no NUL, no lone surrogate", "states, kinds"),
    ("KindText", f"<= {KIND_LEN} chars, no NUL, no lone surrogate", "kinds, sysfs states"),
    ("TokenText", f"<= {TOKEN_LEN} chars, no NUL, no lone surrogate", "ids, versions, devices"),
    ("LabelText", f"<= {LABEL_LEN} chars, no NUL, no lone surrogate", "UUIDs, models, groups"),
    ("NameText", f"<= {NAME_LEN} chars, no NUL, no lone surrogate", "host names, label values"),
    ("KeyText", f"<= {KEY_LEN} chars, no NUL, no lone surrogate", "details, one-line errors"),
    ("MessageText", f"<= {MESSAGE_LEN} chars, no NUL, no lone surrogate", "errors, paths"),
    ("NoteText", f"<= {NOTE_LEN} chars, no NUL, no lone surrogate", "operator free text"),
)

__all__ = [
    "GPU_WATTS_MAX",
    "INDEX_MAX",
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "KEY_LEN",
    "KIND_LEN",
    "LABEL_LEN",
    "MESSAGE_LEN",
    "NAME_LEN",
    "NODE_WATTS_MAX",
    "NOTE_LEN",
    "NO_NUL",
    "STATE_LEN",
    "TABLE",
    "TOKEN_LEN",
    "Count",
    "Count32",
    "Finite",
    "GpuWatts",
    "Index",
    "Int32",
    "Int64",
    "KeyText",
    "KindText",
    "LabelText",
    "MessageText",
    "NameText",
    "NodeWatts",
    "NonNegFinite",
    "NoteText",
    "Percent",
    "PosFinite",
    "SignedIndex",
    "StateText",
    "TokenText",
]
