"""The planner inside the controller: one fabric, versioned plans per job, link health.

The controller loads the fabric once (``topology_file``) and keeps, per plan, the newest
version live (the planner's object plus its UDP source ports) and every version's summary.
Three things change plans:

* ``POST /plans``: a job's placement comes from the ranks' own reports (``state.jobs``), its
  parallel layout from the request; the plan reorders nodes, routes and enforces.
* an operator marking a link down, slow or up: only plans whose paths cross the link, or
  whose flows' hash decisions change with it (an equal-cost group on their way grew or
  shrank), get a new version; in them only the flows on it move and the others keep their
  paths, those with changed decisions getting new source ports (``Planner.replan``);
* a ``slow_link`` incident from the job detectors: its slow and healthy rank pairs map, via
  the job's placement and the plan's paths, to fabric links (``localize.suspect_links``),
  which are marked slow by the measured bandwidth ratio before re-planning as above.

Every change is written (all new versions and the link state in one transaction) before it
is visible, so a restart restores exactly what the API last showed. Planning runs on a
worker thread under one lock: plans and link health change one request at a time.
Errors are the controller's own (:mod:`controller.errors`): 404 unknown job/plan/link, 409
no fabric / incomplete placement / partitioned fabric, 422 a layout that does not fit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from controller.db.models import TrafficLinkState, TrafficPlanVersion
from controller.db.repositories import traffic as repo
from controller.errors import BadConfig, Conflict, NotFound
from controller.logic.traffic import records
from controller.logic.traffic.enforce import enforce, enforce_changed
from controller.logic.traffic.errors import PlanError, TopologyError, TrafficError
from controller.logic.traffic.hashing import HashConfig
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.planner import Plan, Planner
from controller.logic.traffic.topofile import load_topology
from controller.logic.traffic.topology import Topology
from controller.services.traffic import placement
from controller.services.traffic.labels import LabelKey, LabelSource, label_fabric
from controller.services.traffic.placement import Layout
from controller.settings import ControllerSettings
from controller.state import ClusterState
from controller.store import Store

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]


def load_fabric(path: Path | None) -> Topology | None:
    """The ``topology_file`` setting's fabric; a bad file stops the start with one line."""
    if path is None:
        return None
    try:
        return load_topology(path)
    except TrafficError as exc:
        raise BadConfig(f"topology_file {exc}") from None


def build_traffic(
    settings: ControllerSettings, state: ClusterState, store: Store
) -> TrafficService:
    """The service as the settings ask: a fabric file, node labels, or neither (planning off)."""
    fabric = label_fabric(settings.topology_labels)
    if fabric is not None and settings.topology_file is not None:
        raise BadConfig("give topology_file or topology_labels, not both")
    labels = LabelSource(state, fabric) if fabric is not None else None
    return TrafficService(state, store, load_fabric(settings.topology_file), labels=labels)


@dataclass(slots=True)
class LivePlan:
    plan: Plan
    sports: IntArray
    versions: list[dict[str, Any]] = field(default_factory=list)


#: A re-planned plan: its holder, the new version, its source ports, the changes it adds.
_Replanned = tuple[LivePlan, Plan, IntArray, list[dict[str, Any]]]


