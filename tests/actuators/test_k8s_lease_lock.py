"""The controller's own LeaderElector campaigning through a Lease (cluster mode)."""

from __future__ import annotations

import asyncio

from controller.actuators.k8s.lease import LeaseElector
from controller.services.leader import LeaderElector
from controller.services.lease_lock import LeaseLock
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, kube_on

__all__ = ["cluster"]


def test_two_controllers_one_leader_and_a_handover_on_release(cluster: FakeCluster) -> None:
    async def scenario() -> list[str]:
        story: list[str] = []

        def elector(who: str) -> LeaderElector:
            lease = LeaseElector(kube_on(cluster), NS, "trainguard", who, lease_duration_s=3,
                                 renew_deadline_s=2, retry_period_s=0.1)  # fmt: skip

            async def elected() -> None:
                story.append(f"{who} elected")

            async def lost(reason: str) -> None:
                story.append(f"{who} lost")

            return LeaderElector(LeaseLock(lease), retry_interval_s=0.05, check_interval_s=0.05,
                                 on_elected=elected, on_lost=lost)  # fmt: skip

        a, b = elector("a"), elector("b")
        await a.start()
        await b.start()
        await asyncio.sleep(0.3)
        assert a.is_leader and not b.is_leader
        await a.stop()  # releases the Lease: b takes over without waiting for expiry
        await asyncio.wait_for(b.elected.wait(), 2)
        await b.stop()
        return story

    story = asyncio.run(scenario())
    assert story[:2] == ["a elected", "b elected"]
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["leaseTransitions"] == 1
