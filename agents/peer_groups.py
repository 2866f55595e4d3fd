"""The peer-group memberships this node's ranks declared, kept to answer the controller.

Ranks declare a peer group (``wire.PeerGroup``) once per registration with this agent and
name it by id in their step summaries. A controller that restarted since has lost the
membership: its reply lists the ids it does not know (``ReportReply.peer_groups_unknown``)
and the agent puts the memberships it has seen into the next report, so the ranks never need
to hear of the controller's restart.
"""

from __future__ import annotations

import threading

from trainguard.wire import JobRecords, PeerGroup, PeerGroupRef

#: Memberships kept (a rank has one peer group at a time; a node runs a few dozen ranks).
MAX_GROUPS = 4_096


class PeerGroupCache:
    """The newest memberships by (job, id), bounded; thread-safe (socket and reporter)."""

    def __init__(self, limit: int = MAX_GROUPS) -> None:
        self._limit = limit
        self._groups: dict[tuple[str, str], PeerGroup] = {}
        self._lock = threading.Lock()

    def remember(self, records: JobRecords) -> None:
        if not records.peer_groups:
            return
        with self._lock:
            for group in records.peer_groups:
                key = (group.job, group.id)
                self._groups.pop(key, None)
                self._groups[key] = group
            while len(self._groups) > self._limit:
                self._groups.pop(next(iter(self._groups)))

    def wanted(self, refs: list[PeerGroupRef]) -> JobRecords:
        """The memberships the controller asked for that this agent knows (others: no rank
        of this node declared them, or not since this agent started)."""
        with self._lock:
            found = [self._groups.get((ref.job, ref.id)) for ref in refs]
        return JobRecords(peer_groups=[g for g in found if g is not None])

    def __len__(self) -> int:
        return len(self._groups)


__all__ = ["MAX_GROUPS", "PeerGroupCache"]
