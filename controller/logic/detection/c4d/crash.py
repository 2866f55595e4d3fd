"""Rank crashes, with the cascade folded into the rank that started it.

When one rank of a synchronous job dies, its peers' next collective fails (the connection
is gone), and they die too, each with an error of its own. Reporting every exit as a crash
would blame the survivors. A rank whose fatal exception escaped a collective call says so
(``RankEvent.collective_failed``); such exits are *collateral* and wait a short grace period
for the *primary* crash (an exit outside any collective: a signal, an ``os._exit``, an
error in the training code) to arrive, which then names them in its evidence. Collateral
exits with no primary after the grace period point at communication itself (a broken link
fails collectives on both of its ends) and become one ``comm_failure`` finding.

A rank killed from outside (SIGKILL, the OOM killer) sends nothing; its node agent sees
its connection close without an exit record and reports the exit for it
(``RankEvent.disconnected``: cause unknown). Such a *vanished* rank is a primary crash as
soon as something shows the job broke: a collateral exit, pending or arriving within the
grace period; ranks vanishing after it (torchrun stops a node's other workers) are folded
in, so the first to vanish is named. With no such sign after the grace period it is still
a crash, unless every rank of the job vanished or exited cleanly: then the whole job was
stopped from outside (an operator, the actuator's own restart), which is no fault.

Ordering uses the kind of exit and arrival order on the controller's clock, not
wall-clock timestamps from different nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.job_evidence import CommFailureEvidence, RankCrashEvidence
from trainguard.wire import RankEvent

#: How long a collateral exit waits for the primary crash to be reported (seconds on the
#: controller's clock). Agents report within a second or two; 10 s leaves margin.
COLLATERAL_GRACE_S = 10.0
#: A collateral exit arriving this long after a primary one is still folded into it.
CASCADE_WINDOW_S = 120.0


@dataclass(slots=True)
class _Exit:
    event: RankEvent
    node: str
    received_s: float


@dataclass(slots=True)
class CrashState:
    job: str
    collateral: dict[int, _Exit] = field(default_factory=dict)
    #: Vanished ranks (``disconnected``) not yet known to be a crash or a whole-job stop.
    vanished: dict[int, _Exit] = field(default_factory=dict)
    clean_exits: set[int] = field(default_factory=set)
    last_primary_s: float | None = None
    reported: set[int] = field(default_factory=set)

    def observe(self, node: str, ev: RankEvent, now_s: float) -> list[Finding]:
        if ev.kind != "exited":
            return []
        if not ev.disconnected and ev.exit_code in (0, None) and ev.signal is None:
            self.clean_exits.add(ev.rank)
            return []
        if ev.rank in self.reported:
            return []
        self.reported.add(ev.rank)
        in_cascade = (
            self.last_primary_s is not None and now_s - self.last_primary_s < CASCADE_WINDOW_S
        )
        if in_cascade and (ev.collective_failed or ev.disconnected):
            return []  # folded into the crash already reported
        if ev.collective_failed:
            self.collateral[ev.rank] = _Exit(ev, node, now_s)
            return self._vanished_crash(now_s) if self.vanished else []
        if ev.disconnected:
            self.vanished[ev.rank] = _Exit(ev, node, now_s)
            return self._vanished_crash(now_s) if self.collateral else []
        return [self._primary(_Exit(ev, node, now_s), now_s)]

    def _primary(self, first: _Exit, now_s: float) -> Finding:
        ev, node = first.event, first.node
        self.last_primary_s = now_s
        followers = sorted(set(self.collateral) | (set(self.vanished) - {ev.rank}))
        self.collateral.clear()
        self.vanished.clear()
        if ev.disconnected:
            how = "vanished without an exit record: killed from outside (SIGKILL, OOM killer?)"
        else:
            how = f"signal {ev.signal}" if ev.signal else f"exit code {ev.exit_code}"
        detail = f": {ev.error}" if ev.error and not ev.disconnected else ""
        return Finding(
            kind=FindingKind.RANK_CRASH,
            job=self.job,
            severity="critical",
            summary=f"rank {ev.rank} of job {self.job} on {node} died ({how}){detail}",
            key=f"rank_crash:{self.job}:{ev.rank}",
            ranks=(ev.rank,),
            nodes=(node,),
            evidence=RankCrashEvidence(
                exit_code=ev.exit_code,
                signal=ev.signal,
                pid=ev.pid,
                error=ev.error,
                disconnected=ev.disconnected,
                collateral_ranks=followers,
                # The agent saw the process vanish; why it died is unknown.
                confidence=0.9 if ev.disconnected else 1.0,
            ),
        )

    def _vanished_crash(self, now_s: float) -> list[Finding]:
        # The first to vanish (arrival order; one node's disconnect times break ties).
        first = min(self.vanished.values(), key=lambda e: (e.received_s, e.event.time_unix_s))
        return [self._primary(first, now_s)]

    def evaluate(self, now_s: float, world_size: int = 0) -> list[Finding]:
        if self.vanished:
            oldest = min(e.received_s for e in self.vanished.values())
            if now_s - oldest < COLLATERAL_GRACE_S:
                return []
            gone = set(self.vanished) | self.clean_exits
            if not self.collateral and world_size and len(gone) >= world_size:
                self.vanished.clear()  # the whole job was stopped from outside: no fault
                return []
            return self._vanished_crash(now_s)
        if not self.collateral:
            return []
        oldest = min(e.received_s for e in self.collateral.values())
        if now_s - oldest < COLLATERAL_GRACE_S:
            return []
        exits = sorted(self.collateral.values(), key=lambda e: e.event.rank)
        self.collateral.clear()
        ranks = tuple(e.event.rank for e in exits)
        nodes = tuple(sorted({e.node for e in exits}))
        return [
            Finding(
                kind=FindingKind.COMM_FAILURE,
                job=self.job,
                severity="critical",
                summary=(
                    f"job {self.job}: ranks {list(ranks)} died inside collectives and no rank "
                    "crashed on its own: the communication path failed"
                ),
                key=f"comm_failure:{self.job}",
                ranks=ranks,
                nodes=nodes,
                evidence=CommFailureEvidence(
                    errors={str(e.event.rank): e.event.error for e in exits},
                    # Ranks failing inside collectives with nobody crashing first points at
                    # the network, but a crash report lost on the way would look the same.
                    confidence=0.6,
                ),
            )
        ]
