"""Power domains: the tree of provisioned budgets (datacenter → row → rack → server → GPU).

A child's budgets may add up to more than its parent's: that is oversubscription, the point
of this package. What must hold instead is the *measured* power of every domain staying
under its budget, which the policy enforces. Servers are named like the agents' nodes, so a
node's readings land on its server domain.

File format (YAML or JSON)::

    name: dc1
    kind: datacenter
    budget_w: 2000000
    policy: {t2_frac: 0.93}          # optional, inherited by the subtree
    children:
      - {name: row-a, kind: row, budget_w: 260000, children: [...]}
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from power.config import PolicyConfig, policy_with_overrides
from power.errors import ConfigError
from trainguard.textfile import Unparsable, Unreadable, load_document, read_text

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_KEYS = frozenset({"name", "kind", "budget_w", "policy", "children", "gpu_index"})
MAX_DOMAINS = 4096
"""Most domains (of every kind, GPUs included) one tree may hold. The controller's views walk
the whole tree and every tick aggregates it and plans each GPU under it; past a few thousand
servers one PUT or one tick would hold the controller for seconds. Checked while parsing, so
a larger document is refused before it is built."""


class DomainKind(IntEnum):
    """Depth order: a child's kind is always deeper than its parent's (levels may be skipped)."""

    DATACENTER = 0
    ROW = 1
    RACK = 2
    SERVER = 3
    GPU = 4

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(kw_only=True, slots=True)
class Domain:
    name: str
    kind: DomainKind
    budget_w: float
    policy: PolicyConfig
    children: list[Domain] = field(default_factory=list)
    parent: Domain | None = field(default=None, repr=False)
    gpu_index: int | None = None
    """Only for GPU domains: the NVML index of the GPU on its server."""

    def walk(self) -> Iterator[Domain]:
        yield self
        for child in self.children:
            yield from child.walk()

    def ancestors(self) -> list[Domain]:
        """This domain and every domain above it, nearest first."""
        out: list[Domain] = []
        node: Domain | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out


@dataclass(frozen=True, slots=True)
class Reading:
    """A power measurement and when it was taken (controller clock, seconds)."""

    power_w: float
    time_s: float


@dataclass(frozen=True, slots=True)
class DomainPower:
    """A domain's aggregated power. ``complete`` is false when any part was missing or stale;
    ``power_w`` is then a lower bound (the fresh parts only), safe for escalating only."""

    power_w: float
    complete: bool


class DomainTree:
    """Name index over a validated tree plus aggregation of readings up the tree."""

    def __init__(self, root: Domain) -> None:
        """``root`` may be built in code (the simulator, tests) rather than parsed, so its
        shape is checked here too: a cycle would recurse forever, a duplicate name would
        hide a domain from ``by_name``, and a child whose ``parent`` is not the node above
        it would leave that node's caps off its GPUs (:meth:`Domain.ancestors`)."""
        self.root = root
        order = _checked_walk(root)
        self.by_name: dict[str, Domain] = {d.name: d for d in order}
        self._postorder = list(reversed(order))

    def __getitem__(self, name: str) -> Domain:
        return self.by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def servers(self) -> list[Domain]:
        return [d for d in self.root.walk() if d.kind is DomainKind.SERVER]

    def gpu_domain(self, server: str, gpu_index: int) -> Domain | None:
        node = self.by_name.get(server)
        if node is None:
            return None
        for child in node.children:
            if child.kind is DomainKind.GPU and child.gpu_index == gpu_index:
                return child
        return None

    def aggregate(
        self, readings: Mapping[str, Reading], *, now_s: float, stale_after_s: float
    ) -> dict[str, DomainPower]:
        """Every domain's power: its own fresh reading if it has one, else its children's sum.

        A metered row (a PDU reading) is trusted over the sum of its servers, because it
        also sees what no agent reports (switches, fans, a server without an agent).
        A reading that is not a number of watts (NaN, negative) counts as missing: NaN
        compares false with every threshold, so one such server would silently disable
        its row's capping, and a negative one would undercount it into an uncap. A metered
        domain whose meter is missing that way is incomplete, as with a stale meter.
        """
        out: dict[str, DomainPower] = {}
        for dom in self._postorder:
            reading = readings.get(dom.name)
            usable = reading is not None and reading.power_w >= 0
            if reading is not None and usable and now_s - reading.time_s <= stale_after_s:
                out[dom.name] = DomainPower(reading.power_w, True)
                continue
            if dom.children:
                total = 0.0
                complete = True
                for child in dom.children:
                    agg = out[child.name]
                    total += agg.power_w
                    complete = complete and agg.complete
                out[dom.name] = DomainPower(total, complete and reading is None)
            else:
                out[dom.name] = DomainPower(0.0, False)
        return out


def _checked_walk(root: Domain) -> list[Domain]:
    """The domains in pre-order, or :class:`ConfigError` naming the first bad one's path."""
    out: list[Domain] = []
    seen: dict[str, str] = {}
    ids: set[int] = set()
    stack: list[tuple[Domain, Domain | None, str]] = [(root, None, "domains")]
    while stack:
        dom, parent, path = stack.pop()
        if id(dom) in ids:
            raise ConfigError(
                f"{path}: domain {dom.name!r} appears twice in the tree (a cycle or a shared child)"
            )
        if dom.name in seen:
            raise ConfigError(
                f"{path}.name: duplicate domain name {dom.name!r} (also at {seen[dom.name]})"
            )
        if dom.parent is not parent:
            above = parent.name if parent is not None else None
            got = dom.parent.name if dom.parent is not None else None
            raise ConfigError(f"{path}.parent: must be {above!r}, got {got!r}")
        if len(out) >= MAX_DOMAINS:
            raise ConfigError(f"{path}: the tree has more than {MAX_DOMAINS} domains (the limit)")
        budget = dom.budget_w
        if isinstance(budget, bool) or not (
            isinstance(budget, int | float) and math.isfinite(budget) and budget > 0
        ):
            raise ConfigError(
                f"{path}.budget_w: must be a positive number of watts, got {budget!r}"
            )
        if parent is not None and dom.kind <= parent.kind:
            raise ConfigError(
                f"{path}.kind: a {dom.kind.label} cannot sit under a {parent.kind.label} "
                f"({parent.name}); kinds must go deeper"
            )
        ids.add(id(dom))
        seen[dom.name] = path
        out.append(dom)
        for i in reversed(range(len(dom.children))):
            stack.append((dom.children[i], dom, f"{path}.children[{i}]"))
    return out


