"""Per-parameter merge rules for plain (non-DTensor) sharded state, declared as data.

A spec is an ordered list of ``{pattern, rule, ...}``; the first pattern (``fnmatch``, where
``*`` also crosses ``/``) that matches a tensor's entry name decides. Rules:

``shard``      split evenly along ``dim`` across the tensor-parallel group (Megatron
               column-parallel weight: dim 0; row-parallel weight: dim 1)
``replicate``  the same full tensor on every rank; ``convert`` checks that copies are equal
``average``    a full tensor on every rank whose copies may drift; merged by their mean
``fused``      ``parts`` (global sizes along ``dim``) concatenated, each part split across
               the TP group: each rank holds ``[q_i; k_i; v_i]`` for a fused QKV weight
``vocab``      split along ``dim`` over a vocabulary padded to a multiple of the TP size
               (or ``pad_to``); the global tensor keeps only the first ``size`` rows

Validation is strict: an unknown rule, a missing field, or a tensor no pattern matches is a
:class:`ShardingRuleError` naming it, because a silently replicated shard corrupts a model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpoint.errors import ShardingRuleError

RULES = ("shard", "replicate", "average", "fused", "vocab")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    pattern: str
    rule: str
    dim: int = 0
    parts: tuple[int, ...] = ()
    size: int = 0
    pad_to: int = 1

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Where this rank sits: tensor-, pipeline- and data-parallel sizes and coordinates."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, what in (
            (self.tp, self.tp_rank, "tp"),
            (self.pp, self.pp_rank, "pp"),
            (self.dp, self.dp_rank, "dp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ShardingRuleError(f"layout: {what}_rank {rank} outside {what}={size}")

    def as_dict(self) -> dict[str, int]:
        return {
            "tp": self.tp,
            "tp_rank": self.tp_rank,
            "pp": self.pp,
            "pp_rank": self.pp_rank,
            "dp": self.dp,
            "dp_rank": self.dp_rank,
        }


def _parse_rule(raw: Mapping[str, Any], index: int) -> Rule:
    where = f"rule #{index}"
    if not isinstance(raw, Mapping):
        raise ShardingRuleError(f"{where}: must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - {"pattern", "rule", "dim", "parts", "size", "pad_to"}
    if unknown:
        raise ShardingRuleError(f"{where}: unknown field(s) {sorted(unknown)}")
    pattern, rule = raw.get("pattern"), raw.get("rule")
    if not isinstance(pattern, str) or not pattern:
        raise ShardingRuleError(f"{where}: 'pattern' must be a non-empty string")
    where = f"rule {pattern!r}"
    if rule not in RULES:
        raise ShardingRuleError(f"{where}: rule must be one of {', '.join(RULES)}; got {rule!r}")
    dim = raw.get("dim", 0)
    if not isinstance(dim, int) or dim < 0:
        raise ShardingRuleError(f"{where}: 'dim' must be a non-negative integer")
    parts = tuple(raw.get("parts", ()))
    if rule == "fused" and (not parts or not all(isinstance(p, int) and p > 0 for p in parts)):
        raise ShardingRuleError(f"{where}: fused needs 'parts', a list of positive sizes")
    size = raw.get("size", 0)
    if rule == "vocab" and (not isinstance(size, int) or size <= 0):
        raise ShardingRuleError(f"{where}: vocab needs 'size', the unpadded vocabulary size")
    pad_to = raw.get("pad_to", 1)
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ShardingRuleError(f"{where}: 'pad_to' must be a positive integer")
    return Rule(pattern=pattern, rule=rule, dim=dim, parts=parts, size=size, pad_to=pad_to)


class RuleSpec:
    """An ordered, validated list of rules."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)

    @classmethod
    def parse(cls, raw: Any) -> RuleSpec:
        """From a list of mappings, or ``{"rules": [...]}`` (as loaded from YAML/JSON)."""
        if isinstance(raw, Mapping):
            raw = raw.get("rules")
        if not isinstance(raw, list) or not raw:
            raise ShardingRuleError("rule spec: expected a non-empty list of rules")
        return cls([_parse_rule(item, i) for i, item in enumerate(raw)])

    def match(self, name: str) -> Rule:
        for rule in self.rules:
            if rule.matches(name):
                return rule
        raise ShardingRuleError(f"tensor {name!r} matches no rule in the sharding spec")

    def validate(self, names: Iterable[str]) -> None:
        """Raise naming every tensor that no rule matches."""
        missing = [n for n in names if not any(r.matches(n) for r in self.rules)]
        if missing:
            raise ShardingRuleError(
                f"{len(missing)} tensor(s) match no rule: {', '.join(sorted(missing)[:10])}"
            )
