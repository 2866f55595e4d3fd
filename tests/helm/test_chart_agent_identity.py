"""auth.agentIdentity=serviceAccountToken: each agent presents its own projected, node-bound
service-account token, the controller verifies it with TokenReview and refuses shared agent
tokens (docs/security.md). Rendered by the real helm binary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.cli_k8s_tools import ToolUnavailable, helm
from tests.helm.test_chart import OPERATOR_TOKEN, RELEASE, TOKENS, _merge, _one, _render


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    try:
        return helm()
    except ToolUnavailable as exc:
        pytest.skip(f"no helm here: {exc}")


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_node_bound_agents(helm_bin: Path, tmp_path: Path) -> None:
    # No agent-role token is needed: the agents' identity is their ServiceAccount's.
    values = {
        "auth": {
            "tokens": [{"name": "sre", "role": "operator", "token": OPERATOR_TOKEN}],
            "agentIdentity": "serviceAccountToken",
        }
    }
    docs = _render(helm_bin, tmp_path, values)
    agent_sa = f"{RELEASE}-trainguard-agent"
    daemonset = _one(docs, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == agent_sa
    assert pod["automountServiceAccountToken"] is False
    (projected,) = [v for v in pod["volumes"] if v["name"] == "agent-token"]
    source = projected["projected"]["sources"][0]["serviceAccountToken"]
    assert source == {"audience": "trainguard", "expirationSeconds": 3600, "path": "token"}
    env = _env(pod["containers"][0])
    assert env["TRAINGUARD_AGENT_TOKEN_FILE"] == "/var/run/secrets/trainguard/token"
    assert "TRAINGUARD_AGENT_TOKEN" not in env

    controller = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert controller["automountServiceAccountToken"] is True
    cenv = _env(controller["containers"][0])
    assert cenv["TRAINGUARD_KUBE_TOKEN_REVIEW"] == "true"
    assert cenv["TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS"] == "false"
    namespace = _one(docs, "ServiceAccount", agent_sa)["metadata"]["namespace"]
    assert json.loads(cenv["TRAINGUARD_KUBE_AGENT_SERVICE_ACCOUNTS"]) == [
        f"system:serviceaccount:{namespace}:{agent_sa}"
    ]
    role = _one(docs, "ClusterRole", f"{RELEASE}-trainguard-tokenreview")
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    binding = _one(docs, "ClusterRoleBinding", f"{RELEASE}-trainguard-tokenreview")
    assert binding["subjects"][0]["name"] == controller["serviceAccountName"]


def test_node_bound_is_the_default_and_shared_token_opt_in(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, _merge(TOKENS, {}))
    pod = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{RELEASE}-trainguard-agent"
    assert "TRAINGUARD_AGENT_TOKEN" not in _env(pod["containers"][0])
    cenv = _env(_one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert cenv["TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS"] == "false"

    shared = _render(helm_bin, tmp_path, _merge(TOKENS, {"auth": {"agentIdentity": "sharedToken"}}))
    pod = _one(shared, "DaemonSet")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod
    assert "TRAINGUARD_AGENT_TOKEN" in _env(pod["containers"][0])
    assert not [d for d in shared if d["metadata"]["name"].endswith("-tokenreview")]
    # The controller refuses shared agent tokens unless told: the chart tells it.
    cenv = _env(_one(shared, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    assert cenv["TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS"] == "true"
