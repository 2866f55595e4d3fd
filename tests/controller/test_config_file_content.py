"""The CONTENT of the files an operator hands the controller: each mistake is one line that
names the file and the field, and the controller refuses to start; never a start with a
config other than the one written, a traceback or a hang.

Swept by hand over the controller config file, ``tokens_file``, the webhook secret file,
``policy_file``, ``local_jobs_file``, ``topology_file``, ``topology_labels`` and
``power_domains_file``: empty files, invalid YAML/JSON, the wrong top-level type, unknown
keys, numbers out of range (negative, 0, NaN, Infinity, 1e308), duplicate keys, deep
nesting, non-UTF-8 bytes, a byte-order mark, very long strings and names Kubernetes would
refuse. Most were already refused well (tests/test_operator_files.py, tests/cli); the cases
here are the ones that were not:

* config file: ``Port:`` and ``port:`` (settings match case-insensitively) kept one value
  and dropped the other without a word;
* ``kube_namespace`` / ``leader_lease_namespace`` that are no Kubernetes namespace were
  accepted, to fail at the first cordon or Lease write;
* ``ingest_flush_interval_s`` had no upper bound: ``1e308`` held every report until
  ``ingest_flush_max_rows`` rows queued;
* ``tokens_file``: an invalid entry's error named neither the file nor the entry, and a
  token with a space or a trailing newline was accepted though no request can present it;
* ``local_jobs_file``: a job or node name the wire refuses (``My Job``, ``a/b``) was
  accepted, then every report of the job got 422 and its rank logs could not be opened;
* ``topology_labels``: ``spines: 2.7`` became 2 spines, ``true`` became 1;
* ``power_domains_file``: an error in the tree did not name the file (and said the field
  twice).

The special files themselves (FIFOs, devices, huge or dangling paths) are
tests/test_special_files.py's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from controller.errors import BadConfig
from controller.logic.remediation.rules import PolicyError
from controller.services.remediation.wiring import load_local_jobs
from controller.services.traffic.labels import label_fabric
from trainguard.cli.cmd_serve import controller_settings
from trainguard.cli.errors import BadInput

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.timeout(60)

TOKEN = "t" * 32
TOKENS_ENV = '[{"name": "v", "role": "viewer", "token": "' + TOKEN + '"}]'


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TRAINGUARD_"):
            monkeypatch.delenv(name)


def _refused(tmp_path: Path, **given: object) -> str:
    """``controller_settings`` (what ``trainguard controller`` runs first) refusing: the one
    line it exits 2 with."""
    with pytest.raises(BadInput) as caught:
        controller_settings(database_url=f"sqlite:///{tmp_path}/t.db", **given)
    assert caught.value.exit_code == 2
    message = caught.value.message
    assert "\n" not in message and "Traceback" not in message, message
    return message


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "controller.yaml"
    path.write_text(text)
    monkeypatch.setenv("TRAINGUARD_CONFIG_FILE", str(path))
    monkeypatch.setenv("TRAINGUARD_TOKENS", TOKENS_ENV)
    return path


# ---------------------------------------------------------------------- the config file


def test_a_setting_given_twice_in_different_case_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _config(tmp_path, monkeypatch, "Port: 8471\nport: 8472\n")
    assert _refused(tmp_path) == (
        f"config file {path}: setting 'port' given twice ('Port' and 'port'; names are "
        "case-insensitive)"
    )


def test_a_setting_in_upper_case_alone_still_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _config(tmp_path, monkeypatch, "PORT: 8471\n")
    settings = controller_settings(database_url=f"sqlite:///{tmp_path}/t.db")
    assert settings.port == 8471


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("kube_namespace: Not_A_Namespace\n", "kube_namespace"),
        ("kube_namespace: a/b\n", "kube_namespace"),
        ("leader_lease_namespace: UPPER\n", "leader_lease_namespace"),
    ],
)
def test_a_namespace_kubernetes_would_refuse_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, field: str
) -> None:
    _config(tmp_path, monkeypatch, line)
    assert _refused(tmp_path).startswith(f"invalid controller settings: {field}: String should")


def test_good_namespaces_still_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _config(tmp_path, monkeypatch, "kube_namespace: train-1\nleader_lease_namespace: ''\n")
    settings = controller_settings(database_url=f"sqlite:///{tmp_path}/t.db")
    assert (settings.kube_namespace, settings.leader_lease_namespace) == ("train-1", "")


def test_an_ingest_flush_interval_past_the_agents_timeout_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _config(tmp_path, monkeypatch, "ingest_flush_interval_s: 1.0e+308\n")
    assert _refused(tmp_path) == (
        "invalid controller settings: ingest_flush_interval_s: Input should be less than or "
        "equal to 5"
    )


# ---------------------------------------------------------------------- the tokens file


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        (f"- {{name: a, role: viewer, token: {TOKEN}, rolee: x}}\n", "[0].rolee: Extra inputs"),
        ("- hello\n", "[0]: Input should be a valid dictionary"),
        (
            f"- {{name: a, role: viewer, token: {TOKEN}}}\n- {{name: b, role: viewer}}\n",
            "[1]: token 'b': give exactly one of 'token' or 'sha256'",
        ),
        (f"- {{name: a, role: admin, token: {TOKEN}}}\n", "[0].role: Input should be"),
        ("- {name: a, role: viewer, sha256: zz}\n", "[0].sha256: sha256 must be 64 hex"),
    ],
)
def test_a_bad_token_entry_names_the_file_and_the_entry(
    tmp_path: Path, entries: str, problem: str
) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(entries)
    message = _refused(tmp_path, tokens_file=path)
    assert message.startswith(f"invalid controller settings: tokens_file {path}: {problem}")


@pytest.mark.parametrize("token", [f"{TOKEN}\\n", f" {TOKEN} ", f"{TOKEN[:16]} {TOKEN[16:]}"])
def test_a_token_no_authorization_header_can_carry_is_refused(tmp_path: Path, token: str) -> None:
    """A YAML block scalar (``token: |``) keeps the newline; the server strips the presented
    credential and a header cannot carry a newline, so such a token never matched."""
    path = tmp_path / "tokens.yaml"
    path.write_text(f'- {{name: a, role: viewer, token: "{token}"}}\n')
    message = _refused(tmp_path, tokens_file=path)
    assert message.startswith(f"invalid controller settings: tokens_file {path}: [0].token: ")


def test_token_names_given_twice_are_named(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        f"- {{name: a, role: viewer, token: {TOKEN}}}\n"
        f"- {{name: a, role: agent, token: {TOKEN}x}}\n"
    )
    assert _refused(tmp_path, tokens_file=path) == (
        "invalid controller settings: token names must be unique ('a' twice)"
    )


# ---------------------------------------------------------------------- the power domains


def test_a_bad_power_domain_tree_names_the_file_once(tmp_path: Path) -> None:
    path = tmp_path / "domains.yaml"
    path.write_text("name: row1\nkind: row\nbudget_w: 100\nbudgetw: 5\n")
    message = _refused(tmp_path, dev_mode=True, power_domains_file=path)
    assert message.startswith(
        f"invalid controller settings: power_domains_file: {path}: domains.budgetw: unknown key"
    )
    path.write_text("[1, 2]\n")
    assert _refused(tmp_path, dev_mode=True, power_domains_file=path) == (
        f"invalid controller settings: power_domains_file: {path}: domains: must be a mapping "
        "with name, kind, budget_w"
    )


# ---------------------------------------------------------------------- the local jobs file

JOB = "- name: {name}\n  argv: [python, -c, pass]\n  pool: {pool}\n"


@pytest.mark.parametrize(
    ("name", "pool", "field", "bad"),
    [
        ("'My Job'", "[n0, n1]", "name", "My Job"),
        ("a/b", "[n0, n1]", "name", "a/b"),
        ("j", "['N 0', n1]", "pool", "N 0"),
        ("j", "['', n1]", "pool", ""),
        ("j", "[n0, node_1]", "pool", "node_1"),
    ],
)
def test_a_local_job_or_node_name_the_wire_refuses_is_refused(
    tmp_path: Path, name: str, pool: str, field: str, bad: str
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(JOB.format(name=name, pool=pool))
    with pytest.raises(PolicyError) as caught:
        load_local_jobs(path)
    assert str(caught.value) == (
        f"local_jobs_file {path}: [0].{field}: Value error, not a Kubernetes name (lower-case "
        f"a-z, 0-9, '-', '.'; at most 253 characters): {bad!r}"
    )


def test_a_local_job_with_kubernetes_names_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(JOB.format(name="gpt-1.b", pool="[n0, node-1.rack2]") + "  nodes: [n0]\n")
    (job,) = load_local_jobs(path)
    assert (job.name, job.first_nodes()) == ("gpt-1.b", ["n0"])


# ---------------------------------------------------------------------- topology_labels


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"spines": 2.7}, "topology_labels: spines must be a whole number, got 2.7"),
        ({"spines": True}, "topology_labels: spines must be a number, got True"),
        ({"port_speed_gbps": True}, "topology_labels: port_speed_gbps must be a number, got True"),
        ({"name": "x" * 10_000}, "topology_labels: name must be a string of 1 to 128 characters"),
        ({"name": 5}, "topology_labels: name must be a string of 1 to 128 characters"),
    ],
)
def test_topology_labels_are_not_rounded_into_another_fabric(
    raw: dict[str, object], message: str
) -> None:
    with pytest.raises(BadConfig) as caught:
        label_fabric(raw)
    assert str(caught.value) == message


def test_topology_labels_whole_numbers_still_read() -> None:
    fabric = label_fabric({"spines": 4.0, "oversubscription": 2, "name": "fab"})
    assert fabric is not None
    assert (fabric.spines, fabric.oversubscription, fabric.name) == (4, 2.0, "fab")
