"""Silence is not death: partitions and mass failures before anyone gets quarantined.

A node agent that stopped reporting may be dead, or merely cut off from the controller
(a network partition, the controller's own DNS or ingress failing). Quarantining on silence
alone turns a controller-side fault into a fleet-wide outage. So:

* a silent agent whose Node is still ``Ready`` and whose pods still run is
  **unreachable**, not **lost**: nothing is done until a second signal agrees (the Node's
  own ``Ready`` condition going ``False``/``Unknown``, or the job's ranks on it failing);
* when many agents fall silent at once (``mass_silence_share`` of the fleet, at least
  ``mass_silence_min_nodes``) the fault is most likely on the controller's side: it acts
  on nobody and says so;
* at most ``max_quarantine_share`` of the fleet (at least one node) may be quarantined
  within ``window_s`` (:func:`quarantine_limit`); the next one is refused and the caller
  raises an incident for a human (``services.remediation.partition.quarantine_refusal``).

Pure logic: the inputs come from the agents' reports and :class:`~.watch.NodeCache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

State = Literal["reporting", "unreachable", "lost"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionSettings:
    silent_after_s: float = 30.0
    mass_silence_share: float = 0.3
    mass_silence_min_nodes: int = 3
    max_quarantine_share: float = 0.1
    window_s: float = 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSignals:
    name: str
    #: Seconds since the agent's last report.
    silent_for_s: float
    #: The Node's ``Ready`` condition: True, False, or None (Unknown / not seen).
    node_ready: bool | None = None
    #: Whether the job pods on the node are still Running (None: not known).
    pods_running: bool | None = None
    #: Whether the job's ranks on this node reported failures (exits, broken collectives).
    ranks_failing: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    states: dict[str, State]
    #: Many agents silent at once: the controller acts on nobody.
    mass_silence: bool
    #: Nodes the evidence says are gone, for the engine to consider (empty on mass silence).
    act_on: list[str]
    summary: str


def classify(nodes: list[NodeSignals], settings: PartitionSettings) -> Verdict:
    states: dict[str, State] = {}
    for n in nodes:
        if n.silent_for_s < settings.silent_after_s:
            states[n.name] = "reporting"
        elif n.ranks_failing or n.node_ready is False or n.pods_running is False:
            states[n.name] = "lost"  # a second signal agrees with the silence
        else:
            states[n.name] = "unreachable"
    silent = [name for name, s in states.items() if s != "reporting"]
    threshold = max(settings.mass_silence_min_nodes, settings.mass_silence_share * len(nodes))
    if silent and len(silent) >= threshold:
        return Verdict(
            {name: ("unreachable" if name in silent else "reporting") for name in states},
            True,
            [],
            f"{len(silent)} of {len(nodes)} agents silent at once: assuming the fault is on "
            "the controller's side (network, DNS, ingress); acting on no node",
        )
    lost = sorted(name for name, s in states.items() if s == "lost")
    unreachable = sorted(name for name, s in states.items() if s == "unreachable")
    parts = []
    if lost:
        parts.append(f"lost (silent and confirmed): {', '.join(lost)}")
    if unreachable:
        parts.append(
            f"unreachable (silent, Node Ready, pods running; waiting for a second signal): "
            f"{', '.join(unreachable)}"
        )
    return Verdict(states, False, lost, "; ".join(parts) or "every agent reporting")


def quarantine_limit(settings: PartitionSettings, fleet_size: int) -> int:
    """Nodes that may be quarantined per window: ``max_quarantine_share`` of the fleet, at
    least one (a small fleet may still isolate its one bad node)."""
    return max(1, math.floor(settings.max_quarantine_share * max(fleet_size, 1) + 1e-9))


__all__ = ["NodeSignals", "PartitionSettings", "Verdict", "classify", "quarantine_limit"]
