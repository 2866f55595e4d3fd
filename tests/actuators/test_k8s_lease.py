"""Lease leader election and fencing, two replicas against the faithful fake API server."""

from __future__ import annotations

import pytest

from controller.actuators.k8s.api import Fenced
from controller.actuators.k8s.events import EventRecorder
from controller.actuators.k8s.lease import LeaseElector
from controller.actuators.k8s.nodes import NodeGuard
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, kube_on, node, run, validate

__all__ = ["cluster"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(c: FakeCluster, who: str, clock: Clock) -> LeaseElector:
    return LeaseElector(kube_on(c), NS, "trainguard", who, lease_duration_s=15,
                        renew_deadline_s=10, retry_period_s=2, clock=clock)  # fmt: skip


def test_one_leader_takeover_after_expiry_and_fencing(cluster: FakeCluster) -> None:
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert run(a.try_acquire_or_renew()) is True
    assert run(b.try_acquire_or_renew()) is False
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    validate(lease)
    assert a.generation == 0 and a.leading
    a.check()
    with pytest.raises(Fenced):
        b.check()
    clock.t += 2
    assert run(a.try_acquire_or_renew()) is True  # renewal
    assert run(b.try_acquire_or_renew()) is False  # b saw the renewal: its timer restarts
    # a is partitioned from the API server from now on: it cannot renew.
    clock.t += 10.5
    with pytest.raises(Fenced):  # a stops acting at its renew deadline ...
        a.check()
    assert run(b.try_acquire_or_renew()) is False  # ... before the lease may be taken over
    clock.t += 5
    assert run(b.try_acquire_or_renew()) is True
    assert b.generation == 1
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["leaseTransitions"] == 1
    assert lease["spec"]["holderIdentity"] == "b"


def test_the_actuators_writes_are_fenced(cluster: FakeCluster) -> None:
    clock = Clock()
    a = elector(cluster, "a", clock)
    node(cluster, "gpu-1")
    guard = NodeGuard(a.kube, EventRecorder(a.kube), fence_generation=a.fence_generation)
    a.kube.fence = a.check
    with pytest.raises(Fenced):  # never elected: no write at all
        run(guard.quarantine("gpu-1", reason="xid 79", message="m"))
    assert ("", "nodes", "patch") not in cluster.served
    assert run(a.try_acquire_or_renew())
    run(guard.quarantine("gpu-1", reason="xid 79", message="m"))
    n = cluster.get("", "nodes", "", "gpu-1")
    assert n is not None and n["metadata"]["annotations"]["trainguard.io/fence"] == "0"
    clock.t += 11
    writes = len(a.kube.writes)
    with pytest.raises(Fenced):
        run(guard.release("gpu-1", reason="too late"))
    assert len(a.kube.writes) == writes


def test_two_candidates_racing_get_one_lease(cluster: FakeCluster) -> None:
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert run(a.try_acquire_or_renew())
    clock.t += 30  # a is gone; both b and c see the lease expired
    c = elector(cluster, "c", clock)
    assert not run(b.try_acquire_or_renew()) and not run(c.try_acquire_or_renew())
    clock.t += 16
    original = cluster.handle
    seen = {"n": 0}

    def racing(method: str, path: str, query: dict[str, str], body: object, ctype: str) -> object:
        # c's update lands between b's read and b's update: b's resourceVersion is stale.
        if method == "PUT" and seen["n"] == 0:
            seen["n"] = 1
            assert run(c.try_acquire_or_renew())
        return original(method, path, query, body, ctype)

    cluster.handle = racing  # type: ignore[method-assign]
    assert run(b.try_acquire_or_renew()) is False
    assert c.leading and not b.leading
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["holderIdentity"] == "c"


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="renew_deadline_s < lease_duration_s"):
        LeaseElector(None, NS, "x", "a", lease_duration_s=5, renew_deadline_s=10)  # type: ignore[arg-type]


def test_release_outlasts_a_renewal_that_was_still_in_flight(cluster: FakeCluster) -> None:
    """A renewal cancelled as the controller stopped still completes in its thread; landing
    between release's read and write it made release's write a 409, and the Lease stayed
    held until it expired (a standby waited a whole lease duration)."""
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert run(a.try_acquire_or_renew())
    renewer = elector(cluster, "a", clock)  # a's own in-flight request, another copy
    renewer.generation, renewer._renewed_at = 0, clock.t
    original = cluster.handle
    landed = {"n": 0}

    def racing(method: str, path: str, query: dict[str, str], body: object, ctype: str) -> object:
        if method == "PUT" and landed["n"] == 0:
            landed["n"] = 1
            assert run(renewer.try_acquire_or_renew())  # holder a, a newer resourceVersion
        return original(method, path, query, body, ctype)

    cluster.handle = racing  # type: ignore[method-assign]
    run(a.release())
    assert landed["n"] == 1
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["holderIdentity"] == ""
    assert not a.leading
    assert run(b.try_acquire_or_renew()) is True  # at once, no expiry to wait out


def test_release_past_the_renew_deadline_still_clears_its_own_record(cluster: FakeCluster) -> None:
    """A replica that could not renew for a while no longer acts; if the record still names
    it, nobody else holds the Lease, and clearing it spares the standby the expiry."""
    clock = Clock()
    a, b = elector(cluster, "a", clock), elector(cluster, "b", clock)
    assert run(a.try_acquire_or_renew())
    assert run(b.try_acquire_or_renew()) is False
    clock.t += 11  # past a's renew deadline, short of the lease duration
    assert not a.leading
    run(a.release())
    assert run(b.try_acquire_or_renew()) is True
    run(b.release())
    run(a.release())  # not the holder now: leaves b's release (and any holder) alone
    lease = cluster.get("coordination.k8s.io", "leases", NS, "trainguard")
    assert lease is not None and lease["spec"]["holderIdentity"] == ""
    assert lease["spec"]["leaseTransitions"] == 1
