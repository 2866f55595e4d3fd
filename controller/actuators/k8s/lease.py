"""Leader election with a ``coordination.k8s.io/v1`` Lease, for the controller in a cluster.

The algorithm is client-go's ``leaderelection``: the holder renews the Lease every
``retry_period_s``; a candidate takes it over only once it has *itself observed* the
record unchanged for ``leaseDurationSeconds`` (no comparison of clocks across machines);
every write carries the Lease's ``resourceVersion``, so two candidates racing for it get
one 200 and one 409. ``leaseTransitions`` goes up by one at each change of holder and is the
*fencing generation*.

A deposed leader must stop acting before anyone else may start: :meth:`LeaseElector.check`
(the :class:`~controller.actuators.k8s.api.Kube` fence, run before every write the actuator
makes) raises :class:`~controller.actuators.k8s.api.Fenced` once the last successful renewal
is ``renew_deadline_s`` old, and ``renew_deadline_s`` < ``lease_duration_s``, so the old
leader's writes stop before the lease can expire for the others. Objects trainguard writes
also carry the generation (``trainguard.io/fence`` on Nodes), so a write that was already
in flight when leadership moved cannot overwrite a newer leader's.

The database election (``controller.services.leader``) stays for the local mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from controller.actuators.k8s.api import Fenced, Kube, KubernetesApiError

#: Reads and writes a release tries before leaving the Lease to expire (each retry follows
#: a 409: something wrote the Lease between the read and the write).
_RELEASE_ATTEMPTS = 3


class LeaseElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "leader election needs retry_period_s < renew_deadline_s < lease_duration_s "
                f"(got {retry_period_s}, {renew_deadline_s}, {lease_duration_s})"
            )
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self.clock = clock
        #: The fencing generation (``leaseTransitions``) while leading, else ``None``.
        self.generation: int | None = None
        self._renewed_at: float | None = None
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0

    # -- the fence ---------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return (
            self.generation is not None
            and self._renewed_at is not None
            and self.clock() - self._renewed_at < self.renew_deadline_s
        )

    def check(self) -> None:
        """Raise :class:`Fenced` unless this replica surely still holds the Lease."""
        if not self.leading:
            raise Fenced(
                f"not the leader (Lease {self.namespace}/{self.name}): this replica does "
                "not act; another one may"
            )

    def fence_generation(self) -> int | None:
        return self.generation if self.leading else None

    # -- one round ---------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        coord = self.kube.coordination
        now = datetime.now(UTC)
        try:
            lease: dict[str, Any] = await self.kube.read(
                f"get lease {self.name}", coord.read_namespaced_lease, self.name, self.namespace
            )
        except KubernetesApiError as exc:
            if exc.status != 404:
                return self._lost()
            body = self._body(None, transitions=0, acquired=now, renewed=now)
            return await self._write("create", coord.create_namespaced_lease, self.namespace, body)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        observed = (holder, str(spec.get("renewTime") or ""))
        if observed != self._observed:
            self._observed, self._observed_at = observed, self.clock()
        transitions = int(spec.get("leaseTransitions") or 0)
        rv = lease["metadata"]["resourceVersion"]
        if holder == self.identity and self.generation == transitions:
            acquired = _parse(spec.get("acquireTime")) or now
            body = self._body(rv, transitions=transitions, acquired=acquired, renewed=now)
        else:
            duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
            if holder and self.clock() - self._observed_at < duration:
                return self._lost()
            body = self._body(rv, transitions=transitions + 1, acquired=now, renewed=now)
        return await self._write(
            "update", coord.replace_namespaced_lease, self.name, self.namespace, body
        )

    def _body(
        self, rv: str | None, *, transitions: int, acquired: datetime, renewed: datetime
    ) -> client.V1Lease:
        return client.V1Lease(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            metadata=client.V1ObjectMeta(
                name=self.name, namespace=self.namespace, resource_version=rv
            ),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=max(1, round(self.lease_duration_s)),
                lease_transitions=transitions,
                acquire_time=acquired,
                renew_time=renewed,
            ),
        )

    async def _write(self, verb: str, fn: Callable[..., Any], *args: Any) -> bool:
        # The Lease itself is the one write the fence must not guard.
        try:
            lease = await self.kube.read(f"{verb} lease {self.name}", fn, *args)
        except KubernetesApiError:
            return self._lost()
        spec = lease.get("spec") or {}
        self.generation = int(spec.get("leaseTransitions") or 0)
        self._renewed_at = self.clock()
        self._observed = (self.identity, str(spec.get("renewTime") or ""))
        self._observed_at = self.clock()
        return True

    def _lost(self) -> bool:
        """A failed round: keep leading only while the renew deadline allows."""
        if not self.leading:
            self.generation = None
        return self.leading

    async def release(self) -> None:
        """Give the Lease up at once (holder cleared) so a standby need not wait for it to
        expire; stops acting first.

        Cleared whenever the record still names this replica, even past its own renew
        deadline (it no longer acts, and nobody else holds the Lease yet). A conflict is
        retried: a renewal this replica had in flight when it stopped campaigning (a
        cancelled call whose request still completes in its thread) can land between the
        read and the write here, and giving up on that 409 left the Lease held for a whole
        ``lease_duration_s``.
        """
        self.generation, self._renewed_at = None, None
        coord = self.kube.coordination
        for _ in range(_RELEASE_ATTEMPTS):
            try:
                lease = await self.kube.read(
                    f"get lease {self.name}", coord.read_namespaced_lease, self.name, self.namespace
                )
            except KubernetesApiError:
                return  # gone or unreachable: it expires on its own
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            body = self._body(
                lease["metadata"]["resourceVersion"],
                transitions=int(spec.get("leaseTransitions") or 0),
                acquired=_parse(spec.get("acquireTime")) or datetime.now(UTC),
                renewed=datetime.now(UTC),
            )
            assert body.spec is not None
            body.spec.holder_identity = ""
            body.spec.lease_duration_seconds = 1
            try:
                await self.kube.read(
                    f"release lease {self.name}",
                    coord.replace_namespaced_lease,
                    self.name,
                    self.namespace,
                    body,
                )
                return
            except KubernetesApiError as exc:
                if exc.status != 409:
                    return  # it expires on its own

    async def run(self, stop: asyncio.Event) -> None:
        """Acquire and renew until ``stop`` is set (then leave the Lease to expire)."""
        while not stop.is_set():
            await self.try_acquire_or_renew()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.retry_period_s)


def _parse(raw: Any) -> datetime | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    except ValueError:
        return None


__all__ = ["Fenced", "LeaseElector"]
