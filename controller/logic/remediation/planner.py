"""Restart planning: where a job runs after a fault, as a pure function of what is healthy.

The policy engine knows which nodes to leave out (the culprit, isolated and unhealthy nodes)
and which nodes the actuator offers; :func:`plan_restart` turns that into the next
:class:`~controller.logic.remediation.placement.Placement`, or a refusal with a one-line reason.

Rules, in order:

1. Every healthy node of the current placement keeps its position, so its ranks keep their
   node (warm page cache, local checkpoint shards, fewer surprises).
2. Each excluded node is replaced by a healthy spare from ``candidates``, in candidate order.
   Same world size: the ranks load the checkpoint as they saved it.
3. Without enough spares the data-parallel size shrinks: the unfilled slots are dropped and
   ``dp = nodes * ranks_per_node / tp`` must stay ``>= min_dp`` and divide ``dp_must_divide``
   (the global batch must split evenly over data-parallel ranks); if it does not, one more
   node is dropped until it does. The ranks reshard the universal checkpoint to the new dp.
   Holes left by dropped nodes are filled by moving the *last* nodes into them, so only the
   nodes that have to move do.
4. ``grow=True`` with ``original_nodes`` above the current node count adds healthy spares
   back, up to the original size, under the same dp rules.

No I/O and no clock: the same inputs always give the same plan, which keeps the engine's
decisions reproducible in tests and in dry-run mode.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from controller.logic.remediation.placement import Placement

PlanKind = Literal["same_size", "shrink", "grow", "refused"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartPlan:
    """The next placement of a job, or why there is none."""

    #: ``None`` only when ``kind == "refused"``.
    placement: Placement | None
    kind: PlanKind
    #: One line for the action log ("replace node-b by node-c", "job x needs at least …").
    reason: str
    #: Excluded node of the current placement -> the spare that takes its slot.
    replaced: dict[str, str] = field(default_factory=dict)
    #: Nodes of the current placement that leave the job without a replacement (excluded
    #: ones with no spare, and healthy ones dropped so that dp divides the global batch).
    dropped: list[str] = field(default_factory=list)
    #: Spares added beyond the current size by ``grow``.
    added: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for action parameters and ``/api/v1/remediation``."""
        p = self.placement
        return {
            "kind": self.kind,
            "reason": self.reason,
            "replaced": dict(self.replaced),
            "dropped": list(self.dropped),
            "added": list(self.added),
            "placement": None
            if p is None
            else {
                "job": p.job,
                "nodes": list(p.nodes),
                "ranks_per_node": p.ranks_per_node,
                "tp": p.tp,
                "dp": p.dp,
                "world_size": p.world_size,
                "generation": p.generation,
                "resume_step": p.resume_step,
            },
        }


def _dp_ok(n_nodes: int, current: Placement, min_dp: int, dp_must_divide: int | None) -> bool:
    if n_nodes < 1:
        return False
    dp = n_nodes * current.ranks_per_node // current.tp
    return dp >= min_dp and (dp_must_divide is None or dp_must_divide % dp == 0)