class TrafficService:
    def __init__(
        self,
        state: ClusterState,
        store: Store,
        topology: Topology | None,
        *,
        hash_config: HashConfig | None = None,
        labels: LabelSource | None = None,
    ) -> None:
        self._state = state
        self._store = store
        self.topology = topology
        self.planner = Planner(topology) if topology is not None else None
        #: With ``topology_labels`` the fabric comes from the nodes' labels (see ``labels``).
        self.labels = labels
        self._label_key: LabelKey | None = None
        self._label_error = ""
        #: Link health as stored (factor by link spec), re-applied to every rebuilt fabric.
        self.link_factors: dict[str, float] = {}
        #: Stored versions by plan id, waiting for a fabric to be restored on.
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self.hash = hash_config or HashConfig()
        self.plans: dict[str, LivePlan] = {}
        self.link_reasons: dict[str, str] = {}
        self._lock = asyncio.Lock()
        # A job that leaves memory (job retention) takes its live plan with it.
        state.job_forgotten.append(self.forget_job)

    def forget_job(self, job: str) -> None:
        """Drop a forgotten job's live plan and stored versions waiting for a fabric
        (``ClusterState.forget_job``); the database keeps every version. Without this each
        job ever planned stayed live for good, and every link change re-planned it too.

        The dicts are replaced, not changed in place: ``_replan_all`` may be iterating the
        old one on a worker thread. A plan is live only for a job in memory
        (:meth:`_live_for`), so one being made while its job is forgotten is not kept."""
        if any(live.plan.job.name == job for live in self.plans.values()):
            self.plans = {k: v for k, v in self.plans.items() if v.plan.job.name != job}
        if any(docs[0]["job"] == job for docs in self._pending.values()):
            self._pending = {k: v for k, v in self._pending.items() if v[0]["job"] != job}

    def _live_for(self, job: str) -> bool:
        """Whether ``job`` may have a live plan: it is in memory (not forgotten)."""
        return job in self._state.jobs

    # ------------------------------------------------------------------ start / stop

    async def load(self) -> None:
        """Read link states and plans, then restore them on the fabric (if there is one yet)."""
        links, docs = await self._store.read(_read_all)
        for link, factor, reason in links:
            self.link_factors[link] = factor
            self.link_reasons[link] = reason
        for doc in docs:
            self._pending.setdefault(doc["plan_id"], []).append(doc)
        # Plans of the jobs in memory only: the others' jobs were forgotten (retention).
        self._pending = {k: v for k, v in self._pending.items() if self._live_for(v[0]["job"])}
        if self.labels is not None:
            await self.refresh_fabric()
        elif self.topology is not None:
            async with self._lock:
                await self._adopt(self.topology, trigger="")

    async def refresh_fabric(self) -> None:
        """Label mode: rebuild the fabric when the labelled nodes changed (cheap otherwise)."""
        if self.labels is None or self.labels.key() == self._label_key:
            return
        async with self._lock:
            key = self.labels.key()
            if key == self._label_key:
                return
            self._label_key = key
            try:
                topo = self.labels.build()
            except TrafficError as exc:
                self._label_error = str(exc)
                log.warning("no fabric from node labels", extra={"fields": {"error": str(exc)}})
                return
            self._label_error = ""
            await self._adopt(topo, trigger="fabric rebuilt from node labels")

    async def _adopt(self, topo: Topology, *, trigger: str) -> None:
        """Make ``topo`` the fabric: stored link health on it, stored plans restored on it,
        live plans (from an older fabric) planned again on it as new versions."""
        for link, factor in self.link_factors.items():
            try:
                topo.set_health(topo.resolve_link(link), factor)
            except TrafficError:
                log.warning(
                    "stored link state names an unknown link", extra={"fields": {"link": link}}
                )
        self.topology, self.planner = topo, Planner(topo)
        stale = {pid: live for pid, live in self.plans.items()}
        self.plans = {}
        for plan_id, versions in self._pending.items():
            versions.sort(key=lambda d: d["version"])
            restored = await asyncio.to_thread(records.restore, self.planner, versions[-1])
            history = [records.version_summary(d) | _doc_extras(d) for d in versions]
            if restored is not None:
                if self._live_for(restored[0].job.name):  # not forgotten while restored
                    self.plans[plan_id] = LivePlan(restored[0], restored[1], history)
            else:
                spec = JobSpec(**versions[-1]["spec"])
                why = trigger or "restart: stored paths no longer fit the fabric"
                await self._fresh_version(plan_id, spec, versions[-1]["version"], history, why)
        self._pending = {}
        for plan_id, live in stale.items():
            spec = dataclasses.replace(live.plan.job)
            await self._fresh_version(plan_id, spec, live.plan.version, live.versions, trigger)

    # ------------------------------------------------------------------ writes

    async def create_plan(self, job_name: str, layout: Layout, *, replace: bool, by: str) -> str:
        await self.refresh_fabric()
        topo = self.need_topology()
        job = self._state.jobs.get(job_name)
        if job is None:
            raise NotFound(f"job {job_name!r} not found")
        spec = placement.job_spec(job, layout, topo)
        async with self._lock:
            existing = self.plan_of(job_name)
            if existing is not None and not replace:
                raise Conflict(
                    f"job {job_name!r} already has plan {existing.plan.plan_id}; "
                    "pass replace=true to plan it again as a new version"
                )
            plan_id = existing.plan.plan_id if existing else None
            plan, sports = await asyncio.to_thread(self._plan_enforced, spec, plan_id)
            if existing is not None:
                plan.version = existing.plan.version + 1
                plan.parent_version = existing.plan.version
            trigger = f"{'replace' if existing else 'create'} by {by}"
            doc = records.to_document(plan, sports, trigger=trigger, replan_ms=None)
            await self._store.write(lambda conn: _insert_versions(conn, [doc]))
            live = existing or LivePlan(plan, sports)
            live.plan, live.sports = plan, sports
            live.versions.append(records.version_summary(doc) | _doc_extras(doc))
            if self._live_for(job_name):  # not forgotten while it was planned and stored
                self.plans[plan.plan_id] = live
            return plan.plan_id

    async def set_links(
        self,
        changes: list[tuple[str, float]],
        *,
        reason: str,
        audit: Callable[[dict[str, Any]], Callable[[Connection], object]] | None = None,
    ) -> dict[str, Any]:
        """Mark links (factor 0 down, 1 up, between slow); re-plan the plans that use them.

        ``audit`` makes, from the result, a step (an action row) written in the same
        transaction as the new versions and link states: a re-plan is never shown, nor
        stored, without its record."""
        await self.refresh_fabric()
        topo = self.need_topology()
        resolved: list[tuple[str, list[int]]] = []
        for link, _factor in changes:
            try:
                resolved.append((link, topo.resolve_link(link)))
            except TopologyError as exc:
                raise NotFound(str(exc)) from exc
        async with self._lock:
            before = topo.health.copy()
            t0 = time.perf_counter()
            try:
                new = await asyncio.to_thread(
                    self._replan_all, changes, [i for _, ids in resolved for i in ids]
                )
                replan_ms = (time.perf_counter() - t0) * 1e3
                result = _links_result(changes, new, replan_ms)
                also = None if audit is None else audit(result)
                await self._commit_versions(new, changes, reason, also)
            except BaseException as exc:
                # Nothing was stored: the fabric goes back to what the plans were made for.
                for factor in np.unique(before):
                    topo.set_health([int(i) for i in np.flatnonzero(before == factor)], factor)
                if isinstance(exc, PlanError):
                    raise Conflict(f"cannot apply the link change: {exc}") from exc
                raise
            for link, factor in changes:
                self.link_reasons[link] = reason
                self.link_factors[link] = factor
        log.info(
            "traffic re-planned",
            extra={
                "fields": {
                    "links": [c[0] for c in changes],
                    "plans": len(new),
                    "replan_ms": round(replan_ms, 2),
                }
            },
        )
        return result

    async def _commit_versions(
        self,
        new: list[_Replanned],
        changes: list[tuple[str, float]],
        reason: str,
        also: Callable[[Connection], object] | None = None,
    ) -> None:
        """Store every new version, the link states (and ``also``'s row) in one transaction,
        then show them."""
        now = time.time()
        docs = [
            records.to_document(
                plan, sports, trigger=reason, replan_ms=plan.plan_time_s * 1e3, new_changes=added
            )
            for _live, plan, sports, added in new
        ]
        link_rows = [
            {"link": link, "capacity_factor": factor, "reason": reason, "updated_unix_s": now}
            for link, factor in changes
        ]

        def write(conn: Connection) -> None:
            _insert_versions(conn, docs)
            repo.upsert_links(conn, link_rows)
            if also is not None:
                also(conn)

        await self._store.write(write)
        for (live, plan, sports, _), doc in zip(new, docs, strict=True):
            live.plan, live.sports = plan, sports
            live.versions.append(records.version_summary(doc) | _doc_extras(doc))

    # ------------------------------------------------------------------ incidents

    def plan_of(self, job_name: str) -> LivePlan | None:
        return next((p for p in self.plans.values() if p.plan.job.name == job_name), None)

    # ------------------------------------------------------------------ internals

    def need_topology(self) -> Topology:
        if self.topology is None:
            if self.labels is not None:
                raise Conflict(
                    "no fabric from node labels yet: "
                    + (self._label_error or "no node has reported its labels")
                )
            raise Conflict(
                "no fabric topology loaded: set topology_file in the controller settings"
            )
        return self.topology

    def _plan_enforced(self, spec: JobSpec, plan_id: str | None) -> tuple[Plan, IntArray]:
        assert self.planner is not None
        try:
            plan = self.planner.plan(spec, plan_id=plan_id)
            return enforce(plan, self.hash)
        except TrafficError as exc:  # no live path, or no port the hash model can use
            raise Conflict(f"cannot plan job {spec.name!r}: {exc}") from exc

    def _replan_all(
        self, changes: list[tuple[str, float]], link_ids: list[int]
    ) -> list[_Replanned]:
        assert self.planner is not None and self.topology is not None
        for link, factor in changes:
            self.topology.set_health(self.topology.resolve_link(link), factor)
        wanted = np.asarray(link_ids, dtype=np.int64)
        out = []
        for live in self.plans.values():
            old = live.plan.paths()
            t0 = time.perf_counter()
            plan = self.planner.replan(live.plan, changes)
            if not np.isin(old, wanted).any() and plan.moved_flows == plan.reported_flows == 0:
                continue  # no flow on the link, none moved, no decision changed: same version
            moved = _changed_rows(old, plan.paths(), self.topology.dummy_link)
            kept = enforce_changed(plan, self.hash, live.sports, moved)
            if kept is None:  # a new path no free port reaches: enforce picks reachable ones
                kept = enforce(plan, self.hash, hash_aware=False, repair_budget_s=0.0)
                moved = _changed_rows(old, kept[0].paths(), self.topology.dummy_link)
            plan, sports = kept
            plan.moved_flows = len(moved)
            plan.plan_time_s = time.perf_counter() - t0
            out.append((live, plan, sports, plan.changes[len(live.plan.changes) :]))
        return out

    async def _fresh_version(
        self,
        plan_id: str,
        spec: JobSpec,
        version: int,
        history: list[dict[str, Any]],
        trigger: str,
    ) -> None:
        """Plan a job afresh on the current fabric as the next version; a job that no longer
        fits (a node left the fabric) is dropped from the live plans, its history kept, as
        is the plan of a job forgotten meanwhile."""
        if not self._live_for(spec.name):
            return
        try:
            plan, sports = await asyncio.to_thread(self._plan_enforced, spec, plan_id)
        except (TrafficError, Conflict) as exc:  # the controller keeps running
            log.error(
                "cannot re-plan a stored plan",
                extra={"fields": {"plan": plan_id, "error": str(exc)}},
            )
            return
        plan.version, plan.parent_version = int(version) + 1, int(version)
        new = records.to_document(plan, sports, trigger=trigger, replan_ms=None)
        await self._store.write(lambda conn: _insert_versions(conn, [new]))
        live = LivePlan(plan, sports, list(history))
        live.versions.append(records.version_summary(new) | _doc_extras(new))
        if self._live_for(spec.name):
            self.plans[plan_id] = live


