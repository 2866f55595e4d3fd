"""Incidents: open, bump (dedupe) and resolve, each written at once in its own transaction.

Incidents are rare, so they skip the group-commit queue: a detector that opens one awaits
its durable id. Incidents with the same ``dedupe_key`` that are still open are one record
whose ``count`` grows, so a storm of identical events (an XID-45 storm) is one row, not
thousands. Rows of entities whose health changed with the incident (nodes, GPUs) are
written in the same transaction, so the database never shows a fault without its incident.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Table

from controller.db.keys import RowKey
from controller.db.repositories import incidents as repo
from controller.db.repositories import write_batch
from controller.services.events import EventBus, IncidentOpened
from controller.state import ClusterState, IncidentState
from controller.store import Store

log = logging.getLogger(__name__)

#: Keep at most this many entries in an incident's ``evidence["events"]`` list.
MAX_EVIDENCE_EVENTS = 50


@dataclass(kw_only=True, slots=True)
class IncidentSpec:
    kind: str
    severity: str
    summary: str
    dedupe_key: str
    node: str | None = None
    gpu_index: int | None = None
    job: str | None = None
    ranks: list[int] | None = None
    evidence: dict[str, Any] | None = None


class IncidentService:
    def __init__(self, state: ClusterState, store: Store, events: EventBus | None = None) -> None:
        self._state = state
        self._store = store
        #: A new incident (not a bump) is announced as :class:`IncidentOpened`.
        self._events = events if events is not None else EventBus()
        #: Called when an incident is resolved, before it is written; each returns the keys
        #: of rows it changed (e.g. a GPU back to healthy), written in the same transaction.
        self.resolve_hooks: list[Callable[[IncidentState], set[RowKey]]] = []

    def find_open(self, dedupe_key: str) -> IncidentState | None:
        return self._state.incidents_by_key.get(dedupe_key)

    async def open_or_bump(
        self,
        spec: IncidentSpec,
        *,
        count: int = 1,
        events: list[dict[str, Any]] | None = None,
        also_write: set[RowKey] | None = None,
        refresh: bool = False,
    ) -> tuple[IncidentState, bool]:
        """Open a new incident, or add ``count`` to the open one with the same key.

        With ``refresh`` the open incident also takes the spec's summary and evidence (a
        newer reading of the same condition, e.g. a straggler growing slower), so what the
        operator and the remediation policy read is current. Returns the incident and
        whether it was newly opened.
        """
        now = time.time()
        existing = self._state.incidents_by_key.get(spec.dedupe_key)
        rows = self._rows(also_write)
        if existing is not None:
            evidence = dict(existing.evidence)
            if refresh:
                evidence.update(spec.evidence or {})
            if events:
                kept = [*evidence.get("events", []), *events]
                evidence["events"] = kept[-MAX_EVIDENCE_EVENTS:]
            summary = spec.summary if refresh else existing.summary
            values = {
                "count": existing.count + count,
                "updated_unix_s": now,
                "evidence": evidence,
                **({"summary": summary} if refresh else {}),
            }
            incident_id = existing.id

            def bump(conn: Connection) -> None:
                write_batch(conn, rows)
                repo.update_incident(conn, incident_id, values)

            # Write, then publish: a bump the database refused leaves the incident as shown.
            await self._store.write(bump)
            existing.count += count
            existing.updated_unix_s = now
            existing.summary = summary
            existing.evidence = evidence
            return existing, False

        evidence = dict(spec.evidence or {})
        if events:
            evidence["events"] = events[-MAX_EVIDENCE_EVENTS:]
        count = max(count, 1)  # a refresh (count 0) of a condition no longer open opens it
        incident = IncidentState(
            id=0,  # the database's to give
            kind=spec.kind,
            severity=spec.severity,
            state="open",
            summary=spec.summary,
            dedupe_key=spec.dedupe_key,
            opened_unix_s=now,
            updated_unix_s=now,
            node=spec.node,
            gpu_index=spec.gpu_index,
            job=spec.job,
            ranks=list(spec.ranks or []),
            evidence=evidence,
            count=count,
        )
        row = repo.incident_row(incident)

        def insert(conn: Connection) -> int:
            write_batch(conn, rows)
            return repo.insert_incident(conn, row)

        incident.id = await self._store.write(insert)
        incident_id = incident.id
        self._state.add_incident(incident)
        self._events.publish(IncidentOpened(incident))
        log.warning(
            "incident opened",
            extra={
                "fields": {
                    "incident": incident_id,
                    "kind": spec.kind,
                    "severity": spec.severity,
                    "node": spec.node,
                    "gpu": spec.gpu_index,
                    "job": spec.job,
                    "summary": spec.summary,
                }
            },
        )
        return incident, True

    async def resolve(
        self, incident: IncidentState, *, note: str, also_write: set[RowKey] | None = None
    ) -> None:
        now = time.time()
        evidence = {**incident.evidence, "resolution": note}
        # Hooks change the incident's node in memory (a GPU trusted again); put it back if
        # the database does not take the resolution.
        saved = self._state.save_node(incident.node)
        keys = set(also_write or ())
        for hook in self.resolve_hooks:
            keys |= hook(incident)
        rows = self._rows(keys)
        values = {
            "state": "resolved",
            "resolved_unix_s": now,
            "updated_unix_s": now,
            "evidence": evidence,
        }

        def resolve(conn: Connection) -> None:
            write_batch(conn, rows)
            repo.update_incident(conn, incident.id, values)

        # Write, then publish: a resolution the database refused leaves the incident open.
        try:
            await self._store.write(resolve)
        except Exception:
            self._state.restore_node(saved)
            raise
        self._state.drop_incident(incident)
        incident.state = "resolved"
        incident.resolved_unix_s = now
        incident.updated_unix_s = now
        incident.evidence = evidence
        log.info(
            "incident resolved",
            extra={"fields": {"incident": incident.id, "kind": incident.kind, "note": note}},
        )

    def _rows(self, keys: set[RowKey] | None) -> dict[Table, list[dict[str, Any]]]:
        rows: dict[Table, list[dict[str, Any]]] = {}
        for key in keys or ():
            row = self._state.row_for(key)
            if row is not None:
                rows.setdefault(key.table, []).append(row)
        return rows
