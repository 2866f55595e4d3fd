"""Every read command in every output format, against a real controller with real reports."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import pytest
import yaml

from tests.cli.cli_testkit import (
    FAULTY_GPU,
    FAULTY_NODE,
    JOB,
    NODES,
    SEEDED_ACTIONS,
    CliResult,
    CliServer,
)

Cli = Callable[..., CliResult]
AGE = re.compile(r"^\d+(s|m|m\d+s|h|h\d+m|d|d\d+h|y)$")


def _rows(text: str) -> tuple[list[str], list[list[str]]]:
    """Split a kubectl-style table on runs of 3+ spaces (free text keeps single spaces)."""
    lines = text.rstrip("\n").split("\n")
    split = [re.split(r" {3,}", line.strip()) for line in lines]
    return split[0], split[1:]


def _ok(result: CliResult) -> str:
    assert result.code == 0, result.err
    assert result.err == ""
    return result.out


# ------------------------------------------------------------------ nodes


def test_nodes_table_has_kubectl_shape(cli: Cli, cli_server: CliServer) -> None:
    headers, rows = _rows(_ok(cli("nodes")))
    assert headers == [
        "NAME",
        "HEALTH",
        "GPUS",
        "UNHEALTHY-GPUS",
        "INCIDENTS",
        "LAST-REPORT",
        "AGE",
    ]
    by_name = {row[0]: dict(zip(headers, row, strict=True)) for row in rows}
    assert sorted(by_name) == sorted(NODES)
    assert by_name[FAULTY_NODE]["HEALTH"] == "unhealthy"
    assert by_name[FAULTY_NODE]["UNHEALTHY-GPUS"] == "1"
    assert by_name[FAULTY_NODE]["INCIDENTS"] == "1"
    for name in set(NODES) - {FAULTY_NODE}:
        assert by_name[name]["HEALTH"] == "healthy"
        assert by_name[name]["INCIDENTS"] == "0"
    # Every node of the test cluster runs simulated GPUs: the table says so.
    assert all(by_name[n]["GPUS"] == "8 (sim)" for n in NODES)
    assert all(AGE.match(by_name[n]["AGE"]) for n in NODES)
    assert all(AGE.match(by_name[n]["LAST-REPORT"]) for n in NODES)


def test_nodes_wide_adds_columns_and_reason_last(cli: Cli) -> None:
    headers, rows = _rows(_ok(cli("nodes", "-o", "wide")))
    assert headers[:7] == [
        "NAME",
        "HEALTH",
        "GPUS",
        "UNHEALTHY-GPUS",
        "INCIDENTS",
        "LAST-REPORT",
        "AGE",
    ]
    assert headers[7:] == ["POWER", "BACKEND", "AGENT", "HOSTNAME", "REASON"]
    row = {r[0]: dict(zip(headers, r, strict=False)) for r in rows}
    assert row[FAULTY_NODE]["BACKEND"] == "sim"
    assert row[FAULTY_NODE]["HOSTNAME"] == f"{FAULTY_NODE}.test"
    assert "79" in row[FAULTY_NODE]["REASON"]
    assert row["node-a"]["REASON"] == "-"
    assert re.fullmatch(r"\d+W", row["node-a"]["POWER"])


def test_nodes_json_and_yaml_are_the_api_objects(cli: Cli, cli_server: CliServer) -> None:
    api = cli_server.get("/nodes")
    assert isinstance(api, dict)
    assert json.loads(_ok(cli("nodes", "-o", "json"))) == api["data"]
    assert yaml.safe_load(_ok(cli("nodes", "-o", "yaml"))) == api["data"]


def test_nodes_name_and_health_filter(cli: Cli) -> None:
    assert sorted(_ok(cli("nodes", "-o", "name")).split()) == [f"node/{n}" for n in NODES]
    assert _ok(cli("nodes", "--health", "unhealthy", "-o", "name")) == f"node/{FAULTY_NODE}\n"
    empty = cli("nodes", "--health", "lost")
    assert (empty.code, empty.out, empty.err) == (0, "", "No nodes found.\n")
    assert json.loads(_ok(cli("nodes", "--health", "lost", "-o", "json"))) == []


# ------------------------------------------------------------------ node NAME


def test_node_table_describes_node_and_every_gpu(cli: Cli) -> None:
    out = _ok(cli("node", FAULTY_NODE))
    head, _, table = out.partition("\n\n")
    fields = dict(line.split(":", 1) for line in head.splitlines())
    assert fields["Name"].strip() == FAULTY_NODE
    assert fields["Health"].strip().startswith("unhealthy (")
    assert fields["GPUs"].strip() == "8 (1 unhealthy)"
    assert fields["Labels"].strip() == "rack=r1"
    headers, rows = _rows(table)
    assert headers == ["GPU", "HEALTH", "POWER", "TEMP", "SM-CLOCK", "UTIL", "MEM-USED", "REASON"]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    health = {int(r[0]): r[1] for r in rows}
    assert [i for i, h in health.items() if h != "healthy"] == [FAULTY_GPU]
    assert rows[FAULTY_GPU][-1] != "-"
    assert rows[0][2:7] == ["300W", "55C", "1980MHz", "90%", "40.0Gi"]


def test_node_wide_json_yaml_name(cli: Cli, cli_server: CliServer) -> None:
    wide = _ok(cli("node", "node-a", "-o", "wide"))
    headers, rows = _rows(wide.partition("\n\n")[2])
    assert {"UUID", "MODEL", "ECC-UNCORR", "THROTTLE"} <= set(headers)
    assert rows[0][headers.index("UUID")] == "GPU-node-a-0"
    detail = json.loads(_ok(cli("node", "node-a", "-o", "json")))
    api = cli_server.get("/nodes/node-a")
    assert isinstance(api, dict)
    assert detail["name"] == "node-a" and len(detail["gpus"]) == 8
    assert detail["gpus"] == api["gpus"]
    assert yaml.safe_load(_ok(cli("node", "node-a", "-o", "yaml")))["gpus"] == api["gpus"]
    assert _ok(cli("node", "node-a", "-o", "name")) == "node/node-a\n"


# ------------------------------------------------------------------ incidents


def test_incidents_table_shows_the_gpu_fault(cli: Cli) -> None:
    headers, rows = _rows(_ok(cli("incidents")))
    assert headers == ["ID", "KIND", "SEVERITY", "STATE", "NODE", "GPU", "JOB", "AGE", "SUMMARY"]
    faults = [dict(zip(headers, r, strict=True)) for r in rows if r[1] == "gpu_fault"]
    assert len(faults) == 1
    assert faults[0]["NODE"] == FAULTY_NODE and faults[0]["GPU"] == str(FAULTY_GPU)
    assert faults[0]["STATE"] == "open" and faults[0]["SEVERITY"] == "critical"
    assert "79" in faults[0]["SUMMARY"]
    assert AGE.match(faults[0]["AGE"])


def test_incidents_filters_and_formats(cli: Cli, cli_server: CliServer) -> None:
    api = cli_server.get("/incidents", state="open")
    assert isinstance(api, dict)
    assert json.loads(_ok(cli("incidents", "-o", "json"))) == api["data"]
    assert yaml.safe_load(_ok(cli("incidents", "-o", "yaml"))) == api["data"]
    every = cli_server.get("/incidents")
    assert isinstance(every, dict)
    assert json.loads(_ok(cli("incidents", "--state", "all", "-o", "json"))) == every["data"]
    names = _ok(cli("incidents", "--kind", "gpu_fault", "--node", FAULTY_NODE, "-o", "name"))
    ids = [i["id"] for i in api["data"] if i["kind"] == "gpu_fault"]
    assert names.split() == [f"incident/{i}" for i in ids]
    assert cli("incidents", "--node", "node-a").err == "No incidents found.\n"
    assert cli("incidents", "--job", "no-such-job").err == "No incidents found.\n"
    assert json.loads(_ok(cli("incidents", "--state", "resolved", "-o", "json"))) == []
    headers, rows = _rows(_ok(cli("incidents", "-o", "wide")))
    assert headers[-4:] == ["RANKS", "RESOLVED", "EVIDENCE", "SUMMARY"]
    # The evidence read through the controller's model of the kind (its BRIEF fields).
    (fault,) = [dict(zip(headers, r, strict=True)) for r in rows if r[1] == "gpu_fault"]
    assert fault["EVIDENCE"].startswith("reasons=XID 79"), fault


# ------------------------------------------------------------------ jobs, actions, status


def test_jobs_all_formats(cli: Cli, cli_server: CliServer) -> None:
    headers, rows = _rows(_ok(cli("jobs")))
    assert headers == ["NAME", "STATE", "RANKS", "LAST-STEP", "INCIDENTS", "AGE"]
    assert [r[0] for r in rows] == [JOB]
    assert rows[0][2] == f"{len(NODES)}/{len(NODES)}"
    assert rows[0][3] == "2"
    wide_headers, wide_rows = _rows(_ok(cli("jobs", "-o", "wide")))
    assert wide_headers[-2:] == ["LAST-SEEN", "NODES"]
    assert wide_rows[0][-1] == ",".join(sorted(NODES))
    api = cli_server.get("/jobs")
    assert isinstance(api, dict)
    assert json.loads(_ok(cli("jobs", "-o", "json"))) == api["data"]
    assert yaml.safe_load(_ok(cli("jobs", "-o", "yaml"))) == api["data"]
    assert _ok(cli("jobs", "-o", "name")) == f"job/{JOB}\n"


def test_actions_walk_every_page_in_all_formats(cli: Cli, cli_server: CliServer) -> None:
    api = cli_server.get("/actions", limit=5000)
    assert isinstance(api, dict) and api["count"] == SEEDED_ACTIONS > 500
    assert json.loads(_ok(cli("actions", "-o", "json"))) == api["data"]
    assert yaml.safe_load(_ok(cli("actions", "-o", "yaml"))) == api["data"]
    names = _ok(cli("actions", "-o", "name")).split()
    assert names == [f"action/{a['id']}" for a in api["data"]]
    created = max(a["created_unix_s"] for a in api["data"])  # an hour ago minus 509 s
    before = time.time()
    headers, rows = _rows(_ok(cli("actions")))
    after = time.time()
    assert headers == ["ID", "KIND", "TARGET", "TRIGGER", "STATUS", "AGE", "DURATION"]
    assert len(rows) == SEEDED_ACTIONS
    newest = dict(zip(headers, rows[0], strict=True))
    assert newest["TRIGGER"] == f"incident:{SEEDED_ACTIONS}"
    # Minutes since the seeding, which is as long ago as this module's earlier tests took.
    assert newest["AGE"] in {f"{int(t - created) // 60}m" for t in (before, after)}
    wide_headers, wide_rows = _rows(_ok(cli("actions", "-o", "wide")))
    assert wide_headers[7:] == ["FINISHED", "PARAMS", "OUTCOME"]
    by_trigger = {r[3]: dict(zip(wide_headers, r, strict=False)) for r in wide_rows}
    done, pending = by_trigger["incident:2"], by_trigger["incident:1"]
    assert done["STATUS"] == "succeeded" and done["OUTCOME"] == "node cordoned"
    assert done["PARAMS"] == f"gpu={FAULTY_GPU},reason=xid 79"
    assert re.fullmatch(r"\d+\.\ds", done["DURATION"])
    assert pending["STATUS"] == "pending" and pending["FINISHED"] == "-"
    assert pending["DURATION"] == "-"
    assert pending.get("OUTCOME", "-") == "-"


def test_status_formats(cli: Cli, cli_server: CliServer) -> None:
    lines = _ok(cli("status")).splitlines()
    facts = dict(re.split(r" {3,}", line, maxsplit=1) for line in lines)
    assert list(facts) == [
        "CONTROLLER",
        "VERSION",
        "DATABASE",
        "NODES",
        "GPUS",
        "JOBS",
        "INCIDENTS",
        "REPORTS",
        "UPTIME",
    ]
    assert facts["CONTROLLER"] == cli_server.url
    assert facts["DATABASE"] == "sqlite"
    assert facts["NODES"] == "3 (healthy 2, unhealthy 1)"
    assert facts["GPUS"] == "24 (1 unhealthy)"
    assert facts["INCIDENTS"].startswith("1 open (gpu_fault 1")
    assert facts["REPORTS"] == str(3 * len(NODES))
    status = json.loads(_ok(cli("status", "-o", "json")))
    api = cli_server.get("/status")
    assert isinstance(api, dict)
    assert set(status) == set(api)
    assert {k: v for k, v in status.items() if k != "uptime_s"} == {
        k: v for k, v in api.items() if k != "uptime_s"
    }
    assert yaml.safe_load(_ok(cli("status", "-o", "yaml")))["nodes_total"] == 3

    # The same facts either way; only UPTIME may tick between the two calls.
    def without_uptime(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("UPTIME")]

    assert without_uptime(_ok(cli("status", "-o", "wide"))) == without_uptime(_ok(cli("status")))


@pytest.mark.parametrize("command", ["nodes", "incidents", "jobs"])
def test_tables_are_plain_text(cli: Cli, command: str) -> None:
    out = _ok(cli(command))
    assert "\x1b[" not in out
    assert not re.search(r"[│┃─━┌┏]", out)
    assert all(line == line.rstrip() for line in out.splitlines())


# ------------------------------------------------------------------ remediation


def test_remediation_policy_and_goodput_commands(cli: Cli, cli_server: CliServer) -> None:
    """The session's controller runs with the policy switched off and no goodput yet."""
    result = cli("remediation")
    assert result.code == 0, result.err
    facts = dict(re.split(r" {3,}", line, maxsplit=1) for line in result.out.splitlines())
    assert facts["POLICY"] == "off" and facts["ACTUATOR"] == "-" and facts["LEADER"] == "true"
    assert result.err.strip() == "No remediations yet."
    api = json.loads(_ok(cli("remediation", "-o", "json")))
    assert api["enabled"] is False and api["remediations"] == []
    policy = _ok(cli("policy"))
    headers, rows = _rows(policy.split("\n\n", 1)[0])
    assert headers == [
        "KIND", "SEVERITY", "STEPS", "AFTER-S", "MIN-COST-%", "MIN-BAD-STEPS", "ISOLATE"
    ]  # fmt: skip
    assert [r[0] for r in rows] == [rule["kind"] for rule in api["policy"]["rules"]]
    nonfinite = next(r for r in rows if r[0] == "nonfinite")
    assert nonfinite[2] == "alert,capture_evidence,isolate,rollback" and nonfinite[5] == "3"
    assert "MAX_ISOLATED_FRACTION" in policy
    missing = cli("goodput", "no-such-job")
    assert missing.code == 2 and "has no goodput record" in missing.err
    # Acting needs an operator token; the session's token is a viewer's.
    forbidden = cli("isolate", "node-a", "--reason", "bad fan")
    assert forbidden.code == 1 and "forbidden" in forbidden.err
