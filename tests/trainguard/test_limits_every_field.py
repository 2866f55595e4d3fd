"""Every number and string of a report is guarded at the door, with its own path: a report
with every list and map filled once is built from the model itself, then each leaf in turn
gets the first value past its limit (int64+1 or int32+1 or -1, inf / NaN, NUL, a lone
surrogate, one character too many) and must be refused naming exactly that field, while its
edge value is accepted. A new field without a limit fails here."""

from __future__ import annotations

import enum
import json
import math
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trainguard import limits, wire

Leaf = tuple[tuple[Any, ...], str, list[Any]]  # path, kind, metadata


def _flat(meta: list[Any]) -> list[Any]:
    return [m for e in meta for m in (e.metadata if isinstance(e, FieldInfo) else [e])]


def _build(tp: Any, meta: list[Any], path: tuple[Any, ...], leaves: list[Leaf]) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *extra = get_args(tp)
        return _build(inner, [*_flat(extra), *meta], path, leaves)
    if origin in (Union, types.UnionType):
        arg = next(a for a in get_args(tp) if a is not type(None))
        return _build(arg, meta, path, leaves)
    if origin is list:
        (item,) = get_args(tp)
        return [_build(item, [], (*path, 0), leaves)]
    if origin is tuple:
        return [_build(a, [], (*path, i), leaves) for i, a in enumerate(get_args(tp))]
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        if value_tp is Any:
            return {}
        key = _build(key_tp, [], (*path, "<key>"), [])
        key = key if isinstance(key, str) else str(key)
        return {key: _build(value_tp, [], (*path, key), leaves)}
    if origin is Literal:
        return get_args(tp)[0]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp)).value
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        out = {}
        for name, field in tp.model_fields.items():
            out[name] = _build(field.annotation, list(field.metadata), (*path, name), leaves)
        return out
    if tp is bool:
        return False
    low = next((m.ge for m in meta if isinstance(m, at.Ge)), None)
    low = next((m.gt + 1 for m in meta if isinstance(m, at.Gt)), low)
    if tp is int:
        leaves.append((path, "int", meta))
        return int(low) if low is not None else 0
    if tp is float:
        leaves.append((path, "float", meta))
        return float(low) if low is not None and low > 0 else 1.0
    if tp is str:
        leaves.append((path, "str", meta))
        if any(getattr(m, "pattern", None) == wire.NAME_PATTERN for m in meta):
            return "a"
        return "a" * max(1, next((m.min_length for m in meta if isinstance(m, at.MinLen)), 1))
    raise AssertionError(f"{path}: no builder for {tp!r}")


def _full_report() -> tuple[dict[str, Any], list[Leaf]]:
    leaves: list[Leaf] = []
    body = _build(wire.Report, [], (), leaves)
    wire.Report.model_validate_json(json.dumps(body))  # the template itself is valid
    return body, leaves


BODY, LEAVES = _full_report()


def _past_limit(kind: str, meta: list[Any]) -> list[Any]:
    """Values just past the field's limits (every field must refuse all of them)."""
    upper = next((m.le for m in meta if isinstance(m, at.Le)), None)
    upper = next((m.lt for m in meta if isinstance(m, at.Lt)), upper)
    if kind == "int":
        assert upper is not None and upper <= limits.INT64_MAX, "unbounded integer"
        return [upper + 1]
    if kind == "float":
        above = [] if upper is None else [math.nextafter(upper, math.inf)]
        return [math.inf, math.nan, *above]
    longest = next((m.max_length for m in meta if isinstance(m, at.MaxLen)), None)
    assert longest is not None, "string without a maximum length"
    return ["a" * (longest + 1), "a\x00", "a\ud800"]


def _set(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(body))
    target: Any = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy


def test_the_template_reaches_many_fields() -> None:
    assert len(LEAVES) > 150


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: ".".join(map(str, leaf[0])))
def test_every_leaf_refuses_values_past_its_limit(leaf: Leaf) -> None:
    path, kind, meta = leaf
    for bad in _past_limit(kind, meta):
        raw = json.dumps(_set(BODY, path, bad), ensure_ascii=True, allow_nan=True)
        try:
            wire.Report.model_validate_json(raw)
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "json_invalid":  # a lone surrogate: Python mode
                with pytest.raises(ValidationError) as info:
                    wire.Report.model_validate(json.loads(raw))
                exc = info.value
            assert tuple(exc.errors()[0]["loc"]) == path, (bad, exc.errors()[0])
        else:
            pytest.fail(f"{'.'.join(map(str, path))} accepted {bad!r}")
