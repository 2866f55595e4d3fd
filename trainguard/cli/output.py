"""Output formats shared by every read command: kubectl-style tables, JSON, YAML and names.

Tables are plain text on purpose: UPPERCASE headers, columns separated by at least three
spaces, no borders and no colour, so ``grep``, ``awk`` and ``sort`` work on them and the
same bytes come out on a terminal and in a pipe. Free-text columns (reasons, summaries)
go last so splitting on whitespace still finds every other column.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import yaml

from trainguard.cli.errors import BadInput
from trainguard.cli.replies import hidden, printable

#: Any character outside printable ASCII: only these can be hidden.
_NON_ASCII = re.compile(r"[^\x20-\x7e\n]")

JsonObject = dict[str, Any]
EMPTY = "-"
COLUMN_GAP = "   "


class OutputFormat(StrEnum):
    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"
    NAME = "name"


def human_age(seconds: float | None) -> str:
    """kubectl's rounding of a duration: ``45s``, ``3m20s``, ``42m``, ``5h3m``, ``30h``, ``4d``."""
    if seconds is None:
        return EMPTY
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    d = h // 24
    if h < 192:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 365 * 2:
        return f"{d}d"
    return f"{d // 365}y"


def age(unix_s: Any, now_unix_s: float) -> str:
    """Age of a ``*_unix_s`` timestamp relative to ``now_unix_s`` (``-`` when unknown)."""
    if not isinstance(unix_s, int | float):
        return EMPTY
    return human_age(now_unix_s - float(unix_s))


def cell(value: Any) -> str:
    """One table cell: ``-`` for None/empty, compact text for lists and dicts."""
    if value is None or value == "" or value == [] or value == {}:
        return EMPTY
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    if isinstance(value, dict):
        # Keys come from the server as much as values do (node labels, evidence).
        return ",".join(f"{printable(str(k), None)}={cell(v)}" for k, v in sorted(value.items()))
    return printable(str(value), None)  # server text: no escape sequences on the terminal


def unit(value: Any, suffix: str, *, digits: int = 0) -> str:
    """A number with its unit (``312W``, ``71C``, ``85%``), ``-`` when unknown."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return EMPTY
    return f"{value:.{digits}f}{suffix}"


def binary_size(size_bytes: Any) -> str:
    """Bytes in Kubernetes' binary suffixes (``512Mi``, ``79.6Gi``)."""
    if not isinstance(size_bytes, int | float) or isinstance(size_bytes, bool):
        return EMPTY
    value = float(size_bytes)
    for suffix in ("", "Ki", "Mi", "Gi", "Ti"):
        if value < 1024 or suffix == "Ti":
            return f"{value:.0f}{suffix}" if suffix in ("", "Ki") else f"{value:.1f}{suffix}"
        value /= 1024
    return EMPTY  # pragma: no cover - loop always returns


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: header, how to read it from one API object, and whether only ``wide``."""

    header: str
    get: Callable[[JsonObject, float], str]
    wide: bool = False


def field(key: str) -> Callable[[JsonObject, float], str]:
    return lambda item, _now: cell(item.get(key))


def age_of(key: str) -> Callable[[JsonObject, float], str]:
    return lambda item, now: age(item.get(key), now)


def align(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns padded like kubectl's tabwriter; trailing blanks stripped."""
    widths: list[int] = []
    for row in rows:
        for i, text in enumerate(row):
            if i == len(widths):
                widths.append(0)
            widths[i] = max(widths[i], len(text))
    lines = []
    for row in rows:
        padded = [text.ljust(widths[i]) for i, text in enumerate(row)]
        lines.append(COLUMN_GAP.join(padded).rstrip())
    return "\n".join(lines)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return align([list(headers), *rows])


def table_of(
    items: Sequence[JsonObject], columns: Sequence[Column], *, wide: bool, now_unix_s: float
) -> str:
    chosen = [c for c in columns if wide or not c.wide]
    rows = [[c.get(item, now_unix_s) for c in chosen] for item in items]
    return render_table([c.header for c in chosen], rows)


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # beyond the BMP: JSON spells it as a surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def dump_json(obj: Any) -> str:
    """JSON for people and scripts alike: text stays readable (``ensure_ascii=False``), but a
    character that draws nothing, reorders what follows (a U+202E in a label) or cannot be
    written as UTF-8 at all (a lone surrogate a server's ``\\udc80`` decodes to) is escaped.
    Such characters only occur inside strings, where ``\\uXXXX`` means the same character."""
    return _NON_ASCII.sub(_escape_hidden, json.dumps(obj, indent=2, ensure_ascii=False))


def _escape_hidden(match: re.Match[str]) -> str:
    return _json_escape(match) if hidden(match.group()) else match.group()


def _holds_hidden(obj: Any) -> bool:
    if isinstance(obj, str):
        return any(hidden(c) for c in _NON_ASCII.findall(obj))
    if isinstance(obj, dict):
        return any(_holds_hidden(k) or _holds_hidden(v) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return any(_holds_hidden(v) for v in obj)
    return False


def dump_yaml(obj: Any) -> str:
    """YAML with text as it is, unless some of it is hidden (see :func:`dump_json`): then
    every non-ASCII character is written as an escape, the only way YAML has to show one."""
    text: str = yaml.safe_dump(
        obj, sort_keys=False, allow_unicode=not _holds_hidden(obj), default_flow_style=False
    )
    return text.rstrip("\n")


def emit(text: str) -> None:
    """Write one block to stdout; a closed pipe (``| head``) ends quietly."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        sys.stderr.close()
        raise SystemExit(0) from None


def note(text: str) -> None:
    """A human note on stderr (e.g. "No nodes found."), never mixed into stdout data."""
    sys.stderr.write(text + "\n")


def refuse_format(fmt: OutputFormat, command: str) -> BadInput:
    return BadInput(f'output format "{fmt.value}" is not supported by {command}')


__all__ = [
    "EMPTY",
    "Column",
    "OutputFormat",
    "age",
    "age_of",
    "align",
    "binary_size",
    "cell",
    "dump_json",
    "dump_yaml",
    "emit",
    "field",
    "human_age",
    "note",
    "refuse_format",
    "render_table",
    "table_of",
    "unit",
]