def load_domains(path: str | Path, *, defaults: PolicyConfig | None = None) -> DomainTree:
    """Read and validate a domain tree from a ``.yaml``/``.yml``/``.json`` file."""
    return parse_domains(read_domains_document(path), defaults=defaults)


def read_domains_document(path: str | Path) -> Any:
    """A ``.yaml``/``.yml``/``.json`` file's decoded document, not yet validated (see
    :func:`parse_domains`); :class:`ConfigError` names the file and why it cannot be read."""
    p = Path(path)
    try:
        text = read_text(p)
    except Unreadable as exc:
        raise ConfigError(f"{p}: cannot read: {exc.reason}") from None
    try:
        return load_document(text, suffix=p.suffix)
    except Unparsable as exc:
        language = "JSON" if p.suffix.lower() == ".json" else "YAML"
        raise ConfigError(f"{p}: not valid {language}: {exc.reason}") from None


def parse_domains(raw: Any, *, defaults: PolicyConfig | None = None) -> DomainTree:
    """Validate a decoded tree; every error names the path of the offending value."""
    seen: dict[str, str] = {}
    root = _parse(raw, "domains", None, defaults or PolicyConfig(), seen)
    return DomainTree(root)


def _parse(
    raw: Any, path: str, parent: Domain | None, inherited: PolicyConfig, seen: dict[str, str]
) -> Domain:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping with name, kind, budget_w")
    unknown = sorted(set(map(str, raw)) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key, expected one of {sorted(_KEYS)}")
    for key in ("name", "kind", "budget_w"):
        if key not in raw:
            raise ConfigError(f"{path}.{key}: required")
    name = raw["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"{path}.name: must be a lowercase DNS-style name (a-z, 0-9, '-', '.'), got {name!r}"
        )
    if name in seen:
        raise ConfigError(f"{path}.name: duplicate domain name {name!r} (also at {seen[name]})")
    if len(seen) >= MAX_DOMAINS:
        raise ConfigError(f"{path}: the tree has more than {MAX_DOMAINS} domains (the limit)")
    seen[name] = path
    try:
        kind = DomainKind[str(raw["kind"]).upper()]
    except KeyError:
        raise ConfigError(
            f"{path}.kind: must be one of {[k.label for k in DomainKind]}, got {raw['kind']!r}"
        ) from None
    if parent is not None and kind <= parent.kind:
        raise ConfigError(
            f"{path}.kind: a {kind.label} cannot sit under a {parent.kind.label} "
            f"({parent.name}); kinds must go deeper"
        )
    budget = raw["budget_w"]
    if (
        isinstance(budget, bool)
        or not isinstance(budget, int | float)
        or not (math.isfinite(budget) and budget > 0)
    ):
        raise ConfigError(f"{path}.budget_w: must be a positive number of watts, got {budget!r}")
    policy = inherited
    if "policy" in raw:
        policy = policy_with_overrides(inherited, raw["policy"], f"{path}.policy")
    gpu_index = raw.get("gpu_index")
    if kind is DomainKind.GPU:
        if isinstance(gpu_index, bool) or not isinstance(gpu_index, int) or gpu_index < 0:
            raise ConfigError(f"{path}.gpu_index: a gpu domain needs a non-negative integer")
        if parent is None or parent.kind is not DomainKind.SERVER:
            raise ConfigError(f"{path}.kind: a gpu domain must sit directly under a server")
    elif gpu_index is not None:
        raise ConfigError(f"{path}.gpu_index: only gpu domains have one")
    dom = Domain(
        name=name,
        kind=kind,
        budget_w=float(budget),
        policy=policy,
        parent=parent,
        gpu_index=gpu_index,
    )
    children = raw.get("children", [])
    if children is None:
        children = []
    if not isinstance(children, list):
        raise ConfigError(f"{path}.children: must be a list")
    if kind is DomainKind.GPU and children:
        raise ConfigError(f"{path}.children: a gpu domain has no children")
    indexes: set[int] = set()
    for i, child_raw in enumerate(children):
        child = _parse(child_raw, f"{path}.children[{i}]", dom, policy, seen)
        if child.gpu_index is not None:
            if child.gpu_index in indexes:
                raise ConfigError(
                    f"{path}.children[{i}].gpu_index: duplicate index {child.gpu_index}"
                )
            indexes.add(child.gpu_index)
        dom.children.append(child)
    return dom


def flat_row(
    name: str,
    *,
    servers: list[str],
    server_budget_w: float,
    budget_w: float,
    policy: PolicyConfig | None = None,
) -> DomainTree:
    """A row directly over its servers: what the simulator replays traces against."""
    pol = policy or PolicyConfig()
    row = Domain(name=name, kind=DomainKind.ROW, budget_w=budget_w, policy=pol)
    for s in servers:
        row.children.append(
            Domain(name=s, kind=DomainKind.SERVER, budget_w=server_budget_w, policy=pol, parent=row)
        )
    return DomainTree(row)
