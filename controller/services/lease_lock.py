"""The controller's leader lock as a Kubernetes Lease (cluster mode), and the choice of lock.

:class:`~controller.services.leader.LeaderElector` campaigns through a
:class:`~controller.services.leader.LeaderLock`; in a cluster the lock is a
``coordination.k8s.io/v1`` Lease (:class:`~controller.actuators.k8s.lease.LeaseElector`)
instead of the database's advisory lock, so leadership and the actuator's fencing
generation are one thing: the Kubernetes actuator fences its writes with the same elector
(:meth:`~controller.actuators.kubernetes.KubernetesActuator.fence_with`, wired by
``controller.services.remediation.wiring``). ``check`` renews the Lease; a replica that
cannot renew within ``renew_deadline_s`` loses leadership before the Lease can expire for
the others. The database election stays for the local mode, and in a cluster a replica
leads only while it holds both (:func:`build_leader_lock`, :class:`LeaseAndDatabaseLock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from controller.services.leader import LeaderLock, LeadershipLost, build_lock
from controller.settings import ControllerSettings

if TYPE_CHECKING:
    from kubernetes import client

    from controller.actuators.k8s.lease import LeaseElector

#: Exactly what the Lease election calls (``LeaseElector``: read, create, replace), in the
#: controller's own namespace; the chart's ``<release>-lease`` Role grants these and a test
#: checks them against the calls the fake API server served.
LEASE_RULES: tuple[dict[str, list[str]], ...] = (
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    },
)
#: Where a pod finds its ServiceAccount (token and namespace).
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class LeaseLock:
    def __init__(self, elector: LeaseElector) -> None:
        self.elector = elector
        self.description = f"lease {elector.namespace}/{elector.name} as {elector.identity}"

    async def try_acquire(self) -> bool:
        return await self.elector.try_acquire_or_renew()

    async def check(self) -> None:
        """Renew; a renewal that hangs (an API server that accepts and never answers) is
        given up after half the renew deadline, so the loss is still noticed in time."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self.elector.try_acquire_or_renew(), self.elector.renew_deadline_s / 2
            )
        if not self.elector.leading:
            raise LeadershipLost(f"{self.description}: not renewed within the renew deadline")

    async def release(self) -> None:
        await self.elector.release()


class LeaseAndDatabaseLock:
    """The Lease *and* the database's lock: a replica leads only while it holds both.

    The database lock keeps the guarantee the previous releases gave (during a rolling
    upgrade an old replica elects through the database alone, and must never lead beside
    a new one holding only the Lease); the Lease adds the fencing generation the actuator
    writes with. Taken database first, released Lease first.
    """

    def __init__(self, lease: LeaseLock, database: LeaderLock) -> None:
        self.lease, self.database = lease, database
        self.description = f"{lease.description} + {database.description}"

    async def try_acquire(self) -> bool:
        if not await self.database.try_acquire():
            return False
        try:
            won = await self.lease.try_acquire()
        except BaseException:
            await self.database.release()
            raise
        if not won:
            await self.database.release()
        return won

    async def check(self) -> None:
        await self.database.check()
        await self.lease.check()

    async def release(self) -> None:
        await self.lease.release()
        await self.database.release()


def in_cluster() -> bool:
    """Running in a pod with a ServiceAccount (what the client's in-cluster config needs)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SA_DIR / "token").exists()


def kube_api_client(api_url: str) -> client.ApiClient:
    """A client on ``api_url`` (tests: the fake API server), else in-cluster credentials,
    else the kubeconfig. A failure is one line (:class:`ValueError`)."""
    from controller.actuators.base import ActuatorError
    from controller.actuators.k8s.api import load_api_client

    try:
        return load_api_client(api_url)
    except ActuatorError as exc:
        raise ValueError(str(exc)) from None


def lease_backend(settings: ControllerSettings) -> bool:
    """Whether these settings elect through a Lease (``auto``: when running in a pod)."""
    if not settings.leader_election:
        return False
    backend = settings.leader_election_backend
    return backend == "lease" or (backend == "auto" and in_cluster())


def build_leader_lock(settings: ControllerSettings) -> tuple[LeaderLock, LeaseElector | None]:
    """The lock the settings choose, and the Lease elector behind it (``None``: database).

    The elector is what the Kubernetes actuator fences its writes with, so the replica
    that may write to the cluster is exactly the one holding the Lease.
    """
    database = build_lock(
        settings.database_url, enabled=settings.leader_election, name=settings.leader_election_name
    )
    if not lease_backend(settings):
        return database, None
    from controller.actuators.k8s.api import Kube
    from controller.actuators.k8s.lease import LeaseElector

    namespace = settings.leader_lease_namespace
    if not namespace:
        try:
            namespace = (SA_DIR / "namespace").read_text().strip()
        except OSError:
            namespace = ""
    identity = settings.leader_identity or (
        f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    )
    elector = LeaseElector(
        Kube(kube_api_client(settings.kube_api_url)),
        namespace or settings.kube_namespace,
        settings.leader_election_name,
        identity,
        lease_duration_s=settings.leader_lease_duration_s,
        renew_deadline_s=settings.leader_lease_renew_deadline_s,
        retry_period_s=settings.leader_check_interval_s,
    )
    return LeaseAndDatabaseLock(LeaseLock(elector), database), elector


__all__ = [
    "LEASE_RULES",
    "LeaseAndDatabaseLock",
    "LeaseLock",
    "build_leader_lock",
    "in_cluster",
    "kube_api_client",
    "lease_backend",
]
