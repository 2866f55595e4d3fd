"""Chart values the acceptance probe found accepted though they give an unusable or
over-privileged release (the Helm/plugin probe): ``helm lint --strict`` must refuse what
``helm install`` refuses (Helm 4's lint treats ``fail`` as a no-op, so the rules live in
values.schema.json too), images pin by digest, extraEnv and tolerations are typed like their
Kubernetes objects, the agent's two ports differ, and the optional NetworkPolicies render
valid objects that let the controller pods reach each other."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helm.test_chart import (
    CHART,
    FULLNAME,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    ROOT,
    TOKENS,
    _container,
    _merge,
    _one,
    _render,
    _run_helm,
    _template,
    helm_bin,
)

__all__ = ["helm_bin"]

DIGEST = "sha256:" + "0123456789abcdef" * 4
OTHER_DIGEST = "sha256:" + "fedcba9876543210" * 4


def _lint(
    helm_bin: Path, tmp_path: Path, values: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    return _run_helm(helm_bin, tmp_path, values, "lint", "--strict", str(CHART))


def _helm_template(
    helm_bin: Path, tmp_path: Path, values: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    return _run_helm(
        helm_bin, tmp_path, values, "template", RELEASE, str(CHART), "--namespace", NAMESPACE
    )


# -- lint refuses what install refuses --------------------------------------------------------

HASHED_AGENT_ONLY = {
    "auth": {
        "tokens": [{"name": "a", "role": "agent", "sha256": "a" * 64}],
        "agentIdentity": "sharedToken",
    }
}
PG = {"database": {"url": "postgresql+psycopg://tg:pw@pg.db.svc:5432/tg"}}

LINT_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "replicas 2 on sqlite": (
        _merge(TOKENS, {"controller": {"replicas": 2}}),
        "controller.replicas > 1 needs PostgreSQL (database.url or database.existingSecret)",
    ),
    "no tokens": ({}, "auth.tokens is empty and auth.existingSecret is not set"),
    "shared agent token only hashed": (
        HASHED_AGENT_ONLY,
        "the agents need a plaintext agent-role token",
    ),
    "digest as image.tag": (
        _merge(TOKENS, {"image": {"tag": DIGEST}}),
        "set controller.image.digest and agent.image.digest",
    ),
    "controller extraEnv value not a string": (
        _merge(TOKENS, {"controller": {"extraEnv": [{"name": "FOO", "value": 1}]}}),
        "/controller/extraEnv/0/value",
    ),
    "agent extraEnv without a name": (
        _merge(TOKENS, {"agent": {"extraEnv": [{"value": "x"}]}}),
        "/agent/extraEnv/0",
    ),
    "extraEnv with an unknown key": (
        _merge(TOKENS, {"agent": {"extraEnv": [{"name": "A", "vaule": "x"}]}}),
        "/agent/extraEnv/0",
    ),
    "toleration operator": (
        _merge(TOKENS, {"agent": {"tolerations": [{"operator": "Sometimes"}]}}),
        "/agent/tolerations/0/operator",
    ),
    "toleration effect": (
        _merge(
            TOKENS, {"controller": {"tolerations": [{"operator": "Exists", "effect": "Never"}]}}
        ),
        "/controller/tolerations/0/effect",
    ),
    "tolerationSeconds not an integer": (
        _merge(
            TOKENS,
            {"agent": {"tolerations": [{"operator": "Exists", "tolerationSeconds": "60"}]}},
        ),
        "/agent/tolerations/0/tolerationSeconds",
    ),
    "bad digest": (
        _merge(TOKENS, {"agent": {"image": {"digest": "sha256:abc"}}}),
        "/agent/image/digest",
    ),
}


@pytest.mark.parametrize("case", LINT_REFUSES)
def test_lint_and_template_refuse_clearly(helm_bin: Path, tmp_path: Path, case: str) -> None:
    values, message = LINT_REFUSES[case]
    lint = _lint(helm_bin, tmp_path, values)
    assert lint.returncode != 0, f"{case}: lint passed\n{lint.stdout}{lint.stderr}"
    assert message in lint.stdout + lint.stderr
    rendered = _helm_template(helm_bin, tmp_path, values)
    assert rendered.returncode != 0, f"{case}: rendered"
    assert message in rendered.stderr, rendered.stderr


LINT_ACCEPTS: dict[str, dict[str, Any]] = {
    "replicas 2 on postgres url": _merge(TOKENS, _merge(PG, {"controller": {"replicas": 2}})),
    "replicas 2 on an existing db secret": _merge(
        TOKENS, {"controller": {"replicas": 2}, "database": {"existingSecret": "pg"}}
    ),
    "no tokens, existing secret": {"auth": {"existingSecret": "tg-auth"}},
    "hashed agent token with serviceAccountToken": {
        "auth": {"tokens": [{"name": "a", "role": "agent", "sha256": "a" * 64}]}
    },
    "hashed agent token plus agentToken": _merge(
        HASHED_AGENT_ONLY, {"auth": {"agentToken": "agent-token-4f1d9c2e7a"}}
    ),
    "hashed agent token, agents off": _merge(HASHED_AGENT_ONLY, {"agent": {"enabled": False}}),
    "typed extraEnv and tolerations": _merge(
        TOKENS,
        {
            "controller": {
                "extraEnv": [
                    {"name": "A", "value": "1"},
                    {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                ],
                "tolerations": [
                    {"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}
                ],
            },
            "agent": {
                "tolerations": [
                    {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
                    {"key": "k", "operator": "Exists", "effect": ""},
                ]
            },
        },
    ),
    "a release tag": _merge(TOKENS, {"image": {"tag": "0.2.0-rc.1"}}),
}


@pytest.mark.parametrize("case", LINT_ACCEPTS)
def test_lint_accepts_the_documented_alternatives(
    helm_bin: Path, tmp_path: Path, case: str
) -> None:
    lint = _lint(helm_bin, tmp_path, LINT_ACCEPTS[case])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    _template(helm_bin, tmp_path, LINT_ACCEPTS[case])


# -- images by digest -------------------------------------------------------------------------


def _images(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            out.setdefault(doc["metadata"]["name"], set()).add(c["image"])
    return out


def test_images_pinned_by_digest(helm_bin: Path, tmp_path: Path) -> None:
    values = _merge(
        TOKENS,
        _merge(
            PG,
            {
                "image": {"registry": "registry.example.com/ml", "tag": "ignored"},
                "controller": {"image": {"digest": DIGEST}},
                "agent": {"image": {"digest": OTHER_DIGEST}},
            },
        ),
    )
    images = _images(_render(helm_bin, tmp_path, values))
    controller = f"registry.example.com/ml/trainguard-controller@{DIGEST}"
    agent = f"registry.example.com/ml/trainguard-agent@{OTHER_DIGEST}"
    assert images[FULLNAME] == {controller}  # controller and leader-label sidecar
    assert images[f"{FULLNAME}-migrate"] == {controller}
    assert images[f"{FULLNAME}-agent"] == {agent}
    # One component by digest, the other by tag.
    values = _merge(TOKENS, {"agent": {"image": {"digest": OTHER_DIGEST}}})
    images = _images(_render(helm_bin, tmp_path, values))
    assert images[FULLNAME] == {"trainguard-controller:0.1.0"}
    assert images[f"{FULLNAME}-agent"] == {f"trainguard-agent@{OTHER_DIGEST}"}


# -- the agent's two ports --------------------------------------------------------------------


def test_metrics_port_equal_to_job_port_is_refused(helm_bin: Path, tmp_path: Path) -> None:
    values = _merge(TOKENS, {"agent": {"metrics": {"port": 9471}}})
    proc = _helm_template(helm_bin, tmp_path, values)
    assert proc.returncode != 0
    assert "agent.metrics.port and agent.jobEndpoint.port are both 9471" in proc.stderr
    # Different ports, the job endpoint off, metrics off, or no agents: all render.
    for agent in (
        {"metrics": {"port": 9472}, "jobEndpoint": {"port": 9471}},
        {"metrics": {"port": 9471}, "jobEndpoint": {"port": 0}},
        {"metrics": {"port": -1}, "jobEndpoint": {"port": 9471}},
        {"enabled": False, "metrics": {"port": 9471}},
    ):
        _template(helm_bin, tmp_path, _merge(TOKENS, {"agent": agent}))


# -- NetworkPolicy ----------------------------------------------------------------------------


def _validate(tmp_path: Path, rendered: str) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(rendered)
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "kubernetes-validate"), "-k", K8S_VERSION, "--strict",
         str(manifest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_no_network_policy_by_default(helm_bin: Path, tmp_path: Path) -> None:
    kinds = {d["kind"] for d in _render(helm_bin, tmp_path, TOKENS)}
    assert "NetworkPolicy" not in kinds


def test_network_policies(helm_bin: Path, tmp_path: Path) -> None:
    peer = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    values = _merge(
        TOKENS,
        _merge(
            PG,
            {
                "controller": {"replicas": 2},
                "networkPolicy": {
                    "enabled": True,
                    "apiFrom": [peer],
                    "metricsNamespace": "monitoring",
                },
            },
        ),
    )
    rendered = _template(helm_bin, tmp_path, values)
    _validate(tmp_path, rendered)
    docs = _render(helm_bin, tmp_path, values)
    controller_pod = _one(docs, "Deployment")["spec"]["template"]
    agent_pod = _one(docs, "DaemonSet")["spec"]["template"]
    hook_pod = _one(docs, "Job", f"{FULLNAME}-leader-hook")["spec"]["template"]
    policy = _one(docs, "NetworkPolicy", FULLNAME)
    assert policy["metadata"]["namespace"] == NAMESPACE
    spec = policy["spec"]
    assert _matches(spec["podSelector"], controller_pod["metadata"]["labels"])
    assert not _matches(spec["podSelector"], agent_pod["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": 8470, "protocol": "TCP"}]
    assert _container(_one(docs, "Deployment"), "controller")["ports"][0]["containerPort"] == 8470
    pod_peers = [p["podSelector"] for p in rule["from"] if "podSelector" in p]
    # Controller to controller (the leader-label sidecar), the upgrade hook, the agents.
    for pod in (controller_pod, hook_pod, agent_pod):
        assert any(_matches(sel, pod["metadata"]["labels"]) for sel in pod_peers), pod
    assert all(sel.get("matchLabels") for sel in pod_peers)  # never "every pod"
    assert peer in rule["from"]
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert {"namespaceSelector": monitoring} in rule["from"]
    # The agents: the job endpoint open (ranks from any namespace), metrics scraped only
    # from the release namespace and the monitoring one.
    agent_policy = _one(docs, "NetworkPolicy", f"{FULLNAME}-agent")["spec"]
    assert _matches(agent_policy["podSelector"], agent_pod["metadata"]["labels"])
    jobs, metrics = agent_policy["ingress"]
    assert jobs == {"ports": [{"port": 9471, "protocol": "TCP"}]}
    assert metrics["ports"] == [{"port": 9470, "protocol": "TCP"}]
    assert metrics["from"] == [{"podSelector": {}}, {"namespaceSelector": monitoring}]
    # Turned off for the agents, or no agents: only the controller's policy.
    for extra in ({"networkPolicy": {"agent": {"enabled": False}}}, {"agent": {"enabled": False}}):
        docs = _render(helm_bin, tmp_path, _merge(values, extra))
        assert [d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"] == [FULLNAME]


def test_network_policy_schema(helm_bin: Path, tmp_path: Path) -> None:
    for bad, where in (
        ({"apiFrom": [{}]}, "/networkPolicy/apiFrom/0"),
        ({"apiFrom": [{"ports": [8470]}]}, "/networkPolicy/apiFrom/0"),
        ({"metricsNamespace": "Mon_itoring"}, "/networkPolicy/metricsNamespace"),
    ):
        proc = _lint(helm_bin, tmp_path, _merge(TOKENS, {"networkPolicy": bad}))
        assert proc.returncode != 0 and where in proc.stdout + proc.stderr, bad


# -- upgrade notes and the chart version -------------------------------------------------------


def test_breaking_value_changes_are_documented() -> None:
    chart = (CHART / "Chart.yaml").read_text()
    assert "\nversion: 0.2.0\n" in chart
    readme = (CHART / "README.md").read_text()
    guide = (ROOT / "docs" / "kubernetes.md").read_text()
    upgrades = guide.split("### Upgrades", 1)[1].split("\n### Network policies", 1)[0]
    for text in (readme, upgrades):
        for key in (
            "image.repository",
            "controller.image.repository",
            "agent.image.repository",
            "controller.image.digest",
            "auth.agentIdentity",
            "rbac.trainjobs",
        ):
            assert f"`{key}`" in text, key
    assert "separate" in guide or "own namespace" in guide
    assert "networkPolicy.enabled" in guide
