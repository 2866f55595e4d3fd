"""Acceptance sweep of hostile or unusual chart values an operator might pass.

For each value, ``helm template`` (and, where the rule lives in values.schema.json,
``helm lint --strict``) either renders objects that are valid Kubernetes objects doing what
the value says, or fails with a message naming the value: never broken YAML, an invalid
object, or a setting silently dropped. Covered here and not in test_chart.py /
test_chart_hardening.py: replica counts at the edges, secrets with YAML/shell metacharacters
(byte-exact), resource quantities, label and annotation maps, image tags that YAML turns
into numbers, names at the 53/63-character limits, and the RBAC / NetworkPolicy / agent
toggles combined (no dangling reference).
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.settings import ControllerSettings
from tests.helm.test_chart import (
    CHART,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    TOKENS,
    _merge,
    _run_helm,
    helm_bin,
    kubernetes_validate,
)

__all__ = ["helm_bin"]

PG = {"database": {"url": "postgresql+psycopg://tg:pw@pg.db.svc:5432/tg"}}
DIGEST = "sha256:" + "0123456789abcdef" * 4
# Kubernetes' own syntax for label values and DNS labels (apimachinery validation).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Kinds whose name must be a DNS label (63): a Service's is its DNS name, a Job's becomes
# its pods' job-name label, a workload's prefixes its pods' names.
DNS_LABEL_KINDS = {"Service", "Job", "DaemonSet", "Deployment", "ServiceAccount"}
POD_KINDS = {"Deployment", "DaemonSet", "Job"}


# -- helpers ------------------------------------------------------------------------------


def _helm(
    helm_bin: Path,
    tmp_path: Path,
    values: dict[str, Any],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> subprocess.CompletedProcess[str]:
    return _run_helm(
        helm_bin, tmp_path, values, "template", release, str(CHART), "--namespace", namespace
    )


def _render(
    helm_bin: Path,
    tmp_path: Path,
    values: dict[str, Any],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
) -> tuple[str, list[dict[str, Any]]]:
    proc = _helm(helm_bin, tmp_path, values, release=release, namespace=namespace)
    assert proc.returncode == 0, proc.stderr
    # A YAML error here is the "broken YAML" this sweep guards against.
    docs = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    _check_objects(docs)
    return proc.stdout, docs


def _refused(helm_bin: Path, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    proc = _helm(helm_bin, tmp_path, values)
    assert proc.returncode != 0, f"rendered:\n{proc.stdout[:800]}"
    assert message in proc.stderr, proc.stderr


def _pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pod templates, with the kind and name of the object that makes them."""
    return [
        {"owner": (d["kind"], d["metadata"]["name"]), **d["spec"]["template"]}
        for d in docs
        if d["kind"] in POD_KINDS
    ]


