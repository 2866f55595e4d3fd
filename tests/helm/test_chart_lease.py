"""The chart's leader Lease (issue 18): exactly the verbs the election uses, in the release
namespace, and the controller told to elect through it when it has the Kubernetes actuator."""

from __future__ import annotations

from pathlib import Path

from controller.services.lease_lock import LEASE_RULES
from controller.settings import ControllerSettings
from tests.helm.test_chart import (
    FULLNAME,
    NAMESPACE,
    TOKENS,
    VALUE_SETS,
    _container,
    _env,
    _one,
    _rbac,
    _render,
    helm_bin,
)

__all__ = ["helm_bin"]


def test_lease_role_is_the_code(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, TOKENS)
    rbac = _rbac(docs)
    role = rbac[f"Role/{NAMESPACE}/{FULLNAME}-lease"]
    assert role["rules"] == [dict(rule) for rule in LEASE_RULES]
    binding = rbac[f"RoleBinding/{NAMESPACE}/{FULLNAME}-lease"]
    assert binding["roleRef"]["name"] == f"{FULLNAME}-lease"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
    ]
    env = _env(_container(_one(docs, "Deployment"), "controller"))
    assert env["TRAINGUARD_LEADER_ELECTION_BACKEND"]["value"] == "lease"
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    backend = env["TRAINGUARD_LEADER_ELECTION_BACKEND"]["value"]
    assert (
        ControllerSettings(leader_election_backend=backend, dev_mode=True).leader_election_backend
        == "lease"
    )


def test_no_lease_without_the_kubernetes_actuator(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["sqlite-pvc-no-actuator"])
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-lease")]
    env = _env(_container(_one(docs, "Deployment"), "controller"))
    assert env["TRAINGUARD_LEADER_ELECTION_BACKEND"]["value"] == "database"
