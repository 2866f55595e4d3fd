"""The controller's leader lock as a Kubernetes Lease (cluster mode).

:class:`~controller.services.leader.LeaderElector` campaigns through a
:class:`~controller.services.leader.LeaderLock`; in a cluster the lock is a
``coordination.k8s.io/v1`` Lease (:class:`~controller.actuators.k8s.lease.LeaseElector`)
instead of the database's advisory lock, so leadership and the actuator's fencing
generation are one thing: the Kubernetes actuator fences its writes with the same elector
(:meth:`~controller.actuators.kubernetes.KubernetesActuator.fence_with`). ``check`` renews
the Lease; a replica that cannot renew within ``renew_deadline_s`` loses leadership before
the Lease can expire for the others. The database election stays for the local mode.
"""

from __future__ import annotations

from controller.actuators.k8s.lease import LeaseElector
from controller.services.leader import LeadershipLost


class LeaseLock:
    def __init__(self, elector: LeaseElector) -> None:
        self.elector = elector
        self.description = f"lease {elector.namespace}/{elector.name} as {elector.identity}"

    async def try_acquire(self) -> bool:
        return await self.elector.try_acquire_or_renew()

    async def check(self) -> None:
        await self.elector.try_acquire_or_renew()
        if not self.elector.leading:
            raise LeadershipLost(f"{self.description}: not renewed within the renew deadline")

    async def release(self) -> None:
        await self.elector.release()


__all__ = ["LeaseLock"]