#: Kept per version in memory for the API, never shown in the version history.
DOC_ONLY = ("launcher_order", "nccl_env")


def _changed_rows(old: IntArray, new: IntArray, dummy: int) -> IntArray:
    """Flows whose path differs (rows may be padded to different widths)."""
    if old.shape == new.shape:
        return np.flatnonzero((old != new).any(axis=1))
    strip = [
        (tuple(int(x) for x in a if x != dummy), tuple(int(x) for x in b if x != dummy))
        for a, b in zip(old, new, strict=True)
    ]
    return np.asarray([f for f, (a, b) in enumerate(strip) if a != b], dtype=np.int64)


def _doc_extras(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: doc[k] for k in DOC_ONLY}


def _insert_versions(conn: Connection, docs: list[dict[str, Any]]) -> None:
    repo.insert_plan_versions(
        conn,
        [
            {
                "plan_id": d["plan_id"],
                "version": d["version"],
                "job_name": d["job"],
                "created_unix_s": d["created_unix_s"],
                "document": d,
            }
            for d in docs
        ],
    )


def _read_all(session: Session) -> tuple[list[tuple[str, float, str]], list[dict[str, Any]]]:
    links = [
        (row.link, row.capacity_factor, row.reason)
        for row in session.scalars(select(TrafficLinkState))
    ]
    docs = [row.document for row in session.scalars(select(TrafficPlanVersion))]
    return links, docs


def _links_result(
    changes: list[tuple[str, float]], new: list[_Replanned], replan_ms: float
) -> dict[str, Any]:
    """What a link change answers (and its audit row records)."""
    return {
        "links": [{"link": link, "capacity_factor": f} for link, f in changes],
        "replan_ms": replan_ms,
        "plans": [
            {
                "plan_id": p.plan_id,
                "job": p.job.name,
                "version": p.version,
                "moved_flows": p.moved_flows,
                "reported_flows": p.reported_flows,
            }
            for _, p, _, _ in new
        ],
    }


__all__ = ["Layout", "LivePlan", "TrafficService", "build_traffic", "load_fabric"]
