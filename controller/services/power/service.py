"""The power side of one controller: where the tree comes from, its API views and edits.

Source of the tree at start: ``power_domains_file`` when set (configuration as code; it is
written to the database too), else the tree last put through the API (the
``power_domains`` table), else none (the loop idles). ``power_enabled`` false keeps the tree
and its views but sends no commands.

Which caps are trainguard's own outlives the process: at start the newest power action per
GPU and knob is read back from the ``actions`` table (:meth:`ActionTracker.restore`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

from controller.db.repositories.actions import latest_power_actions
from controller.errors import InvalidInput, NotFound
from controller.services.power import persist
from controller.services.power.loop import PowerLoop
from controller.services.power.schemas import (
    ActuationLatencyPublic,
    JobPriorityPublic,
    PowerDomainPublic,
    PowerDomainsPublic,
    PowerPolicyPublic,
    PriorityPublic,
)
from controller.state import ClusterState
from controller.store import Store
from power import ConfigError, DomainTree, Level, Priority, priority_from_labels
from power.policy import latency_quantile
from power.reports import PRIORITY_LABEL

log = logging.getLogger(__name__)


class PowerService:
    def __init__(
        self,
        loop: PowerLoop,
        store: Store,
        state: ClusterState,
        *,
        domains_file: Path | None,
        enabled: bool | None,
    ) -> None:
        self.loop = loop
        self._store = store
        self._state = state
        self._file = domains_file
        self._enabled_setting = enabled
        self.source: Literal["file", "api", "none"] = "none"
        self.raw: persist.Raw | None = None

    async def start(self) -> None:
        """Load the tree, and take back the caps an earlier controller set (the newest
        power action per GPU and knob in the ``actions`` table): the tracker knows them
        as trainguard's own again, and the first policy releases those on servers the
        tree leaves out."""
        stored, priorities, job_priorities = await self._store.read(persist.load)
        ours = self.loop.tracker.restore(await self._store.read(latest_power_actions))
        tree: DomainTree | None = None
        if self._file is not None:
            tree, raw = persist.read_domains_file(self._file)
            self.raw, self.source = raw, "file"
        elif stored is not None:
            tree, raw = persist.validate(stored)
            self.raw, self.source = raw, "api"
        if tree is not None:
            names = {d.name for d in tree.servers()}
            self.loop.priorities = {n: p for n, p in priorities.items() if n in names}
            # Only jobs in memory: a forgotten job's priority may still be in the stored
            # row (it goes at the next write), and must not come back with a restart.
            known = self._state.jobs
            self.loop.job_priorities = {j: p for j, p in job_priorities.items() if j in known}
            if self.source == "file":
                await self._persist()
        self.loop.enabled = (
            self._enabled_setting if self._enabled_setting is not None else tree is not None
        )
        self.loop.set_tree(tree, ours=ours)
        if tree is not None:
            log.info(
                "power domains loaded",
                extra={
                    "fields": {
                        "source": self.source,
                        "domains": len(tree.by_name),
                        "enabled": self.loop.enabled,
                    }
                },
            )

    async def _persist(self) -> None:
        raw, priorities = self.raw, dict(self.loop.priorities)
        jobs = dict(self.loop.job_priorities)
        if raw is None:
            return
        await self._store.write(lambda conn: persist.replace(conn, raw, priorities, jobs))

    # ------------------------------------------------------------------ edits

    async def replace_tree(self, body: Any) -> PowerDomainsPublic:
        try:
            tree, raw = persist.validate(body)
        except ConfigError as exc:
            raise InvalidInput(f"body: {exc}") from None
        async with self.loop.lock:
            names = {d.name for d in tree.servers()}
            kept = {n: p for n, p in self.loop.priorities.items() if n in names}
            old_raw, old_prio = self.raw, self.loop.priorities
            self.raw, self.loop.priorities = raw, kept
            try:
                await self._persist()
            except Exception:
                self.raw, self.loop.priorities = old_raw, old_prio
                raise
            self.source = "api"
            if self._enabled_setting is None:
                self.loop.enabled = True
            self.loop.set_tree(tree)
        log.info("power domains replaced", extra={"fields": {"domains": len(tree.by_name)}})
        return self.view()

    async def set_priority(self, node: str, priority: str | None) -> PriorityPublic:
        tree = self.loop.tree
        if tree is None:
            raise NotFound("no power domains configured; PUT /api/v1/power/domains first")
        server = tree.by_name.get(node)
        if server is None or server.kind.label != "server":
            raise NotFound(
                f"node {node!r} is in no power domain (the priority only steers power capping)"
            )
        async with self.loop.lock:
            old = dict(self.loop.priorities)
            if priority is None:
                self.loop.priorities.pop(node, None)
            else:
                self.loop.priorities[node] = Priority(priority)
            try:
                await self._persist()
            except Exception:
                self.loop.priorities = old
                raise
        return self.priority_of(node)

    async def set_job_priority(self, job: str, priority: str | None) -> JobPriorityPublic:
        """A job's class, over its nodes' on the GPUs its running ranks report from."""
        if self.loop.tree is None:
            raise NotFound("no power domains configured; PUT /api/v1/power/domains first")
        self._need_job(job)
        async with self.loop.lock:
            self._need_job(job)  # again: job retention may have forgotten it meanwhile
            old = dict(self.loop.job_priorities)
            if priority is None:
                self.loop.job_priorities.pop(job, None)
            else:
                self.loop.job_priorities[job] = Priority(priority)
            try:
                await self._persist()
            except Exception:
                # Not a job forgotten meanwhile (the write awaited): its hook has run.
                known = self._state.jobs
                self.loop.job_priorities = {j: p for j, p in old.items() if j in known}
                raise
        return self.job_priority_of(job)

    def _need_job(self, job: str) -> None:
        """A priority is for a job in memory: the forgotten ones have none (their hook)."""
        if job not in self._state.jobs:
            raise NotFound(
                f"job {job!r} not found: set its priority once its ranks have reported "
                "(GET /api/v1/jobs lists the known jobs)"
            )

    def job_priority_of(self, job: str) -> JobPriorityPublic:
        prio = self.loop.job_priorities.get(job)
        where = {
            node if index is None else f"{node}:gpu{index}"
            for node, index, _ in self.loop.job_placements(time.time(), job)
        }
        return JobPriorityPublic(
            job=job, priority=None if prio is None else prio.value, applies_to=sorted(where)
        )

    def priority_of(self, node: str) -> PriorityPublic:
        override = self.loop.priorities.get(node)
        if override is not None:
            return PriorityPublic(node=node, priority=override.value, source="api")
        entry = self.loop.nodes.get(node)
        labels = entry.identity.labels if entry is not None else {}
        prio = priority_from_labels(labels)
        return PriorityPublic(node=node, priority=prio.value, source="label")

    # ------------------------------------------------------------------ views

    def view(self) -> PowerDomainsPublic:
        tree = self.loop.tree
        items: list[PowerDomainPublic] = []
        if tree is not None:
            capped = self.loop.capped_gpus()
            for dom in tree.root.walk():
                st = self.loop.last.get(dom.name)
                under = [
                    g
                    for d in dom.walk()
                    if d.kind.label == "server"
                    for g in capped.get(d.name, [])
                ]
                p = dom.policy
                items.append(
                    PowerDomainPublic(
                        name=dom.name,
                        kind=dom.kind.label,
                        parent=dom.parent.name if dom.parent else None,
                        depth=len(dom.ancestors()) - 1,
                        budget_w=dom.budget_w,
                        power_w=None if st is None else round(st.power_w, 1),
                        utilization_pct=None if st is None else round(100 * st.frac, 1),
                        level=(st.level if st is not None else Level.NONE).name,
                        level_since_unix_s=(
                            st.level_since_s if st is not None and st.level_since_s > 0 else None
                        ),
                        stale=True if st is None else not st.complete,
                        capped_gpus=sorted(under),
                        policy=PowerPolicyPublic(
                            t1_frac=p.t1_frac,
                            t2_frac=p.t2_frac,
                            brake_frac=p.brake_frac,
                            hysteresis_frac=p.hysteresis_frac,
                            min_hold_s=p.min_hold_s,
                            knob=p.knob.value,
                        ),
                    )
                )
        latencies = self.loop.latencies_s  # a snapshot: a tick may be running in a thread
        return PowerDomainsPublic(
            enabled=self.loop.enabled,
            source=self.source,
            last_tick_unix_s=self.loop.last_tick_unix_s,
            actuation_latency=ActuationLatencyPublic(
                samples=len(latencies),
                p50_s=latency_quantile(latencies, 0.5),
                p99_s=latency_quantile(latencies, 0.99),
            ),
            tree=self.raw,
            released=dict(self.loop.released),
            data=items,
            count=len(items),
        )


__all__ = ["PRIORITY_LABEL", "PowerService"]
