"""The Helm chart (helm/trainguard) through a real ``helm`` binary.

``helm lint --strict`` and ``helm template`` with several value sets; the rendered manifests
are parsed and checked against the code they deploy (the actuator's ``RBAC_RULES``, the
controller's and agent's settings classes) and validated offline with
``kubernetes-validate -k 1.33 --strict``. helm comes from the same registry wheel as the
kubectl of the CLI tests (tests/cli/cli_k8s_tools.py); without it the tests skip, except
under ``CI=true`` where they fail.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.settings import AgentSettings
from controller.actuators.kubernetes import RBAC_RULES, rbac_rules_yaml
from controller.settings import ControllerSettings
from tests.cli.cli_k8s_tools import ToolUnavailable, helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "trainguard"
NAMESPACE = "gpu-ops"
RELEASE = "tg"
FULLNAME = f"{RELEASE}-trainguard"
K8S_VERSION = "1.33"

AGENT_TOKEN = "agent-token-4f1d9c2e7a"
OPERATOR_TOKEN = "operator-token-b83e11c0d5"
DB_PASSWORD = "pg-pass-7c1e90ab"
DB_URL = f"postgresql+psycopg://trainguard:{DB_PASSWORD}@postgres.db.svc:5432/trainguard"
SECRETS = (AGENT_TOKEN, OPERATOR_TOKEN, DB_PASSWORD)

TOKENS = {
    "auth": {
        "tokens": [
            {"name": "agents", "role": "agent", "token": AGENT_TOKEN},
            {"name": "sre", "role": "operator", "token": OPERATOR_TOKEN},
        ]
    }
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


#: Value sets every structural test runs over: helm/trainguard/ci/<name>-values.yaml (the
#: chart-testing convention, so `ct lint` and `ct install` use the same files).
CI_DIR = CHART / "ci"
VALUE_SETS: dict[str, dict[str, Any]] = {
    path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text())
    for path in sorted(CI_DIR.glob("*-values.yaml"))
}
#: The API the ServiceMonitor and PrometheusRule need; `helm template` is told it exists.
PROMETHEUS_API = "monitoring.coreos.com/v1"


def test_ci_values_files_are_the_value_sets() -> None:
    assert set(VALUE_SETS) == {
        "defaults",
        "postgres-ha",
        "existing-secrets",
        "sqlite-pvc-no-actuator",
    }
    assert VALUE_SETS["defaults"] == TOKENS
    assert all(p.name.endswith("-values.yaml") for p in CI_DIR.iterdir())


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    try:
        return helm()
    except ToolUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"helm is required in CI: {exc}")
        pytest.skip(f"no helm here: {exc}")


def _run_helm(
    helm_bin: Path, tmp_path: Path, values: dict[str, Any], *args: str
) -> subprocess.CompletedProcess[str]:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [str(helm_bin), *args, "-f", str(values_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},  # no user helm config
    )


def _template(
    helm_bin: Path, tmp_path: Path, values: dict[str, Any], *, prometheus_api: bool = True
) -> str:
    """``helm template``; by default as on a cluster that serves the Prometheus Operator API."""
    extra = ["--api-versions", PROMETHEUS_API] if prometheus_api else []
    proc = _run_helm(
        helm_bin, tmp_path, values, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _docs(rendered: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def _render(
    helm_bin: Path, tmp_path: Path, values: dict[str, Any], *, prometheus_api: bool = True
) -> list[dict[str, Any]]:
    return _docs(_template(helm_bin, tmp_path, values, prometheus_api=prometheus_api))


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    doc: dict[str, Any] = found[0]
    return doc


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    return [d["kind"] for d in docs]


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    pod = workload["spec"]["template"]["spec"]
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    container: dict[str, Any] = found
    return container


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# -- lint and render ---------------------------------------------------------------------


def test_lint_strict(helm_bin: Path, tmp_path: Path) -> None:
    bare = subprocess.run(
        [str(helm_bin), "lint", "--strict", str(CHART)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    # Without tokens `helm install` refuses the chart, so lint does too (values.schema.json
    # carries the rule: Helm 4's lint does not run the templates' `fail`).
    assert bare.returncode != 0, bare.stdout + bare.stderr
    assert "auth.tokens is empty and auth.existingSecret is not set" in bare.stdout + bare.stderr
    for values in VALUE_SETS.values():
        proc = _run_helm(helm_bin, tmp_path, values, "lint", "--strict", str(CHART))
        assert proc.returncode == 0, proc.stdout + proc.stderr


def kubernetes_validate() -> Path:
    """The kubernetes-validate CLI of this venv (CI fails without it, elsewhere a skip)."""
    validator = Path(sys.executable).parent / "kubernetes-validate"
    if not validator.exists():
        reason = "kubernetes-validate is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return validator


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_valid_kubernetes_1_33(helm_bin: Path, tmp_path: Path, name: str) -> None:
    validator = kubernetes_validate()
    rendered = _template(helm_bin, tmp_path, VALUE_SETS[name])
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered)
    proc = subprocess.run(
        [str(validator), "-k", K8S_VERSION, "--strict", "--quiet", str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The only kinds without a bundled schema are the Prometheus Operator's ServiceMonitor
    # and PrometheusRule (a warning, not a failure); every other object must validate.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unknown = re.findall(r"Couldn't find schema for kind (\w+)", proc.stdout + proc.stderr)
    assert set(unknown) <= {"ServiceMonitor", "PrometheusRule"}


def test_default_objects(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, TOKENS)
    assert sorted(_kinds(docs)) == sorted(
        [
            "ServiceAccount",
            # Node-bound agents by default (auth.agentIdentity): their own ServiceAccount,
            # and the controller's right to verify their tokens (TokenReview).
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Secret",
            "Secret",  # the agents' job token (agent.jobEndpoint)
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Role",
            "RoleBinding",
            "Role",  # the leader Lease's (test_chart_lease.py)
            "RoleBinding",
            "Service",
            "Service",
            "Deployment",
            "DaemonSet",
        ]
    )
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one SQLite writer
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] in (NAMESPACE, "default")


# -- RBAC: exactly the actuator's rules ---------------------------------------------------


def test_rbac_file_is_the_code() -> None:
    shipped = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    assert shipped == {"rules": [dict(rule) for rule in RBAC_RULES]}
    assert shipped == yaml.safe_load(rbac_rules_yaml())


def _rbac(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}": d
        for d in docs
        if d["apiVersion"].startswith("rbac.authorization.k8s.io/")
    }


def test_rbac_rules_equal_code(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, TOKENS)
    rbac = _rbac(docs)
    cluster = rbac[f"ClusterRole//{FULLNAME}-nodes"]["rules"]
    jobs = rbac[f"Role/{NAMESPACE}/{FULLNAME}-jobs"]["rules"]
    node_events = rbac[f"Role/default/{FULLNAME}-node-events"]["rules"]
    # Nodes are cluster-scoped; everything else lives in the job namespace.
    assert cluster + jobs == [dict(rule) for rule in RBAC_RULES]
    assert all(r.split("/")[0] == "nodes" for rule in cluster for r in rule["resources"])
    # Events about Nodes may only be written in `default`.
    assert node_events == [r for r in RBAC_RULES if r["resources"] == ["events"]]
    for binding in (
        rbac[f"ClusterRoleBinding//{FULLNAME}-nodes"],
        rbac[f"RoleBinding/{NAMESPACE}/{FULLNAME}-jobs"],
        rbac[f"RoleBinding/default/{FULLNAME}-node-events"],
    ):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
        ]
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]
    sa = _one(docs, "ServiceAccount", FULLNAME)
    assert sa["metadata"]["name"] == FULLNAME
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == FULLNAME
    assert pod["automountServiceAccountToken"] is True


def test_rbac_in_job_namespace_and_optional_kinds(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["existing-secrets"])
    rbac = _rbac(docs)
    jobs = rbac[f"Role/train/{FULLNAME}-jobs"]["rules"]
    assert rbac[f"RoleBinding/train/{FULLNAME}-jobs"]["subjects"][0]["namespace"] == NAMESPACE
    assert VALUE_SETS["existing-secrets"]["rbac"] == {"jobsets": False, "trainjobs": False}
    dropped = ("jobsets", "trainjobs")
    expected = [dict(r) for r in RBAC_RULES if not set(dropped) & set(r["resources"])]
    assert rbac[f"ClusterRole//{FULLNAME}-nodes"]["rules"] + jobs == expected
    env = _env(_container(_one(docs, "Deployment"), "controller"))
    assert env["TRAINGUARD_KUBE_NAMESPACE"]["value"] == "train"


@pytest.mark.parametrize("kind", ["jobsets", "pytorchjobs", "trainjobs"])
def test_rbac_toggle_drops_exactly_its_kind(helm_bin: Path, tmp_path: Path, kind: str) -> None:
    """Each ``rbac.<kind>: false`` removes that workload's rule and nothing else (a TrainJob
    runs as a JobSet, so dropping JobSets drops TrainJobs with them)."""
    off = {"jobsets": ("jobsets", "trainjobs")}.get(kind, (kind,))
    docs = _render(helm_bin, tmp_path, _merge(TOKENS, {"rbac": dict.fromkeys(off, False)}))
    rbac = _rbac(docs)
    granted = (
        rbac[f"ClusterRole//{FULLNAME}-nodes"]["rules"]
        + rbac[f"Role/{NAMESPACE}/{FULLNAME}-jobs"]["rules"]
    )
    assert granted == [dict(r) for r in RBAC_RULES if not set(off) & set(r["resources"])]
    assert len(granted) == len(RBAC_RULES) - len(off)


def test_job_namespace_default_needs_one_role(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, _merge(TOKENS, {"controller": {"jobNamespace": "default"}}))
    # (Besides the leader Lease's own Role in the release namespace, test_chart_lease.py.)
    roles = [
        d for d in docs if d["kind"] == "Role" and not d["metadata"]["name"].endswith("-lease")
    ]
    assert [(r["metadata"]["namespace"], r["metadata"]["name"]) for r in roles] == [
        ("default", f"{FULLNAME}-jobs")
    ]
    cluster = _one(docs, "ClusterRole", f"{FULLNAME}-nodes")["rules"]
    assert cluster + roles[0]["rules"] == [dict(rule) for rule in RBAC_RULES]


def test_no_rbac_without_kubernetes_actuator(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["sqlite-pvc-no-actuator"])
    # No actuator, no agents: no RBAC at all, and no API credentials in the controller's pod.
    assert VALUE_SETS["sqlite-pvc-no-actuator"]["agent"]["enabled"] is False
    assert not _rbac(docs)
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


# -- controller ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_controller_pod_hardened(helm_bin: Path, tmp_path: Path, name: str) -> None:
    deployment = _one(_render(helm_bin, tmp_path, VALUE_SETS[name]), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["enableServiceLinks"] is False
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        ctx = container["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["requests"]
    controller = _container(deployment, "controller")
    assert controller["command"] == ["trainguard", "controller"]
    assert controller["ports"] == [{"name": "http", "containerPort": 8470, "protocol": "TCP"}]
    assert controller["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert controller["readinessProbe"]["httpGet"]["path"] == "/readyz"


def _settings_env(
    container: dict[str, Any], secrets: dict[tuple[str, str], str], node: str = "gpu-node-1"
) -> dict[str, str]:
    """A container's environment as the process would see it (secretKeyRef resolved)."""
    out = {}
    for name, entry in _env(container).items():
        if "value" in entry:
            out[name] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            out[name] = secrets[(ref["name"], ref["key"])]
        elif entry["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName":
            out[name] = node
    return out


def _chart_secrets(docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (doc["metadata"]["name"], key): base64.b64decode(value).decode()
        for doc in docs
        if doc["kind"] == "Secret"
        for key, value in doc["data"].items()
    }


@pytest.mark.parametrize("name", ["defaults", "postgres-ha"])
def test_controller_env_is_valid_settings(
    helm_bin: Path, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment the chart gives the controller is accepted by ControllerSettings."""
    docs = _render(helm_bin, tmp_path, VALUE_SETS[name])
    controller = _container(_one(docs, "Deployment"), "controller")
    env = _settings_env(controller, _chart_secrets(docs))
    for key in [k for k in os.environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("TRAINGUARD_") and key != "TRAINGUARD_CONFIG_FILE":
            monkeypatch.setenv(key, value)
    settings = ControllerSettings()
    assert (settings.host, settings.port, settings.actuator) == ("0.0.0.0", 8470, "kubernetes")
    # A replica campaigns only once the kubelet has seen it Ready (docs/controller.md).
    assert settings.leader_campaign_after_ready is True
    assert settings.kube_namespace == NAMESPACE
    assert {t.name: t.token for t in settings.tokens} == {
        "agents": AGENT_TOKEN,
        "sre": OPERATOR_TOKEN,
    }
    if name == "defaults":
        assert settings.database_url == "sqlite:////var/lib/trainguard/trainguard.db"
        mounts = {m["mountPath"] for m in controller["volumeMounts"]}
        assert "/var/lib/trainguard" in mounts
    else:
        assert settings.database_url == DB_URL
        config = yaml.safe_load(_one(docs, "ConfigMap", FULLNAME)["data"]["config.yaml"])
        assert config == {"node_lost_after_s": 60, "policy_dry_run": True}
        assert env["TRAINGUARD_CONFIG_FILE"] == "/etc/trainguard/config.yaml"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_in_plain_env(helm_bin: Path, tmp_path: Path, name: str) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS[name])
    outside_secrets = yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    for secret in SECRETS:
        assert secret not in outside_secrets
    for doc in docs:
        if doc["kind"] not in ("Deployment", "DaemonSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            env = _env(container)
            for key in ("TRAINGUARD_TOKENS", "TRAINGUARD_AGENT_TOKEN"):
                if key in env:
                    assert set(env[key]) == {"name", "valueFrom"}
                    assert "secretKeyRef" in env[key]["valueFrom"]
            database = env.get("TRAINGUARD_DATABASE_URL", {})
            if "value" in database:  # only the embedded SQLite path is plain
                assert database["value"].startswith("sqlite:///")


def test_existing_secrets_are_referenced(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["existing-secrets"])
    assert "Secret" not in _kinds(docs)
    env = _env(_container(_one(docs, "Deployment"), "controller"))
    assert env["TRAINGUARD_TOKENS"]["valueFrom"]["secretKeyRef"] == {
        "name": "tg-auth",
        "key": "tokens",
    }
    assert env["TRAINGUARD_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "tg-db",
        "key": "url",
    }
    agent_env = _env(_container(_one(docs, "DaemonSet"), "agent"))
    assert agent_env["TRAINGUARD_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "tg-auth",
        "key": "agent-token",
    }
    volumes = _one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in volumes}["job-token"]["secret"]["secretName"] == "tg-job-token"


def test_sqlite_persistence(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["sqlite-pvc-no-actuator"])
    pvc = _one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "fast"
    volumes = _one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    (data,) = [v for v in volumes if v["name"] == "data"]
    assert data["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "DaemonSet" not in _kinds(docs)


# -- agent --------------------------------------------------------------------------------


def test_agent_daemonset(helm_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shared agent token (opt-in): the node-bound default is test_chart_agent_identity.
    docs = _render(helm_bin, tmp_path, _merge(TOKENS, {"auth": {"agentIdentity": "sharedToken"}}))
    ds = _one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    agent = _container(ds, "agent")
    assert agent["command"] == [
        "trainguard",
        "agent",
        "--controller",
        f"http://{FULLNAME}:8470",
    ]
    env = _env(agent)
    assert env["TRAINGUARD_AGENT_NODE_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}
    }
    assert env["TRAINGUARD_AGENT_METRICS_HOST"]["value"] == "0.0.0.0"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["automountServiceAccountToken"] is False
    # Every taint tolerated (isolated, not-ready, pressure, the GPU taint), and scheduled and
    # kept like other node daemons.
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    # The socket directory is a hostPath, mounted where the socket path points.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket-dir"]["hostPath"] == {
        "path": "/run/trainguard",
        "type": "DirectoryOrCreate",
    }
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    socket_path = env["TRAINGUARD_AGENT_SOCKET_PATH"]["value"]
    assert Path(socket_path).parent == Path(mounts["socket-dir"]) == Path("/run/trainguard")
    assert agent["ports"] == [
        {"name": "metrics", "containerPort": 9470, "protocol": "TCP"},
        # The job endpoint on the node's IP: what training pods use instead of the hostPath.
        {"name": "jobs", "containerPort": 9471, "hostPort": 9471, "protocol": "TCP"},
    ]
    # Non-root by default; power and clock commands need agent.privileged.
    ctx = agent["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
    assert ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["allowPrivilegeEscalation"] is False
    # The environment is one the agent's settings accept, on this node.
    for key in [k for k in os.environ if k.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(key)
    resolved = _settings_env(agent, _chart_secrets(docs))
    for key, value in resolved.items():
        if key.startswith("TRAINGUARD_AGENT_"):
            monkeypatch.setenv(key, value)
    settings = AgentSettings(controller_url=agent["command"][-1])
    assert settings.node_name == "gpu-node-1"
    assert settings.token is not None and settings.token.get_secret_value() == AGENT_TOKEN
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9470)
    assert settings.socket_path == "/run/trainguard/agent.sock"
    assert str(settings.resolved_spool_dir).startswith(mounts["spool"])
    tcp = settings.job_tcp()
    assert tcp is not None and (tcp.host, tcp.port) == ("0.0.0.0", 9471)
    secret = volumes["job-token"]["secret"]
    assert secret == {
        "secretName": f"{FULLNAME}-job-token",
        "items": [{"key": "token", "path": "token"}],
    }
    assert tcp.token_file == Path(mounts["job-token"]) / "token"


def test_agent_privileged_value(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["existing-secrets"])
    ds = _one(docs, "DaemonSet")
    ctx = _container(ds, "agent")["securityContext"]
    assert ctx["runAsUser"] == 0
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert "privileged" not in ctx
    pod = ds["spec"]["template"]["spec"]
    assert "runtimeClassName" not in pod
    assert "initContainers" not in pod  # root creates its own directories


# -- monitoring ---------------------------------------------------------------------------


def test_service_monitor_only_when_enabled(helm_bin: Path, tmp_path: Path) -> None:
    assert "ServiceMonitor" not in _kinds(_render(helm_bin, tmp_path, TOKENS))
    # Enabled on a cluster without the Prometheus Operator's API: nothing, not a failure.
    bare = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"], prometheus_api=False)
    assert not {"ServiceMonitor", "PrometheusRule"} & set(_kinds(bare))
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {FULLNAME, f"{FULLNAME}-agent"}
    assert monitors[FULLNAME]["metadata"]["labels"]["release"] == "prom"
    assert monitors[FULLNAME]["spec"]["endpoints"][0]["port"] == "http"
    assert monitors[f"{FULLNAME}-agent"]["spec"]["endpoints"][0]["port"] == "metrics"
    # Without agents only the controller is scraped.
    docs = _render(helm_bin, tmp_path, VALUE_SETS["sqlite-pvc-no-actuator"])
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceMonitor"] == [FULLNAME]


def test_grafana_dashboard_only_when_enabled(helm_bin: Path, tmp_path: Path) -> None:
    assert "ConfigMap" not in _kinds(_render(helm_bin, tmp_path, TOKENS))
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    dashboard = _one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["trainguard.json"])["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    # Every metric the dashboard queries is one the controller or the agent exports.
    sources = "".join(
        path.read_text()
        for folder in ("controller", "agents")
        for path in (ROOT / folder).rglob("*.py")
    )
    names = {
        re.sub(r"_(total|bucket)$", "", m) for e in exprs for m in re.findall(r"trainguard_\w+", e)
    }
    assert len(names) >= 10
    for name in names:
        assert f'"{name}"' in sources, f"dashboard queries {name}, which nothing exports"


def test_ha_replicas_on_postgres(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    # One old pod may go before its replacement is Ready: a rollout never waits on a pod
    # that cannot become Ready, and never needs room for more than replicas + 1 pods.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1},
    }
    pdb = _one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # never blocks a drain
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "data" not in volumes  # no SQLite volume on PostgreSQL


def test_notes_explain_access(helm_bin: Path, tmp_path: Path) -> None:
    proc = _run_helm(
        helm_bin,
        tmp_path,
        TOKENS,
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--dry-run=client",
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{FULLNAME} 8470:8470" in notes
    assert "kubectl trainguard nodes" in notes
    # The plugin goes through the API server: the release's namespace and Service named.
    assert f"kubectl trainguard status -n {NAMESPACE} --service {FULLNAME}" in notes
    assert "TRAINGUARD_AGENT_SOCKET=/run/trainguard/agent.sock" in notes
    assert "TRAINGUARD_AGENT_ADDR=$(NODE_IP):9471" in notes
    assert "not highly available" in notes or "no high availability" in notes


# -- bad values ---------------------------------------------------------------------------

HEX = "0" * 64
BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "replicas not a number": (
        _merge(TOKENS, {"controller": {"replicas": "x"}}),
        "/controller/replicas",
    ),
    "no tokens, no existingSecret": ({}, "auth.tokens is empty and auth.existingSecret is not set"),
    "short token": (
        {"auth": {"tokens": [{"name": "a", "role": "agent", "token": "short"}]}},
        "/auth/tokens/0/token",
    ),
    "token and sha256": (
        {
            "auth": {
                "tokens": [{"name": "a", "role": "agent", "token": AGENT_TOKEN, "sha256": "0" * 64}]
            }
        },
        "/auth/tokens/0",
    ),
    "unknown role": (
        {"auth": {"tokens": [{"name": "a", "role": "admin", "token": AGENT_TOKEN}]}},
        "/auth/tokens/0/role",
    ),
    "agent token only hashed": (
        {
            "auth": {
                "tokens": [{"name": "a", "role": "agent", "sha256": "a" * 64}],
                "agentIdentity": "sharedToken",
            }
        },
        "the agents need a plaintext agent-role token",
    ),
    "ha on sqlite": (
        _merge(TOKENS, {"controller": {"replicas": 2}}),
        "controller.replicas > 1 needs PostgreSQL",
    ),
    "misspelt key": (_merge(TOKENS, {"controller": {"replica": 2}}), "replica"),
    "bad actuator": (_merge(TOKENS, {"controller": {"actuator": "ssh"}}), "/controller/actuator"),
    "not a postgres url": (
        _merge(TOKENS, {"database": {"url": "mysql://x@y/z"}}),
        "/database/url",
    ),
    "tokens in controller.config": (
        _merge(TOKENS, {"controller": {"config": {"tokens": []}}}),
        "/controller/config",
    ),
    "postgres url without the psycopg driver": (
        _merge(TOKENS, {"database": {"url": "postgresql://tg:pw@pg/tg"}}),
        "/database/url",
    ),
    "bad gpus": (_merge(TOKENS, {"agent": {"gpus": "all"}}), "/agent/gpus"),
    "short job token": (
        _merge(TOKENS, {"agent": {"jobEndpoint": {"token": "short"}}}),
        "/agent/jobEndpoint/token",
    ),
    "trainjobs without jobsets": (
        _merge(TOKENS, {"rbac": {"jobsets": False}}),
        "rbac.trainjobs needs rbac.jobsets",
    ),
    "bad job namespace": (
        _merge(TOKENS, {"agent": {"jobEndpoint": {"jobNamespaces": ["Team_A"]}}}),
        "/agent/jobEndpoint/jobNamespaces/0",
    ),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_fail_clearly(helm_bin: Path, tmp_path: Path, case: str) -> None:
    values, message = BAD_VALUES[case]
    proc = _run_helm(
        helm_bin, tmp_path, values, "template", RELEASE, str(CHART), "--namespace", NAMESPACE
    )
    assert proc.returncode != 0, f"{case}: rendered\n{proc.stdout[:500]}"
    assert message in proc.stderr, proc.stderr


# -- values.yaml documents every key ------------------------------------------------------


def test_every_values_key_is_commented() -> None:
    """Each key of values.yaml has a comment above it, or sits under a commented parent."""
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        match = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if match and not stripped.startswith("#"):
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            documented = previous.startswith("#") or (bool(stack) and stack[-1][1])
            leaf = match.group(3).strip() != ""
            if leaf and not documented:
                undocumented.append(stripped)
            stack.append((indent, documented))
        if stripped:
            previous = stripped
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_schema_is_json() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False


# -- rollouts, migrations, leader routing (issue 22) ---------------------------------------


def _hooks(doc: dict[str, Any]) -> set[str]:
    return set(doc["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(","))


def test_migrations_run_once_as_a_pre_install_and_pre_upgrade_hook(
    helm_bin: Path, tmp_path: Path
) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "initContainers" not in pod  # a new pod never migrates under a serving leader
    job = _one(docs, "Job", f"{FULLNAME}-migrate")
    assert _hooks(job) == {"pre-install", "pre-upgrade"}
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"][:3] == ["trainguard", "db", "upgrade"]
    assert container["image"] == "trainguard-controller:0.1.0"
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    # On a first install the chart's Secret does not exist yet: the URL comes from a hook
    # Secret created before the Job (lower weight) and removed with it.
    ref = _env(container)["TRAINGUARD_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    secret = _one(docs, "Secret", ref["name"])
    assert _hooks(secret) == _hooks(job)
    weight = int(secret["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert weight < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == DB_URL
    assert container["command"][3:] == ["--database-url", "$(TRAINGUARD_DATABASE_URL)"]
    # With the user's Secret it is referenced directly; SQLite needs no Job.
    docs = _render(helm_bin, tmp_path, VALUE_SETS["existing-secrets"])
    job = _one(docs, "Job", f"{FULLNAME}-migrate")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert _env(container)["TRAINGUARD_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "tg-db",
        "key": "url",
    }
    assert container["image"] == "registry.example.com/ml/trainguard-controller:0.1.0-rc1"
    assert "Job" not in _kinds(_render(helm_bin, tmp_path, TOKENS))


def test_service_routes_to_the_leader_label_set_by_the_sidecar(
    helm_bin: Path, tmp_path: Path
) -> None:
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    service = _one(docs, "Service", FULLNAME)
    assert service["spec"]["selector"]["trainguard.io/leader"] == "true"
    deployment = _one(docs, "Deployment")
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["trainguard.io/leader"] == "false"  # until it leads
    assert "trainguard.io/leader" not in deployment["spec"]["selector"]["matchLabels"]
    sidecar = _container(deployment, "leader-label")
    command = sidecar["command"]
    assert command[:2] == ["trainguard", "leader-label"] and "--once" not in command
    # It labels the pods the Deployment selects (all of the release's controllers).
    selector = dict(kv.split("=") for kv in command[command.index("--selector") + 1].split(","))
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert command[command.index("--port") + 1] == "8470"
    env = _env(sidecar)
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    pods_rule = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]}]
    rbac = _rbac(docs)
    assert rbac[f"Role/{NAMESPACE}/{FULLNAME}-leader"]["rules"] == pods_rule
    binding = rbac[f"RoleBinding/{NAMESPACE}/{FULLNAME}-leader"]
    assert binding["subjects"][0]["name"] == template["spec"]["serviceAccountName"]
    # Before an upgrade switches the Service to the label, the old pods get labelled once,
    # after the migration, by a hook with its own RBAC (created before it).
    hook = _one(docs, "Job", f"{FULLNAME}-leader-hook")
    assert _hooks(hook) == {"pre-upgrade"}
    migrate = _one(docs, "Job", f"{FULLNAME}-migrate")
    weight = int(hook["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert weight > int(migrate["metadata"]["annotations"]["helm.sh/hook-weight"])
    hook_pod = hook["spec"]["template"]["spec"]
    (hook_container,) = hook_pod["containers"]
    assert hook_container["command"] == [*command, "--once"]
    assert rbac[f"Role/{NAMESPACE}/{FULLNAME}-leader-hook"]["rules"] == pods_rule
    hook_rbac = [rbac[f"{k}/{NAMESPACE}/{FULLNAME}-leader-hook"] for k in ("Role", "RoleBinding")]
    for obj in [*hook_rbac, _one(docs, "ServiceAccount", f"{FULLNAME}-leader-hook")]:
        assert _hooks(obj) == {"pre-upgrade"}
        assert int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) < weight
    assert hook_pod["serviceAccountName"] == f"{FULLNAME}-leader-hook"
    # The commands are ones the CLI has, with flags it accepts.
    from trainguard.cli.app import run

    assert run([*hook_container["command"][1:], "--help"], prog_name="trainguard") == 0
    # Turned off (or on SQLite): every Ready replica is selected, no sidecar, no Role.
    for name in ("existing-secrets", "defaults"):
        docs = _render(helm_bin, tmp_path, VALUE_SETS[name])
        assert "trainguard.io/leader" not in _one(docs, "Service", FULLNAME)["spec"]["selector"]
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["controller"]
        assert f"Role/{NAMESPACE}/{FULLNAME}-leader" not in _rbac(docs)
        assert f"{FULLNAME}-leader-hook" not in {d["metadata"]["name"] for d in docs}


# -- alerts ---------------------------------------------------------------------------------

EXPECTED_ALERTS = {
    "TrainguardNoLeader",
    "TrainguardTwoLeaders",
    "TrainguardAgentSilent",
    "TrainguardHangOpen",
    "TrainguardStragglerOpen",
    "TrainguardGpuFaultOpen",
    "TrainguardPowerAboveBudget",
    "TrainguardGoodputLow",
    "TrainguardCheckpointsNotDurable",
}


def _code_sources(*folders: str) -> str:
    return "".join(p.read_text() for f in folders for p in (ROOT / f).rglob("*.py"))


def test_prometheus_rule_alerts_use_real_metrics_and_have_runbooks(
    helm_bin: Path, tmp_path: Path
) -> None:
    promql = pytest.importorskip("promql_parser")
    docs = _render(helm_bin, tmp_path, VALUE_SETS["postgres-ha"])
    rule = _one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == EXPECTED_ALERTS
    sources = _code_sources("controller", "agents")
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    headings = {line[3:].strip().lower() for line in runbook.splitlines() if line[:3] == "## "}
    for name, alert in alerts.items():
        expr = alert["expr"]
        promql.parse(expr)  # valid PromQL, or ValueError
        assert f'namespace="{NAMESPACE}"' in expr, name  # this release's targets only
        metrics = set(re.findall(r"trainguard_\w+", expr))
        assert metrics, name
        for metric in metrics:
            assert f'"{metric}"' in sources, f"{name} uses {metric}, which nothing exports"
        for kinds in re.findall(r'kind=~?"([^"]+)"', expr):
            for kind in kinds.split("|"):
                assert f'"{kind}"' in sources, f"{name}: no incident kind {kind!r} in the code"
        assert alert["labels"]["severity"] in ("critical", "warning")
        anchor = name.lower()
        assert alert["annotations"]["runbook"] == f"docs/runbook.md#{anchor}"
        assert anchor in headings, f"docs/runbook.md has no section for {name}"
        base = VALUE_SETS["postgres-ha"]["prometheusRule"]["runbookBaseUrl"]
        assert alert["annotations"]["runbook_url"] == f"{base}#{anchor}"
    assert alerts["TrainguardGoodputLow"]["expr"].endswith("< 0.9")
    assert alerts["TrainguardAgentSilent"]["for"] == "5m"
    # N missed intervals (3) of the observed interval, else of checkpointIntervalMinutes (30).
    durable = alerts["TrainguardCheckpointsNotDurable"]["expr"]
    assert "> 3 * (max by (job_name) (trainguard_job_checkpoint_interval_seconds" in durable
    assert durable.count("1800") == 2
    # Opt-in: not rendered by default even where the CRDs exist.
    assert "PrometheusRule" not in _kinds(_render(helm_bin, tmp_path, TOKENS))


# -- images and the chart README -------------------------------------------------------------


def test_chart_readme_values_table_is_up_to_date() -> None:
    sys.path.insert(0, str(ROOT / "helm"))
    try:
        import values_table
    finally:
        sys.path.remove(str(ROOT / "helm"))
    readme = (CHART / "README.md").read_text()
    values_text = (CHART / "values.yaml").read_text()
    assert values_table.updated_readme(readme, values_text) == readme, (
        "helm/trainguard/README.md is out of date: run python helm/values_table.py"
    )
    documented = {path for path, _ in values_table.documented_keys(values_text)}
    assert {"image.registry", "agent.priorityClassName", "prometheusRule.enabled"} <= documented


# -- the agents' job endpoint (TCP on the node's IP, no hostPath in training pods) -----------

JOB_TOKEN = "job-token-91c3e7a0d2b48f65"


def test_job_token_copied_to_job_namespaces(helm_bin: Path, tmp_path: Path) -> None:
    values = _merge(
        TOKENS, {"agent": {"jobEndpoint": {"token": JOB_TOKEN, "jobNamespaces": ["train", "b"]}}}
    )
    docs = _render(helm_bin, tmp_path, values)
    secrets = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): base64.b64decode(
            d["data"]["token"]
        ).decode()
        for d in docs
        if d["kind"] == "Secret" and "token" in d.get("data", {})
    }
    assert secrets == {
        (NAMESPACE, f"{FULLNAME}-job-token"): JOB_TOKEN,
        ("train", "trainguard-job-token"): JOB_TOKEN,
        ("b", "trainguard-job-token"): JOB_TOKEN,
    }
    ds = _one(docs, "DaemonSet")
    assert JOB_TOKEN not in yaml.safe_dump(ds)  # mounted from the Secret, never inlined


def test_job_token_generated_once_per_render(helm_bin: Path, tmp_path: Path) -> None:
    values = _merge(TOKENS, {"agent": {"jobEndpoint": {"jobNamespaces": ["train"]}}})
    docs = _render(helm_bin, tmp_path, values)
    tokens = {
        base64.b64decode(d["data"]["token"]).decode()
        for d in docs
        if d["kind"] == "Secret" and d["metadata"]["name"].endswith("job-token")
    }
    (token,) = tokens  # the agents' Secret and the copy carry the same random token
    assert len(token) == 48 and token.isalnum()


def test_job_endpoint_existing_secret_and_off(helm_bin: Path, tmp_path: Path) -> None:
    docs = _render(
        helm_bin, tmp_path, _merge(TOKENS, {"agent": {"jobEndpoint": {"existingSecret": "jt"}}})
    )
    assert not [d for d in docs if d["metadata"]["name"].endswith("job-token")]
    pod = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["job-token"]["secret"]["secretName"] == "jt"

    docs = _render(helm_bin, tmp_path, _merge(TOKENS, {"agent": {"jobEndpoint": {"port": 0}}}))
    ds = _one(docs, "DaemonSet")
    agent = _container(ds, "agent")
    assert not [d for d in docs if d["metadata"]["name"].endswith("job-token")]
    assert "TRAINGUARD_AGENT_JOB_LISTEN" not in _env(agent)
    assert [p["name"] for p in agent["ports"]] == ["metrics"]
    assert "job-token" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}


def test_grafana_dashboard_queries_use_real_metrics_and_labels() -> None:
    """Every panel's PromQL parses, names a metric the code exports and groups GPU metrics
    only by labels the agent puts on them (dcgm-exporter's ``Hostname`` is the node; a panel
    grouped by a label no series carries draws one anonymous line)."""
    promql = pytest.importorskip("promql_parser")
    from agents.metrics import _GPU_LABELS

    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    sources = _code_sources("controller", "agents")
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    for expr in exprs:
        promql.parse(expr)
        for metric in set(re.findall(r"trainguard_\w+", expr)):
            base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
            assert f'"{metric}"' in sources or f'"{base}"' in sources, f"{expr}: no {metric}"
        if "trainguard_gpu_" in expr:
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    assert label in [*_GPU_LABELS, "xid"], f"{expr}: GPU series have no {label}"
