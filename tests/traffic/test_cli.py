from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainguard.cli.cmd_plan import app

runner = CliRunner()


@pytest.fixture
def fabric_file(tmp_path: Path) -> Path:
    p = tmp_path / "fabric.yaml"
    p.write_text(
        "name: t\nfat_tree:\n  nodes: 8\n  nics_per_node: 2\n  ports_per_nic: 2\n"
        "  nodes_per_leaf: 4\n  oversubscription: 2\n"
    )
    return p


def test_simulate_table_and_json(fabric_file: Path) -> None:
    args = ["simulate", "-t", str(fabric_file), "--seeds", "3", "--placement", "shuffled"]
    res = runner.invoke(app, [*args, "--compute-s", "0.25"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == [
        "VARIANT",
        "ALLREDUCE_MS",
        "ALGBW_GBPS",
        "BUSBW_GBPS",
        "STEP_S",
        "PCT_OF_IDEAL",
    ]
    assert [ln.split()[0] for ln in lines[1:]] == [
        "ecmp-median",
        "ecmp-p95",
        "ecmp-topology-order-median",
        "ours",
        "ideal",
    ]
    res = runner.invoke(app, [*args, "-o", "json", "--tp", "2", "--gpus", "16"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    names = [v["name"] for v in data["variants"]]
    assert names[-2:] == ["ours", "ideal"]
    ours, ideal = data["variants"][-2:]
    assert ours["busbw_bytes_per_s"] <= ideal["busbw_bytes_per_s"] * (1 + 1e-9)
    # one node: everything rides NVLink, the network has nothing to do
    res = runner.invoke(app, [*args, "-o", "json", "--gpus", "8"])
    assert res.exit_code == 0, res.output
    assert all(v["allreduce_s"] == 0 for v in json.loads(res.output)["variants"])


def test_create_then_show(fabric_file: Path, tmp_path: Path) -> None:
    out, qmap = tmp_path / "plan.json", tmp_path / "qp.json"
    res = runner.invoke(
        app,
        [
            "create",
            "-t",
            str(fabric_file),
            "--out",
            str(out),
            "--qp-map",
            str(qmap),
            "--link-down",
            "leaf-g000-r0-p0--spine-000",
            "--placement",
            "shuffled",
        ],
    )
    assert res.exit_code == 0, res.output
    plan = json.loads(out.read_text())
    assert plan["version"] == 2 and plan["changes"][0]["health"] == 0.0
    assert all("leaf-g000-r0-p0->spine-000" not in f["path"] for f in plan["flows"])
    qp = json.loads(qmap.read_text())
    assert qp["format"] == "trainguard.traffic.qpmap/v1"
    assert sum(len(v) for v in qp["nodes"].values()) == len(plan["flows"])
    res = runner.invoke(app, ["show", str(out)])
    assert res.exit_code == 0
    assert res.output.split()[:2] == ["PLAN", plan["plan_id"]]
    res = runner.invoke(app, ["show", str(out), "-o", "json"])
    assert json.loads(res.output)["plan_id"] == plan["plan_id"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["simulate", "-t", "/nonexistent.yaml"], "No such file"),
        (["simulate", "-t", "{fabric}", "--tp", "3"], "does not divide"),
        (["simulate", "-t", "{fabric}", "--gpus", "999"], "job needs"),
        (["simulate", "-t", "{fabric}", "--hash", "md5"], "hash.function"),
        (["simulate", "-t", "{bad}"], "fat_tree.nodes"),
        (["create", "-t", "{fabric}", "--out", "{out}", "--link-down", "x--y"], "unknown link"),
        (["simulate", "-t", "{fabric}", "--job", "{job}"], "channels"),
        (["show", "{fabric}"], "not JSON"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, fabric_file: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("fat_tree:\n  nodes: 0\n")
    job = tmp_path / "job.yaml"
    job.write_text("tp: 2\nchannels: 0\n")
    subst = {
        "{fabric}": str(fabric_file),
        "{bad}": str(bad),
        "{out}": str(tmp_path / "o.json"),
        "{job}": str(job),
    }
    res = runner.invoke(app, [subst.get(a, a) for a in args])
    assert res.exit_code == 2, res.output
    err = res.stderr if res.stderr_bytes is not None else res.output
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err


def test_cli_surface_is_frozen() -> None:
    import typer.main

    group = typer.main.get_command(app)
    commands = sorted(group.commands)  # type: ignore[attr-defined]
    assert commands == ["create", "get", "list", "show", "simulate"]
    flags = {
        name: sorted(o for p in cmd.params for o in p.opts)
        for name, cmd in group.commands.items()  # type: ignore[attr-defined]
    }
    assert flags["simulate"] == sorted(
        [
            "--topology",
            "-t",
            "--job",
            "-j",
            "--gpus",
            "--placement",
            "--placement-seed",
            "--tp",
            "--pp",
            "--size-mib",
            "--channels",
            "--qps",
            "--seeds",
            "--compute-s",
            "--hash",
            "--output",
            "-o",
        ]
    )
    assert "--link-down" in flags["create"] and "--qp-map" in flags["create"]
    # API-backed: the rest of the CLI's connection and output flags (plan ID is an argument).
    client = sorted(["--server", "--token", "--output", "-o"])
    assert flags["list"] == client and flags["get"] == sorted([*client, "plan_id"])