def _min_nodes_needed(current: Placement, min_dp: int, dp_must_divide: int | None) -> int | None:
    """The smallest node count that satisfies the dp rules (``None``: no count does).

    Arithmetic, not a search over node counts: ``min_dp`` and ``dp_must_divide`` come from
    a policy (up to 2**31 - 1), and counting up to them blocked the engine's event loop for
    minutes (a prime global batch with an even dp per node never matches). ``tp`` divides
    ``ranks_per_node`` (a :class:`Placement` invariant), so ``dp = nodes * per_node``.
    """
    per_node = current.ranks_per_node // current.tp
    lowest = -(-min_dp // per_node)  # ceil: the fewest nodes giving dp >= min_dp
    if dp_must_divide is None:
        return lowest
    if dp_must_divide % per_node:
        return None  # even one node's replicas do not split the batch
    # dp = n * per_node divides the batch exactly when n divides batch / per_node: the
    # answer is that quotient's smallest divisor >= lowest (divisors found in O(sqrt)).
    quotient = dp_must_divide // per_node
    best: int | None = None
    i = 1
    while i * i <= quotient:
        if quotient % i == 0:
            for d in (i, quotient // i):
                if d >= lowest and (best is None or d < best):
                    best = d
        i += 1
    return best


def _refusal(
    current: Placement,
    healthy: list[str],
    min_dp: int,
    dp_must_divide: int | None,
    cap: int,
) -> RestartPlan:
    """Why no placement satisfies the rules, naming the numbers an operator must change.

    ``cap`` is the most nodes this restart may use (the current size, or ``original_nodes``
    when growing): when the rules need more than that, saying only "N available" would
    read as a contradiction whenever more than N healthy nodes are on offer."""
    rules = f"min_dp={min_dp}, tp={current.tp}, {current.ranks_per_node} ranks per node"
    if dp_must_divide is not None:
        rules += f", dp dividing {dp_must_divide}"
    need = _min_nodes_needed(current, min_dp, dp_must_divide)
    available = ", ".join(healthy) if healthy else "none"
    if need is None:
        reason = (
            f"job {current.job!r} has no node count that satisfies {rules}; "
            f"{len(healthy)} available: {available}"
        )
    elif need > cap:
        reason = (
            f"job {current.job!r} needs at least {need} healthy nodes ({rules}) but a "
            f"restart may use at most {cap} (its size; more only by grow, up to "
            f"original_nodes); {len(healthy)} available: {available}"
        )
    else:
        reason = (
            f"job {current.job!r} needs at least {need} healthy nodes ({rules}); "
            f"{len(healthy)} available: {available}"
        )
    return RestartPlan(placement=None, kind="refused", reason=reason)


def plan_restart(
    current: Placement,
    candidates: Sequence[str],
    excluded: Collection[str],
    *,
    min_dp: int = 1,
    dp_must_divide: int | None = None,
    original_nodes: int | None = None,
    grow: bool = False,
    resume_step: int | None = None,
) -> RestartPlan:
    """Plan the next generation of ``current`` without the ``excluded`` nodes.

    ``candidates`` are the nodes the actuator offers (the engine has already removed
    unhealthy and isolated ones, but excluded nodes found here are skipped anyway); nodes of
    the current placement among them are not spares. The new placement has
    ``generation = current.generation + 1`` and ``resume_step`` as given.
    """
    if min_dp < 1:
        raise ValueError(f"min_dp must be >= 1, got {min_dp}")
    if dp_must_divide is not None and dp_must_divide < 1:
        raise ValueError(f"dp_must_divide must be >= 1, got {dp_must_divide}")
    if original_nodes is not None and original_nodes < 1:
        raise ValueError(f"original_nodes must be >= 1, got {original_nodes}")
    # A bare string is a Collection[str] of its characters: excluded="node-b" would exclude
    # nodes "n", "o", … and keep the culprit. Refuse it rather than plan around it.
    for name, value in (("candidates", candidates), ("excluded", excluded)):
        if isinstance(value, str):
            raise TypeError(f"{name} must be a collection of node names, not the string {value!r}")

    bad = set(excluded)
    slots: list[str | None] = [None if n in bad else n for n in current.nodes]
    kept = [n for n in slots if n is not None]
    spares: list[str] = []
    for c in candidates:
        if c not in bad and c not in current.nodes and c not in spares:
            spares.append(c)

    size_now = len(current.nodes)
    target = size_now
    if grow and original_nodes is not None and original_nodes > size_now:
        target = original_nodes
    holes = size_now - len(kept)
    reachable = min(target, len(kept) + len(spares))
    n = reachable
    while n >= 1 and not _dp_ok(n, current, min_dp, dp_must_divide):
        n -= 1
    if n < 1:
        return _refusal(current, kept + spares, min_dp, dp_must_divide, target)

    replaced: dict[str, str] = {}
    dropped: list[str] = []
    added: list[str] = []
    spare_iter = iter(spares)
    fill = max(0, n - len(kept))  # spares used, into holes first, then appended (grow)
    for i, node in enumerate(slots):
        if node is None and fill > 0:
            spare = next(spare_iter)
            slots[i] = spare
            replaced[current.nodes[i]] = spare
            fill -= 1
        elif node is None:
            dropped.append(current.nodes[i])
    while fill > 0:
        spare = next(spare_iter)
        slots.append(spare)
        added.append(spare)
        fill -= 1
    # Too many healthy nodes for the dp rules: drop from the tail, they would move anyway.
    surplus = sum(s is not None for s in slots) - n
    for i in range(len(slots) - 1, -1, -1):
        victim = slots[i]
        if surplus == 0:
            break
        if victim is not None:
            dropped.append(victim)
            slots[i] = None
            surplus -= 1
    nodes = _compact(slots)

    placement = Placement(
        job=current.job,
        nodes=tuple(nodes),
        ranks_per_node=current.ranks_per_node,
        tp=current.tp,
        generation=current.generation + 1,
        resume_step=resume_step,
    )
    kind: PlanKind = "same_size" if n == size_now else ("grow" if n > size_now else "shrink")
    return RestartPlan(
        placement=placement,
        kind=kind,
        reason=_describe(current, placement, kind, replaced, dropped, added, holes),
        replaced=replaced,
        dropped=dropped,
        added=added,
    )


def _compact(slots: list[str | None]) -> list[str]:
    """Close holes by moving the last nodes into them; nodes before the new end stay put."""
    size = sum(s is not None for s in slots)
    head = slots[:size]
    movers = iter([s for s in slots[size:] if s is not None])
    return [s if s is not None else next(movers) for s in head]


def _describe(
    current: Placement,
    new: Placement,
    kind: PlanKind,
    replaced: dict[str, str],
    dropped: list[str],
    added: list[str],
    holes: int,
) -> str:
    parts: list[str] = []
    if replaced:
        parts.append("replace " + ", ".join(f"{a} by {b}" for a, b in replaced.items()))
    if dropped:
        parts.append("drop " + ", ".join(dropped))
    if added:
        parts.append("add " + ", ".join(added))
    if not parts:
        parts.append("same nodes" if holes == 0 else "no change")
    return (
        f"{kind}: " + "; ".join(parts) + f" (dp {current.dp} -> {new.dp}, "
        f"world {current.world_size} -> {new.world_size}, generation {new.generation})"
    )
