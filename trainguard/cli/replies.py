"""The shapes the CLI needs from the controller's answers, checked before anything is shown.

Each model names only the fields a command reads to confirm or show what happened (the
controller's own response models, in ``controller.schemas``, have more and may grow); other
fields pass through. :meth:`trainguard.cli.client.ApiClient._request` validates an answer
against one of these and turns a mismatch into one line, "controller sent an unexpected
answer to METHOD PATH: ...", instead of a Python exception or a silent "None"/"No nodes
found." The answer itself is returned unchanged, so ``-o json`` prints what the server sent.

Server text that reaches the terminal goes through :func:`printable` first.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError


class Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnyObject(Reply):
    """Any JSON object (``remediation``, ``goodput``, ``power``, a plan)."""


class Page(Reply):
    """One page of a list endpoint: ``{"data": [...], "count": N}``."""

    data: list[dict[str, Any]]
    count: StrictInt


class Status(Reply):
    version: StrictStr
    nodes_total: StrictInt


class Node(Reply):
    name: StrictStr


class Job(Reply):
    name: StrictStr
    state: StrictStr
    ranks: list[dict[str, Any]]


class Command(Reply):
    """A command to an agent (a preflight): its id, status and reason."""

    id: StrictStr
    status: StrictStr
    reason: StrictStr


class Isolation(Reply):
    """``POST /nodes/{node}/isolate|release``: the node, its new state and the outcome."""

    node: StrictStr
    isolated: StrictBool
    outcome: StrictStr


class Restart(Reply):
    """``POST /jobs/{job}/restart``: the job, the restart's action row and what it did."""

    job: StrictStr
    outcome: StrictStr


class Approval(Reply):
    """``POST /actions/{id}/approve``: the dry run approved and what carrying it out did."""

    action: StrictInt
    kind: StrictStr
    outcome: StrictStr


class AgentTokenIssued(Reply):
    node: StrictStr
    token: StrictStr


class AgentTokensRevoked(Reply):
    node: StrictStr
    revoked: StrictInt


def problem(exc: ValidationError) -> str:
    """The first mismatch, as ``field: message`` in words a user can read."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"]
    if first["type"] == "model_type":
        message = f"expected a JSON object, got {_json_type(first['input'])}"
    elif first["type"] == "missing":
        message = "missing"
    return printable(f"{where}: {message}" if where else message, 200)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


#: ANSI/VT escape sequences (CSI, OSC, and two-character ones) and other C0/C1 controls.
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI ... final byte
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC ... BEL or ST
    r"|\x1b[@-_]?"  # ESC + one byte, or a lone ESC
)
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROLS_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: Any character outside printable ASCII: only these can be invisible (below).
_NON_ASCII = re.compile(r"[^\x20-\x7e]")
#: Unicode categories that draw nothing yet change what a terminal shows: format characters
#: (Cf: bidi overrides and isolates U+202A-202E, U+2066-2069, marks U+200E/U+200F, zero-width
#: U+200B-200D, U+2060, U+FEFF, ...), line/paragraph separators and lone surrogates (which
#: cannot even be written to a UTF-8 stdout: a traceback instead of a table).
_INVISIBLE_CATEGORIES = frozenset({"Cf", "Zl", "Zp", "Cs"})
#: Letters that render as blank space (Hangul fillers): padding that looks like nothing.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0")

#: How much of a server's error text is shown.
MAX_SERVER_TEXT = 300


def hidden(char: str) -> bool:
    """Whether ``char`` draws nothing but reorders or hides what follows (a U+202E in a
    hostname flips the rest of its table row on screen; a zero-width space makes two names
    look alike), or is a C1 control, or cannot be written as UTF-8 (a lone surrogate)."""
    return (
        unicodedata.category(char) in _INVISIBLE_CATEGORIES
        or char in _BLANK_LETTERS
        or "\x7f" <= char <= "\x9f"
    )


def _shown(match: re.Match[str]) -> str:
    """One non-ASCII character as it may reach a terminal: itself, or ``\\uXXXX`` when it
    is :func:`hidden`."""
    char = match.group()
    if hidden(char):
        return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"
    return char


def visible(text: str) -> str:
    """``text`` with every invisible or bidi-reordering character escaped as ``\\uXXXX``,
    so what the terminal shows is what the server holds. ASCII text passes untouched
    (the common case costs one regex scan)."""
    return _NON_ASCII.sub(_shown, text)


def without_escapes(text: str) -> str:
    """``text`` without escape sequences and control characters, line breaks kept (an
    error message that carries a log tail keeps its lines); invisible characters are
    escaped (:func:`visible`)."""
    return visible(_CONTROLS_BUT_LINES.sub(" ", _ESCAPES.sub("", text)))


def printable(text: str, limit: int | None = MAX_SERVER_TEXT) -> str:
    """``text`` safe to print on a terminal: escape sequences and control characters gone,
    whitespace runs as one space, at most ``limit`` characters (then ``...``). Text from a
    server (an error body, a proxy's page) must not move the cursor, retitle the window or
    fill the screen. Invisible and bidi characters are escaped (:func:`visible`), so a
    stored label or hostname cannot reorder or hide part of a table row or a detail view
    (every cell goes through here: ``output.cell``). ``limit=None``: no cap."""
    cleaned = _CONTROLS.sub(" ", _ESCAPES.sub("", text))
    cleaned = visible(" ".join(cleaned.split()))
    if limit is None or len(cleaned) <= limit:
        return cleaned
    return cleaned[: limit - 3].rstrip() + "..."


__all__ = [
    "AgentTokenIssued",
    "AgentTokensRevoked",
    "AnyObject",
    "Command",
    "Isolation",
    "Node",
    "Page",
    "Reply",
    "Status",
    "hidden",
    "printable",
    "problem",
    "visible",
    "without_escapes",
]
