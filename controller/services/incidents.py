"""Incidents: open, bump (dedupe) and resolve, each written at once in its own transaction.

Incidents are rare, so they skip the group-commit queue: a detector that opens one awaits
its durable id. Incidents with the same ``dedupe_key`` that are still open are one record
whose ``count`` grows, so a storm of identical events (an XID-45 storm) is one row, not
thousands. Rows of entities whose health changed with the incident (nodes, GPUs) are
written in the same transaction, so the database never shows a fault without its incident.

Write, then publish (issue 14): a detector hands its change as rows built from a *staged*
copy (``rows``) and a callback that applies it to memory (``on_written``); the callback runs
only once the transaction committed. A write that fails raises, leaves memory and the API as
they were, and is counted in :attr:`IncidentService.write_failures`; the detector's next
report or tick tries again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from sqlalchemy import Connection, Table

from controller.db.keys import RowKey
from controller.db.repositories import incidents as repo
from controller.db.repositories import write_batch
from controller.logic.detection.evidence_kinds import parse_evidence
from controller.logic.detection.incident_evidence import EvidenceEvent, IncidentEvidence
from controller.logic.incident_kinds import IncidentKind
from controller.services.events import EventBus, IncidentOpened
from controller.services.metrics import SafeCollector
from controller.state import ClusterState, IncidentState
from controller.store import Store

log = logging.getLogger(__name__)

#: Keep at most this many entries in an incident's ``evidence["events"]`` list.
MAX_EVIDENCE_EVENTS = 50


@dataclass(kw_only=True, slots=True)
class IncidentSpec:
    """What a detector found. ``evidence`` is the kind's model
    (``controller.logic.detection.evidence_kinds``); ``UntypedEvidence`` for a kind that
    has none."""

    kind: IncidentKind
    severity: str
    summary: str
    dedupe_key: str
    node: str | None = None
    gpu_index: int | None = None
    job: str | None = None
    ranks: list[int] | None = None
    evidence: IncidentEvidence | None = None


def _stored(evidence: IncidentEvidence | None) -> dict[str, Any]:
    """The JSON an incident row stores for ``evidence`` (a new dict, never the caller's),
    as an object that a bump or a resolution merges into: a hand-edited row that is not
    even an object is kept under ``stored`` (merging into it failed, so such an incident
    could never be bumped or resolved)."""
    data: Any = {} if evidence is None else evidence.as_json()
    return data if isinstance(data, dict) else {"stored": data}


class IncidentService:
    def __init__(self, state: ClusterState, store: Store, events: EventBus | None = None) -> None:
        self._state = state
        self._store = store
        #: A new incident (not a bump) is announced as :class:`IncidentOpened`.
        self._events = events if events is not None else EventBus()
        #: Called when an incident is resolved, before it is written; each returns the keys
        #: of rows it changed (e.g. a GPU back to healthy), written in the same transaction.
        self.resolve_hooks: list[Callable[[IncidentState], set[RowKey]]] = []
        #: Incident writes (open, bump, resolve) the database did not take, by operation.
        self.write_failures: dict[str, int] = {"open": 0, "bump": 0, "resolve": 0}

    def find_open(self, dedupe_key: str) -> IncidentState | None:
        return self._state.incidents_by_key.get(dedupe_key)

    async def open_or_bump(
        self,
        spec: IncidentSpec,
        *,
        count: int = 1,
        events: list[EvidenceEvent] | None = None,
        also_write: set[RowKey] | None = None,
        refresh: bool = False,
        evidence_update: IncidentEvidence | None = None,
        rows: dict[Table, list[dict[str, Any]]] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> tuple[IncidentState, bool]:
        """Open a new incident, or add ``count`` to the open one with the same key.

        With ``refresh`` the open incident also takes the spec's summary and evidence (a
        newer reading of the same condition, e.g. a straggler growing slower), so what the
        operator and the remediation policy read is current; ``evidence_update`` merges
        keys into the evidence without touching the summary. ``rows`` (staged rows of
        other tables) are written in the same transaction and ``on_written`` publishes
        them to memory once it committed. Returns the incident and whether it was newly
        opened; raises (memory unchanged) when the database does not take it.
        """
        now = time.time()
        existing = self._state.incidents_by_key.get(spec.dedupe_key)
        rows = _merge(self._rows(also_write), rows)
        new_events = [e.model_dump(mode="json") for e in events or ()]
        if existing is not None:
            # Merged as the stored JSON (what the row gets), then typed once for memory.
            evidence = _stored(existing.evidence)
            if refresh:
                evidence.update(_stored(spec.evidence))
            evidence.update(_stored(evidence_update))
            if new_events:
                kept = [*evidence.get("events", []), *new_events]
                evidence["events"] = kept[-MAX_EVIDENCE_EVENTS:]
            summary = spec.summary if refresh else existing.summary
            values = {
                "count": existing.count + count,
                "updated_unix_s": now,
                "evidence": evidence,
                **({"summary": summary} if refresh else {}),
            }
            typed = parse_evidence(existing.kind, evidence)
            incident_id = existing.id

            def bump(conn: Connection) -> None:
                write_batch(conn, rows)
                repo.update_incident(conn, incident_id, values)

            # Write, then publish: a bump the database refused leaves the incident as shown.
            await self._write("bump", bump, spec)
            if on_written is not None:
                on_written()
            existing.count += count
            existing.updated_unix_s = now
            existing.summary = summary
            existing.evidence = typed
            return existing, False

        evidence = {**_stored(spec.evidence), **_stored(evidence_update)}
        if new_events:
            evidence["events"] = new_events[-MAX_EVIDENCE_EVENTS:]
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
            evidence=parse_evidence(spec.kind, evidence),
            count=count,
        )
        row = repo.incident_row(incident, evidence)

        def insert(conn: Connection) -> int:
            write_batch(conn, rows)
            return repo.insert_incident(conn, row)

        incident.id = await self._write("open", insert, spec)
        if on_written is not None:
            on_written()
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
        self,
        incident: IncidentState,
        *,
        note: str,
        also_write: set[RowKey] | None = None,
        rows: dict[Table, list[dict[str, Any]]] | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        """Resolve ``incident``; ``rows``/``on_written`` as in :meth:`open_or_bump`."""
        now = time.time()
        evidence = {**_stored(incident.evidence), "resolution": note}
        typed = parse_evidence(incident.kind, evidence)
        # Hooks change the incident's node in memory (a GPU trusted again); put it back if
        # the database does not take the resolution.
        saved = self._state.save_node(incident.node)
        keys = set(also_write or ())
        for hook in self.resolve_hooks:
            keys |= hook(incident)
        all_rows = _merge(self._rows(keys), rows)
        values = {
            "state": "resolved",
            "resolved_unix_s": now,
            "updated_unix_s": now,
            "evidence": evidence,
        }

        def resolve(conn: Connection) -> None:
            write_batch(conn, all_rows)
            repo.update_incident(conn, incident.id, values)

        # Write, then publish: a resolution the database refused leaves the incident open.
        try:
            await self._write("resolve", resolve, incident)
        except Exception:
            self._state.restore_node(saved)
            raise
        if on_written is not None:
            on_written()
        self._state.drop_incident(incident)
        incident.state = "resolved"
        incident.resolved_unix_s = now
        incident.updated_unix_s = now
        incident.evidence = typed
        log.info(
            "incident resolved",
            extra={"fields": {"incident": incident.id, "kind": incident.kind, "note": note}},
        )

    async def _write(
        self, op: str, fn: Callable[[Connection], Any], what: IncidentSpec | IncidentState
    ) -> Any:
        """``fn`` in one transaction; a failure is logged, counted and raised."""
        try:
            return await self._store.write(fn)
        except Exception as exc:
            self.write_failures[op] += 1
            log.warning(
                "incident write failed; memory left unchanged",
                extra={
                    "fields": {
                        "op": op,
                        "kind": what.kind,
                        "dedupe_key": what.dedupe_key,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                    }
                },
            )
            raise

    def _rows(self, keys: set[RowKey] | None) -> dict[Table, list[dict[str, Any]]]:
        rows: dict[Table, list[dict[str, Any]]] = {}
        for key in keys or ():
            row = self._state.row_for(key)
            if row is not None:
                rows.setdefault(key.table, []).append(row)
        return rows


class IncidentWritesCollector(SafeCollector):
    """``trainguard_incident_write_failures_total{op}``: incident writes (``open``, ``bump``,
    ``resolve``) the database did not take; each left memory unchanged and is retried by the
    detector's next report or tick. Alert on its rate: detectors cannot record faults."""

    def __init__(self, incidents: IncidentService) -> None:
        self._incidents = incidents

    def _collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "trainguard_incident_write_failures",
            "Incident writes the database did not take (memory left unchanged)",
            labels=["op"],
        )
        for op, count in sorted(self._incidents.write_failures.items()):
            family.add_metric([op], count)
        yield family


def _merge(
    a: dict[Table, list[dict[str, Any]]], b: dict[Table, list[dict[str, Any]]] | None
) -> dict[Table, list[dict[str, Any]]]:
    """Rows of ``a`` and ``b``; for the same table, ``b``'s (staged) rows come last."""
    if not b:
        return a
    merged = {table: list(found) for table, found in a.items()}
    for table, found in b.items():
        merged.setdefault(table, []).extend(found)
    return merged
