"""One-line messages for validation errors that name the offending field."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def error_location(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def one_line(errors: Sequence[dict[str, Any]], *, prefix: tuple[str, ...] = ()) -> str:
    """``"body.samples.0.gpus.0.power_w: Input should be ..."`` (+ how many more)."""
    if not errors:
        return "invalid request"
    first = errors[0]
    loc = error_location([*prefix, *first.get("loc", ())])
    msg = " ".join(str(first.get("msg", "invalid value")).split())
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{more}"


def structured(
    errors: Sequence[dict[str, Any]], *, prefix: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """JSON-safe error list (no ``ctx`` objects or raw input echoed back)."""
    return [
        {
            "loc": [*prefix, *e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in errors[:20]
    ]


def from_pydantic(
    exc: ValidationError, *, prefix: tuple[str, ...] = ("body",)
) -> tuple[str, list[dict[str, Any]]]:
    errors = [dict(e) for e in exc.errors(include_url=False, include_input=False)]
    return one_line(errors, prefix=prefix), structured(errors, prefix=prefix)


# ---------------------------------------------------------------------- storable values

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

#: A report body is only walked field by field when it may hide a value the database cannot
#: store: an integer past 64 bits (19+ digits), a float that overflowed to infinity (a
#: three-digit exponent, 1e999), NaN/Infinity literals, or an escaped NUL (PostgreSQL text
#: cannot hold one). Stage one maps every digit to ``0`` with ``bytes.translate`` and
#: searches with ``in`` (C loops, tens of microseconds for a 20 KB report); only a hit runs
#: stage two, regexes that require a JSON number or literal token (not text inside a
#: string such as a hex id), and only a hit there pays for the walk.
_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_INT = b"0" * 19
_LITERALS = (b"NaN", b"Infinity")
_NUL = b"\\u0000"
_TOKEN = re.compile(
    rb"(?<![\w\".-])(?:-?[0-9]{19,}|-?[0-9]+(?:\.[0-9]+)?[eE]\+?[0-9]{3,}|-?Infinity|NaN)(?![\w\".])"
)


def _suspicious(body: bytes) -> bool:
    if _NUL in body:
        return True
    mapped = body.translate(_DIGITS, b"+")  # 1E+400 -> 0e000
    stage_one = _LONG_INT in mapped or b"0e000" in mapped or any(lit in body for lit in _LITERALS)
    return stage_one and _TOKEN.search(body) is not None


def unstorable_field(value: BaseModel, body: bytes, *, prefix: str = "body") -> str | None:
    """One-line error naming the first field the database could not store, or ``None``."""
    if not _suspicious(body):
        return None
    return first_unstorable(value, prefix)


def first_unstorable(value: Any, path: str) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{path}: integer out of range (must fit in 64 bits)"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: number must be finite"
    if isinstance(value, str):
        if "\x00" in value:
            return f"{path}: text must not contain NUL characters"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{path}: text must not contain lone UTF-16 surrogates (not valid Unicode)"
        return None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found = first_unstorable(getattr(value, name), f"{path}.{name}")
            if found:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = first_unstorable(key, f"{path}.{key}") or first_unstorable(
                item, f"{path}.{key}"
            )
            if found:
                return found
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = first_unstorable(item, f"{path}.{index}")
            if found:
                return found
    return None


#: Escapes of UTF-16 surrogates (``\\ud800``..``\\udfff``); a lone one is not Unicode, and
#: pydantic's JSON parser refuses the whole body for it without naming the field.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_body_problem(body: bytes, *, prefix: str = "body") -> str | None:
    """One-line error naming the first value of a JSON body no database can store (NUL,
    lone surrogate, NaN/inf, an integer past 64 bits), or ``None``.

    Cheap for ordinary bodies (byte scans); only a suspicious one is parsed and walked.
    A body that is not JSON at all is ``None`` too: the route's parser reports that (400).
    """
    if not (_suspicious(body) or _SURROGATE.search(body)):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return first_unstorable(value, prefix)