def _matches(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def _check_objects(docs: list[dict[str, Any]]) -> None:
    """Invariants every rendered release must keep, whatever the values."""
    keys = Counter((d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs)
    assert not [k for k, n in keys.items() if n > 1], f"two objects share a name: {keys}"
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= (63 if doc["kind"] in DNS_LABEL_KINDS else 253), (doc["kind"], name)
        label_maps = [doc["metadata"].get("labels") or {}]
        if doc["kind"] in POD_KINDS:
            label_maps.append(doc["spec"]["template"]["metadata"].get("labels") or {})
            selector = doc["spec"].get("selector", {}).get("matchLabels")
            if selector:  # the API server refuses a selector its template does not match
                assert _matches(selector, label_maps[-1]), (name, selector, label_maps[-1])
        for labels in label_maps:
            for key, value in labels.items():
                assert isinstance(value, str), (name, key, value)
                assert len(value) <= 63 and LABEL_VALUE.match(value), (name, key, value)
        for key, value in (doc["metadata"].get("annotations") or {}).items():
            assert isinstance(value, str), (name, key, value)
    _check_references(docs)


def _check_references(docs: list[dict[str, Any]]) -> None:
    """No RoleBinding to a missing Role, no missing ServiceAccount, no selector of no pod."""
    have = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    pods = _pods(docs)
    for doc in docs:
        kind, ns = doc["kind"], doc["metadata"].get("namespace")
        if kind in ("RoleBinding", "ClusterRoleBinding"):
            ref = doc["roleRef"]
            ref_ns = ns if ref["kind"] == "Role" else None
            assert (ref["kind"], ref_ns, ref["name"]) in have, f"{kind} {doc['metadata']}: {ref}"
            for subject in doc["subjects"]:
                assert subject["kind"] == "ServiceAccount"
                sa = ("ServiceAccount", subject["namespace"], subject["name"])
                assert sa in have or subject["name"] in EXTERNAL_SAS, subject
        if kind == "NetworkPolicy":
            selectors = [doc["spec"]["podSelector"].get("matchLabels", {})]
            for rule in doc["spec"].get("ingress", []):
                selectors += [
                    p["podSelector"]["matchLabels"]
                    for p in rule.get("from", [])
                    if "podSelector" in p and p["podSelector"].get("matchLabels")
                ]
            for sel in selectors:
                assert any(_matches(sel, p["metadata"]["labels"]) for p in pods), sel
        if kind == "Service" and doc["spec"].get("selector"):
            sel = dict(doc["spec"]["selector"])
            # The leader label: pods start "false" and the sidecar sets "true"; the key must
            # be on the pods, the value is the sidecar's.
            leader = sel.pop("trainguard.io/leader", None)
            matching = [p for p in pods if _matches(sel, p["metadata"]["labels"])]
            assert matching, f"Service {doc['metadata']['name']} selects no pod"
            if leader is not None:
                assert all("trainguard.io/leader" in p["metadata"]["labels"] for p in matching)
    for doc in docs:
        if doc["kind"] in POD_KINDS:
            sa_name = doc["spec"]["template"]["spec"].get("serviceAccountName")
            if sa_name:
                sa = ("ServiceAccount", doc["metadata"]["namespace"], sa_name)
                assert sa in have or sa_name in EXTERNAL_SAS, (doc["metadata"]["name"], sa_name)


#: ServiceAccounts the operator brings (serviceAccount.create=false), so not rendered.
EXTERNAL_SAS = {"ops-sa"}


def _kubernetes_validate(tmp_path: Path, manifests: dict[str, str]) -> None:
    files = []
    for name, text in manifests.items():
        path = tmp_path / f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.yaml"
        path.write_text(text)
        files.append(str(path))
    proc = subprocess.run(
        [str(kubernetes_validate()), "-k", K8S_VERSION, "--strict", "--quiet", *files],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _workload(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _pod_spec(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = _workload(docs, kind)["spec"]["template"]["spec"]
    return spec


def _secret(docs: list[dict[str, Any]], name: str) -> dict[str, bytes]:
    (doc,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
    return {k: base64.b64decode(v) for k, v in doc["data"].items()}


# -- values that render: each does what it says, and every object is valid -----------------

HOSTILE_URL = (
    "postgresql+psycopg://tg:p'\"a: b #c\\d$(HOME)${USER}`id`\n- x@pg.db.svc:5432/tg?opt=a b"
)
HOSTILE_TOKEN = "tok:en#'\"\\$(HOME)`id`--{a:b}[c]&*!|>-z"
# A job token is printable ASCII without spaces (values.schema.json): one line in a file.
HOSTILE_JOB_TOKEN = "jt:#'\"\\$(HOME)`id`{a:b}[c]&*!|>"

ACCEPTED: dict[str, dict[str, Any]] = {
    "replicas 0": {"controller": {"replicas": 0}},
    "replicas a million on postgres": _merge(PG, {"controller": {"replicas": 1_000_000}}),
    "hostile secrets": {
        "database": {"url": HOSTILE_URL},
        "auth": {
            "agentIdentity": "sharedToken",
            "tokens": [{"name": "a: b #c", "role": "agent", "token": HOSTILE_TOKEN}],
        },
        "agent": {"jobEndpoint": {"token": HOSTILE_JOB_TOKEN}},
    },
    "odd but valid quantities": {
        "controller": {
            "resources": {
                "requests": {"cpu": 0.5, "memory": "1Gi", "ephemeral-storage": "1.5e+3"},
                "limits": {"memory": "2048Mi", "cpu": ".5"},
            }
        },
        "agent": {"resources": {"requests": {"cpu": "500m", "memory": 134217728}}},
    },
    "unusual maps": {
        "commonLabels": {"example.com/team": "ml-infra", "cost_center": "1.10"},
        "controller": {
            "nodeSelector": {"kubernetes.io/x": "true", "node.example.com/pool": ""},
            "podLabels": {"example.com/a_b.c": "x"},
            "podAnnotations": {
                "example.com/note": "a: b #c\n$(HOME) 'q' \"q\"",
                "example.com/port": "8470",
            },
            "tolerations": [{"key": "kubernetes.io/x", "operator": "Equal", "value": "true"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/x", "operator": "In", "values": ["true"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "extraEnv": [
                {"name": "QUOTED", "value": "a: b #c '$(HOME)' \"x\" \\n"},
                {"name": "EMPTY", "value": ""},
            ],
        },
        "agent": {"nodeSelector": {"nvidia.com/gpu.present": "true"}},
        "service": {
            "annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
        },
    },
    "tag 1.10 as a string, registry with a port": {
        "image": {"tag": "1.10", "registry": "registry.example.com:5000/ml"}
    },
    "digests and no registry": {
        "controller": {"image": {"digest": DIGEST}},
        "agent": {"image": {"digest": DIGEST}},
    },
    "sqlite pvc with a storage class": {
        "database": {"sqlite": {"persistence": {"enabled": True, "storageClass": "fast.ssd-1"}}}
    },
}


@pytest.fixture(scope="module")
def accepted(helm_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, extra in ACCEPTED.items():
        tmp = tmp_path_factory.mktemp("accepted")
        out[name] = _render(helm_bin, tmp, _merge(TOKENS, extra))
    return out


def test_accepted_values_are_valid_kubernetes(accepted: dict[str, Any], tmp_path: Path) -> None:
    _kubernetes_validate(tmp_path, {name: text for name, (text, _) in accepted.items()})


def test_replicas_render_exactly(accepted: dict[str, Any]) -> None:
    assert _workload(accepted["replicas 0"][1], "Deployment")["spec"]["replicas"] == 0
    text, docs = accepted["replicas a million on postgres"]
    # Helm holds numbers as floats: without `int` this printed 1e+06, which no int32 takes.
    assert "replicas: 1000000\n" in text
    assert _workload(docs, "Deployment")["spec"]["replicas"] == 1_000_000


def test_secrets_hold_the_exact_bytes(accepted: dict[str, Any]) -> None:
    _, docs = accepted["hostile secrets"]
    main = _secret(docs, f"{RELEASE}-trainguard")
    assert main["database-url"] == HOSTILE_URL.encode()
    assert main["agent-token"] == HOSTILE_TOKEN.encode()
    assert json.loads(main["tokens"]) == [
        {"name": "a: b #c", "role": "agent", "token": HOSTILE_TOKEN}
    ]
    # What the chart accepts, the controller accepts too.
    ControllerSettings(tokens=json.loads(main["tokens"]), database_url="sqlite:///x.db")
    # The migration hook's own copy of the URL, and the job token.
    assert _secret(docs, f"{RELEASE}-trainguard-migrate")["database-url"] == HOSTILE_URL.encode()
    job = _secret(docs, f"{RELEASE}-trainguard-job-token")
    assert job["token"] == HOSTILE_JOB_TOKEN.encode()
    # Kubernetes expands $(VAR) in the command only, not inside the Secret's value.
    (migrate,) = [d for d in docs if d["kind"] == "Job" and "migrate" in d["metadata"]["name"]]
    command = migrate["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-1] == "$(TRAINGUARD_DATABASE_URL)"


def test_quantities_render_as_given(accepted: dict[str, Any]) -> None:
    _, docs = accepted["odd but valid quantities"]
    controller = _pod_spec(docs, "Deployment")["containers"][0]["resources"]
    assert controller == ACCEPTED["odd but valid quantities"]["controller"]["resources"]
    agent = next(c for c in _pod_spec(docs, "DaemonSet")["containers"] if c["name"] == "agent")
    # Helm merges maps with the defaults: the default memory limit stays.
    assert agent["resources"] == {
        "requests": {"cpu": "500m", "memory": 134217728},
        "limits": {"memory": "512Mi"},
    }


def test_unusual_maps_render_as_given(accepted: dict[str, Any]) -> None:
    _, docs = accepted["unusual maps"]
    values = ACCEPTED["unusual maps"]
    pod = _workload(docs, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == values["controller"]["nodeSelector"]
    assert spec["tolerations"] == values["controller"]["tolerations"]
    assert spec["affinity"] == values["controller"]["affinity"]
    for key, value in values["controller"]["podAnnotations"].items():
        assert pod["metadata"]["annotations"][key] == value
    assert pod["metadata"]["labels"]["example.com/a_b.c"] == "x"
    for doc in docs:  # commonLabels on every object
        assert doc["metadata"]["labels"]["example.com/team"] == "ml-infra"
        assert doc["metadata"]["labels"]["cost_center"] == "1.10"
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    for var in values["controller"]["extraEnv"]:
        assert env[var["name"]] == var
    agent_spec = _pod_spec(docs, "DaemonSet")
    assert agent_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (service,) = [
        d for d in docs if d["kind"] == "Service" and "agent" not in d["metadata"]["name"]
    ]
    assert service["metadata"]["annotations"] == values["service"]["annotations"]


def test_images(accepted: dict[str, Any]) -> None:
    _, docs = accepted["tag 1.10 as a string, registry with a port"]
    images = {c["image"] for p in _pods(docs) for c in p["spec"]["containers"]}
    assert images == {
        "registry.example.com:5000/ml/trainguard-controller:1.10",
        "registry.example.com:5000/ml/trainguard-agent:1.10",
    }
    _, docs = accepted["digests and no registry"]
    images = {c["image"] for p in _pods(docs) for c in p["spec"]["containers"]}
    assert images == {f"trainguard-controller@{DIGEST}", f"trainguard-agent@{DIGEST}"}


def test_storage_class_rendered(accepted: dict[str, Any]) -> None:
    _, docs = accepted["sqlite pvc with a storage class"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["storageClassName"] == "fast.ssd-1"


# -- values that are refused, by template and by lint --------------------------------------

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "replicas negative": ({"controller": {"replicas": -1}}, "/controller/replicas"),
    "replicas a string": ({"controller": {"replicas": "2"}}, "got string, want integer"),
    "replicas a fraction": ({"controller": {"replicas": 1.5}}, "got number, want integer"),
    "replicas beyond int32": (
        _merge(PG, {"controller": {"replicas": 99_999_999_999}}),
        "/controller/replicas': maximum",
    ),
    "cpu not a quantity": (
        {"controller": {"resources": {"requests": {"cpu": "lots"}}}},
        "/controller/resources/requests/cpu",
    ),
    "memory with a space": (
        {"agent": {"resources": {"limits": {"memory": "1 GB"}}}},
        "/agent/resources/limits/memory",
    ),
    "negative quantity": (
        {"agent": {"resources": {"requests": {"cpu": -1}}}},
        "/agent/resources/requests/cpu",
    ),
    "misspelt requests": (
        {"controller": {"resources": {"request": {"cpu": 1}}}},
        "additional properties 'request' not allowed",
    ),
    "nodeSelector value a bool": (
        {"controller": {"nodeSelector": {"kubernetes.io/x": True}}},
        "/controller/nodeSelector/kubernetes.io~1x': got boolean, want string",
    ),
    "agent nodeSelector a bool": (
        {"agent": {"nodeSelector": {"nvidia.com/gpu.present": True}}},
        "/agent/nodeSelector/nvidia.com~1gpu.present': got boolean, want string",
    ),
    "pod label a number": ({"agent": {"podLabels": {"v": 1}}}, "/agent/podLabels/v"),
    "pod label key with a space": (
        {"controller": {"podLabels": {"bad key": "x"}}},
        "'bad key' does not match pattern",
    ),
    "pod label value too long": (
        {"controller": {"podLabels": {"k": "a" * 64}}},
        "/controller/podLabels/k': maxLength",
    ),
    "pod label value with a colon": (
        {"agent": {"podLabels": {"k": "a: b"}}},
        "/agent/podLabels/k",
    ),
    "pod label overriding the selector": (
        {"controller": {"podLabels": {"app.kubernetes.io/component": "agent"}}},
        "app.kubernetes.io/component is set by the chart",
    ),
    "pod label overriding the leader label": (
        {"controller": {"podLabels": {"trainguard.io/leader": "true"}}},
        "trainguard.io/leader is set by the chart",
    ),
    "common label overriding the instance": (
        {"commonLabels": {"app.kubernetes.io/instance": "other"}},
        "app.kubernetes.io/instance is set by the chart",
    ),
    "annotation a number": (
        {"controller": {"podAnnotations": {"prometheus.io/port": 8470}}},
        "got number, want string",
    ),
    "node selector key invalid": (
        {"agent": {"nodeSelector": {"a/b/c": "x"}}},
        "'a/b/c' does not match pattern",
    ),
    "tag 1.10 unquoted (YAML: 1.1)": ({"image": {"tag": 1.10}}, "/image/tag': got number"),
    "tag an integer": ({"image": {"tag": 2}}, "/image/tag': got number"),
    "registry with a trailing slash": (
        {"image": {"registry": "reg.example.com/"}},
        "/image/registry",
    ),
    "repository empty": ({"controller": {"image": {"repository": ""}}}, "/controller/image"),
    "storage class that breaks YAML": (
        {"database": {"sqlite": {"persistence": {"enabled": True, "storageClass": "a: b"}}}},
        "/database/sqlite/persistence/storageClass",
    ),
    "fullnameOverride not a DNS label": ({"fullnameOverride": "Bad_Name"}, "/fullnameOverride"),
    "nameOverride with a space": ({"nameOverride": "a b"}, "/nameOverride"),
    "priority class with a space": (
        {"controller": {"priorityClassName": "Foo Bar"}},
        "/controller/priorityClassName",
    ),
    # The controller refuses a token that is not printable ASCII without spaces at start
    # (controller.settings): a pasted line break or space must fail the install, not loop
    # the controller pod in CrashLoopBackOff.
    "API token with a line break": (
        {"auth": {"tokens": [{"name": "a", "role": "agent", "token": "x" * 16 + "\n"}]}},
        "/auth/tokens/0/token",
    ),
    "API token with a space": (
        {"auth": {"tokens": [{"name": "a", "role": "viewer", "token": "abcd efgh ijkl mnop"}]}},
        "/auth/tokens/0/token",
    ),
    "agent token with a space": (
        {"auth": {"agentToken": "abcd efgh ijkl mnop"}},
        "/auth/agentToken",
    ),
    "top-level typo": ({"controler": {"replicas": 2}}, "additional properties 'controler'"),
    "nested typo": ({"agent": {"enable": False}}, "additional properties 'enable'"),
    "networkPolicy typo": (
        {"networkPolicy": {"enable": True}},
        "additional properties 'enable'",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_template_and_lint(helm_bin: Path, tmp_path: Path, case: str) -> None:
    extra, message = REFUSED[case]
    values = _merge(TOKENS, extra)
    _refused(helm_bin, tmp_path, values, message)
    # Every rule above lives in values.schema.json, so lint refuses as install would.
    lint = _run_helm(helm_bin, tmp_path, values, "lint", "--strict", str(CHART))
    assert lint.returncode != 0, lint.stdout
    assert message in lint.stdout + lint.stderr


def test_global_is_allowed(helm_bin: Path, tmp_path: Path) -> None:
    # Helm passes `global` to every chart; a parent chart may set it.
    _render(helm_bin, tmp_path, _merge(TOKENS, {"global": {"imageRegistry": "x"}}))


# -- names at the limits ----------------------------------------------------------------------

LONG_RELEASE = "r" * 53  # Helm's own limit for a release name
NAME_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "53-character release": (LONG_RELEASE, {}),
    "52-character release (full name exactly 63)": ("x" * 52, {}),
    "release holding the chart name": ("my-trainguard", {}),
    "63-character fullnameOverride": ("tg", {"fullnameOverride": "f" * 63}),
    "long nameOverride": ("tg", {"nameOverride": "n" * 63}),
}


@pytest.mark.parametrize("case", NAME_CASES)
def test_long_names_stay_valid_and_distinct(helm_bin: Path, tmp_path: Path, case: str) -> None:
    release, extra = NAME_CASES[case]
    everything = _merge(
        TOKENS,
        _merge(
            PG,
            {
                "networkPolicy": {"enabled": True},
                "controller": {"podDisruptionBudget": {"enabled": True}},
                "agent": {"jobEndpoint": {"jobNamespaces": ["team-a"]}},
            },
        ),
    )
    _, docs = _render(helm_bin, tmp_path, _merge(everything, extra), release=release)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind in ("Service", "ServiceAccount", "NetworkPolicy"):
        # The controller's and the agents' objects of one kind: both there, not one name.
        assert len([n for k, n in names if k == kind and "hook" not in n]) == 2, (kind, names)
    deployment = _workload(docs, "Deployment")
    daemonset = _workload(docs, "DaemonSet")
    agent_sa = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    assert agent_sa.endswith("-agent") and daemonset["metadata"]["name"] == agent_sa
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    # The controller accepts the agents' tokens by their ServiceAccount's name.
    assert json.loads(env["TRAINGUARD_KUBE_AGENT_SERVICE_ACCOUNTS"]["value"]) == [
        f"system:serviceaccount:{NAMESPACE}:{agent_sa}"
    ]
    jobs = {d["metadata"]["name"] for d in docs if d["kind"] == "Job"}
    assert {j for j in jobs if j.endswith(("-migrate", "-leader-hook"))} == jobs
    assert len(jobs) == 2
    assert all(DNS_LABEL.match(n) for k, n in names if k in DNS_LABEL_KINDS)
    # Deterministic: the same values give the same names.
    _, again = _render(helm_bin, tmp_path, _merge(everything, extra), release=release)
    assert {(d["kind"], d["metadata"]["name"]) for d in again} == names


def test_name_collision_refused(helm_bin: Path, tmp_path: Path) -> None:
    # A full name that ends in "-agent" at 62 characters is the agents' name too.
    _refused(
        helm_bin,
        tmp_path,
        _merge(TOKENS, {"fullnameOverride": "f" * 56 + "-agent"}),
        "the agents' objects would be named",
    )


# -- RBAC, NetworkPolicy and agent toggles combined ---------------------------------------------

TOGGLES = list(
    itertools.product(
        [False, True],  # PostgreSQL
        [False, True],  # controller.leaderLabel.enabled
        [False, True],  # agent.enabled
        ["kubernetes", "none"],  # controller.actuator
        [False, True],  # rbac.create
    )
)


@pytest.mark.parametrize(
    "postgres,leader,agent,actuator,rbac",
    TOGGLES,
    ids=[f"pg={p}-leader={ll}-agent={a}-act={ac}-rbac={r}" for p, ll, a, ac, r in TOGGLES],
)
def test_toggles_leave_no_dangling_reference(
    helm_bin: Path,
    tmp_path: Path,
    postgres: bool,
    leader: bool,
    agent: bool,
    actuator: str,
    rbac: bool,
) -> None:
    values = _merge(
        TOKENS,
        {
            "controller": {"leaderLabel": {"enabled": leader}, "actuator": actuator},
            "agent": {"enabled": agent},
            "rbac": {"create": rbac},
            "networkPolicy": {"enabled": True, "metricsNamespace": "monitoring"},
        },
    )
    if postgres:
        values = _merge(values, PG)
    _, docs = _render(helm_bin, tmp_path, values)  # _check_references runs inside
    kinds = Counter(d["kind"] for d in docs)
    assert kinds["DaemonSet"] == int(agent)
    # RBAC only where asked for, and only for what runs.
    leader_on = postgres and leader
    if not rbac:  # only the leader hook's own Role (a hook object, always brought along)
        assert kinds["ClusterRole"] == kinds["ClusterRoleBinding"] == 0
        assert kinds["Role"] == kinds["RoleBinding"] == int(leader_on)
    elif actuator == "none":  # no actuator rules; the TokenReview grant where agents run
        assert not [d for d in docs if d["metadata"]["name"].endswith(("-nodes", "-jobs"))]
    assert (kinds["Job"] >= 1) == postgres  # migrate (and the leader hook with leader_on)
    hook = [d for d in docs if d["metadata"]["name"].endswith("-leader-hook")]
    assert bool(hook) == leader_on
    service = [d for d in docs if d["kind"] == "Service" and "agent" not in d["metadata"]["name"]]
    assert ("trainguard.io/leader" in service[0]["spec"]["selector"]) == leader_on


def test_operator_service_account(helm_bin: Path, tmp_path: Path) -> None:
    # serviceAccount.create=false with a name: bindings name the operator's account, which
    # the chart does not render (the reference check allows it for EXTERNAL_SAS only).
    values = _merge(TOKENS, {"serviceAccount": {"create": False, "name": "ops-sa"}})
    _, docs = _render(helm_bin, tmp_path, values)
    assert _pod_spec(docs, "Deployment")["serviceAccountName"] == "ops-sa"
    assert not [
        d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "ops-sa"
    ]
    subjects = {s["name"] for d in docs if d["kind"].endswith("Binding") for s in d["subjects"]}
    assert "ops-sa" in subjects
