"""A half-done quarantine is finished by a retry; another party's taint is never changed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller.actuators.base import ActuatorError
from controller.actuators.k8s.nodes import ANN_CORDONED_BY, TAINT_KEY
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import cluster, node, run, validate
from tests.actuators.test_k8s_nodes import guard, reasons

__all__ = ["cluster"]

STATUS_PATCH = ("", "nodes/status", "patch")


def get(c: FakeCluster, name: str) -> dict[str, Any]:
    n = c.get("", "nodes", "", name)
    assert n is not None
    validate(n)
    return n


def condition(c: FakeCluster, name: str) -> str | None:
    conds = {x["type"]: x for x in get(c, name)["status"]["conditions"]}
    return conds["TrainguardHealthy"]["status"] if "TrainguardHealthy" in conds else None


def record(c: FakeCluster, name: str) -> dict[str, Any]:
    return dict(json.loads(get(c, name)["metadata"]["annotations"][ANN_CORDONED_BY]))


def test_retry_sets_the_condition_a_failed_status_patch_left_out(cluster: FakeCluster) -> None:
    node(cluster, "n1")
    g = guard(cluster)
    cluster.faults[STATUS_PATCH] = 0
    with pytest.raises(ActuatorError) as err:
        run(g.quarantine("n1", reason="xid 79", message="GPU fell off the bus"))
    message = str(err.value)
    assert err.value.retryable and getattr(err.value, "status", None) == 500
    # The error says what was applied and that a retry finishes it.
    assert "half done" in message and "cordoned" in message
    assert f"{TAINT_KEY}=xid-79:NoSchedule" in message and "retry" in message
    assert get(cluster, "n1")["spec"]["unschedulable"] is True
    assert condition(cluster, "n1") is None
    del cluster.faults[STATUS_PATCH]

    done = run(g.quarantine("n1", reason="xid 79", message="GPU fell off the bus"))
    assert not done.details.get("already") and done.details["completed"] == ["condition"]
    assert condition(cluster, "n1") == "False"
    assert reasons(cluster) == ["TrainguardQuarantined"]
    # Now complete: a third call writes nothing.
    version = get(cluster, "n1")["metadata"]["resourceVersion"]
    assert run(g.quarantine("n1", reason="xid 79", message="m")).details == {"already": True}
    assert get(cluster, "n1")["metadata"]["resourceVersion"] == version


def test_forbidden_status_patch_says_the_node_is_cordoned(cluster: FakeCluster) -> None:
    node(cluster, "n2")
    g = guard(cluster)
    cluster.forbidden.add(STATUS_PATCH)
    with pytest.raises(ActuatorError) as err:
        run(g.quarantine("n2", reason="hang", message="m"))
    assert not err.value.retryable and getattr(err.value, "status", None) == 403
    assert "is now cordoned" in str(err.value) and "RBAC" in str(err.value)
    cluster.forbidden.clear()
    run(g.quarantine("n2", reason="hang", message="m"))
    assert condition(cluster, "n2") == "False"


@pytest.mark.parametrize(
    "theirs",
    [
        {"key": TAINT_KEY, "value": "ops", "effect": "NoExecute"},
        {"key": TAINT_KEY, "value": "ops", "effect": "NoSchedule"},
    ],
)
def test_another_partys_taint_with_our_key_is_kept_and_survives_release(
    cluster: FakeCluster, theirs: dict[str, str]
) -> None:
    node(cluster, "n3", unschedulable=True, taints=[theirs])
    g = guard(cluster)
    result = run(g.quarantine("n3", reason="hang", message="m"))
    n = get(cluster, "n3")
    assert n["spec"]["taints"] == [theirs]  # not replaced: it already keeps pods off
    rec = record(cluster, "n3")
    assert rec["tainted"] is False and rec["taint"] is None and not rec["cordoned"]
    assert rec["kept_taints"] == [f"{TAINT_KEY}=ops:{theirs['effect']}"]
    assert "kept the existing taint" in result.outcome
    assert condition(cluster, "n3") == "False"
    assert run(g.quarantine("n3", reason="hang", message="m")).details == {"already": True}

    run(g.release("n3", reason="fixed"))
    n = get(cluster, "n3")
    assert n["spec"]["taints"] == [theirs] and n["spec"]["unschedulable"] is True
    assert ANN_CORDONED_BY not in (n["metadata"].get("annotations") or {})


def test_a_weaker_taint_with_our_key_gets_ours_next_to_it(cluster: FakeCluster) -> None:
    theirs = {"key": TAINT_KEY, "value": "ops", "effect": "PreferNoSchedule"}
    node(cluster, "n4", taints=[theirs])
    g = guard(cluster)
    run(g.quarantine("n4", reason="hang", message="m"))
    ours = {"key": TAINT_KEY, "value": "hang", "effect": "NoSchedule"}
    assert get(cluster, "n4")["spec"]["taints"] == [theirs, ours]
    rec = record(cluster, "n4")
    assert rec["tainted"] is True and rec["taint"] == ours
    run(g.release("n4", reason="fixed"))
    n = get(cluster, "n4")
    assert n["spec"]["taints"] == [theirs] and not n["spec"].get("unschedulable")


def test_release_of_an_older_record_still_removes_trainguards_taint(
    cluster: FakeCluster,
) -> None:
    ours = {"key": TAINT_KEY, "value": "hang", "effect": "NoSchedule"}
    old = {"by": "trainguard", "reason": "hang", "cordoned": True, "tainted": True}
    node(cluster, "n5", unschedulable=True, taints=[ours])
    stored = cluster.objects[("", "nodes", "", "n5")]
    stored["metadata"]["annotations"] = {ANN_CORDONED_BY: json.dumps(old)}
    g = guard(cluster)
    run(g.release("n5", reason="fixed"))
    n = get(cluster, "n5")
    assert not n["spec"].get("taints") and not n["spec"].get("unschedulable")
