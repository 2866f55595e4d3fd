"""The power endpoints of a live controller: view, replace (validated, persisted), priority."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.settings import ControllerSettings
from power.domains import MAX_DOMAINS
from tests import http_calls
from trainguard import wire

TREE: dict[str, Any] = {
    "name": "row-a",
    "kind": "row",
    "budget_w": 3000,
    "policy": {"t2_frac": 0.93},
    "children": [
        {"name": "node-1", "kind": "server", "budget_w": 2000},
        {"name": "node-2", "kind": "server", "budget_w": 2000},
    ],
}


def _report(node: str, seq: int, power_w: float) -> dict[str, Any]:
    gpu = wire.GpuInfo(index=0, uuid=f"GPU-{node}", name="NVIDIA H100 80GB HBM3")
    identity = wire.NodeIdentity(
        name=node, gpus=[gpu], backend="sim", labels={"trainguard.io/priority": "low"}
    )
    sample = wire.NodeSample(time_unix_s=1.0, gpus=[wire.GpuSample(index=0, power_w=power_w)])
    report = wire.Report(
        node=identity, agent_instance="i1", seq=seq, sent_unix_s=1.0, samples=[sample]
    )
    return report.model_dump(mode="json")


def _check_status_cli(live: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli.app import run

    capsys.readouterr()
    argv = ["power", "status", "--server", live.url, "--token", live.viewer_token]
    assert run(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "DOMAIN", "BUDGET-W", "POWER-W", "UTIL", "LEVEL", "CAPPED-GPUS", "STALE"
    ]  # fmt: skip
    assert lines[1].split() == ["row-a", "3000", "1200", "40.0%", "NONE", "0", "no"]
    assert lines[2].split()[0] == "node-1" and lines[2].startswith("  node-1")
    assert run(["power", "status", "--server", live.url, "--token", "wrong-token-xxxxxxxx"]) != 0


def test_put_get_persist_and_priority(
    controller_factory: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    live = controller_factory()
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"))
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"))
    agent = http_calls.client(base_url=live.url, headers=live.headers("agent"))
    try:
        empty = viewer.get("/api/v1/power/domains").json()
        assert empty["source"] == "none" and empty["count"] == 0 and not empty["enabled"]

        bad = {**TREE, "children": [{"name": "node-1", "kind": "server", "budget_w": -5}]}
        r = op.put("/api/v1/power/domains", json=bad)
        assert r.status_code == 422
        assert r.json()["detail"].startswith("body: domains.children[0].budget_w:")
        # A tree past the domain limit is refused whole, in one line, and the controller answers.
        huge = {**TREE, "children": [
            {"name": f"n{i}", "kind": "server", "budget_w": 10} for i in range(20_000)
        ]}  # fmt: skip
        r = op.put("/api/v1/power/domains", json=huge)
        assert r.status_code == 422 and "\n" not in r.json()["detail"]
        assert r.json()["detail"].endswith(f"more than {MAX_DOMAINS} domains (the limit)")
        assert viewer.put("/api/v1/power/domains", json=TREE).status_code == 403

        r = op.put("/api/v1/power/domains", json=TREE)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["source"] == "api" and body["enabled"] and body["count"] == 3
        assert body["tree"] == TREE
        row = body["data"][0]
        assert row["name"] == "row-a" and row["policy"]["t2_frac"] == 0.93

        # Readings arrive with reports; the view shows power and utilization.
        for seq, node in enumerate(("node-1", "node-2")):
            assert agent.post("/api/v1/reports", json=_report(node, seq, 600.0)).status_code == 200

        def row_power() -> float | None:
            data = viewer.get("/api/v1/power/domains").json()["data"]
            power: float | None = {d["name"]: d for d in data}["row-a"]["power_w"]
            return power

        from trainguard.cli.procs import wait_until

        assert wait_until(lambda: row_power() == 1200.0, timeout_s=10)
        row = viewer.get("/api/v1/power/domains").json()["data"][0]
        assert row["utilization_pct"] == 40.0 and row["level"] == "NONE"
        _check_status_cli(live, capsys)

        # Priority: label first, then the API override, then cleared again.
        r = op.put("/api/v1/nodes/node-1/priority", json={"priority": "high"})
        assert r.status_code == 200 and r.json() == {
            "node": "node-1",
            "priority": "high",
            "source": "api",
        }
        assert op.put("/api/v1/nodes/nope/priority", json={"priority": "low"}).status_code == 404
        r = op.put("/api/v1/nodes/node-1/priority", json={"priority": "medium"})
        assert r.status_code == 422 and "priority" in r.json()["detail"]

        # Restart: the tree and the override come back from the database.
        live.restart()
        body = viewer.get("/api/v1/power/domains").json()
        assert body["source"] == "api" and body["tree"] == TREE
        assert {k: v.value for k, v in live.controller.power.loop.priorities.items()} == {
            "node-1": "high"
        }
        # Cleared: the label rules again (the node's labels say low once it reports).
        assert agent.post("/api/v1/reports", json=_report("node-1", 5, 600.0)).status_code == 200
        r = op.put("/api/v1/nodes/node-1/priority", json={"priority": None})
        assert r.json() == {"node": "node-1", "priority": "low", "source": "label"}
    finally:
        for c in (op, viewer, agent):
            c.close()


def test_bad_domains_file_is_a_one_line_settings_error(tmp_path: Path) -> None:
    path = tmp_path / "domains.yaml"
    path.write_text("name: row-a\nkind: row\nbudget_w: 0\n")
    with pytest.raises(ValueError) as info:
        ControllerSettings(dev_mode=True, power_domains_file=path)
    # The field (pydantic's location; the CLI prefixes it once) and the file are named.
    assert "power_domains_file\n" in str(info.value) and f"{path}: " in str(info.value)
    assert "domains.budget_w: must be a positive number of watts" in str(info.value)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_domains_file_wins_at_start(controller_factory: Any, tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "domains.yaml"
    path.write_text(yaml.safe_dump(TREE))
    live = controller_factory(
        power_domains_file=path, power_enabled=False, power_tick_interval_s=0.1
    )
    with (
        http_calls.client(base_url=live.url, headers=live.headers("viewer")) as viewer,
        http_calls.client(base_url=live.url, headers=live.headers("agent")) as agent,
    ):
        body = viewer.get("/api/v1/power/domains").json()
        assert body["source"] == "file" and body["tree"] == TREE and body["enabled"] is False
        assert [d["name"] for d in body["data"]] == ["row-a", "node-1", "node-2"]
        # Disabled: far above the budget, power is shown but nothing is capped.
        for seq, node in enumerate(("node-1", "node-2")):
            assert agent.post("/api/v1/reports", json=_report(node, seq, 1900.0)).status_code == 200

        def row() -> dict[str, Any]:
            data: list[dict[str, Any]] = viewer.get("/api/v1/power/domains").json()["data"]
            return data[0]

        from trainguard.cli.procs import wait_until

        assert wait_until(lambda: row()["power_w"] == 3800.0, timeout_s=10)
        assert row()["level"] == "NONE" and row()["stale"] is False
        assert viewer.get("/api/v1/commands").json()["count"] == 0


def _job_report(node: str, seq: int, power_w: float, *, start_job: bool = False) -> dict[str, Any]:
    """A low-labelled node with two GPUs; ``start_job``: rank 0 of train-a starts on GPU 0."""
    gpus = [
        wire.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3")
        for i in range(2)
    ]
    identity = wire.NodeIdentity(
        name=node, gpus=gpus, backend="sim", labels={"trainguard.io/priority": "low"}
    )
    sample = wire.NodeSample(
        time_unix_s=1.0 + seq,
        gpus=[wire.GpuSample(index=i, power_w=power_w) for i in range(2)],
    )
    events = [
        wire.RankEvent(
            job="train-a", rank=0, kind="started", time_unix_s=1.0, gpu_index=0, world_size=1
        )
    ]
    report = wire.Report(
        node=identity,
        agent_instance="i1",
        seq=seq,
        sent_unix_s=1.0 + seq,
        samples=[sample],
        job=wire.JobRecords(rank_events=events if start_job else []),
    )
    return report.model_dump(mode="json")


def test_job_priority_overrides_the_node_on_its_gpus(controller_factory: Any) -> None:
    from trainguard.cli.procs import wait_until

    # The timer ticks 5 times a second: the wait for one after the last report is short.
    live = controller_factory(power_tick_interval_s=0.2)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"))
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"))
    agent = http_calls.client(base_url=live.url, headers=live.headers("agent"))
    tree = {
        "name": "row-a",
        "kind": "row",
        "budget_w": 1000,
        "children": [{"name": "node-1", "kind": "server", "budget_w": 2000}],
    }
    try:
        body = {"priority": "high"}
        r = op.put("/api/v1/jobs/train-a/priority", json=body)
        assert r.status_code == 404 and "no power domains" in r.json()["detail"]
        assert op.put("/api/v1/power/domains", json=tree).status_code == 200
        # A quiet row (40%), and the job's rank 0 starts on node-1's GPU 0.
        r = agent.post("/api/v1/reports", json=_job_report("node-1", 0, 200.0, start_job=True))
        assert r.status_code == 200
        assert wait_until(
            lambda: viewer.get("/api/v1/jobs/train-a").status_code == 200, timeout_s=10
        )

        assert viewer.put("/api/v1/jobs/train-a/priority", json=body).status_code == 403
        r = op.put("/api/v1/jobs/nope/priority", json=body)
        assert r.status_code == 404 and "job 'nope' not found" in r.json()["detail"]
        r = op.put("/api/v1/jobs/train-a/priority", json={"priority": "urgent"})
        assert r.status_code == 422
        r = op.put("/api/v1/jobs/train-a/priority", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == {"job": "train-a", "priority": "high", "applies_to": ["node-1:gpu0"]}

        # The row crosses T1 (84%): the node is labelled low, but GPU 0 runs a high-priority
        # job, so only GPU 1 gets the low-priority cap.
        assert agent.post("/api/v1/reports", json=_job_report("node-1", 1, 420.0)).status_code

        def locks() -> set[int]:
            data = viewer.get("/api/v1/commands").json()["data"]
            return {c["params"]["gpu_index"] for c in data if c["kind"] == "lock_clocks"}

        assert wait_until(lambda: bool(locks()), timeout_s=10)
        level = {d["name"]: d for d in viewer.get("/api/v1/power/domains").json()["data"]}
        assert level["row-a"]["level"] == "T1"
        assert agent.post("/api/v1/reports", json=_job_report("node-1", 2, 420.0)).status_code
        # The power loop has that report, and a timer tick since: still nothing for GPU 0.
        loop = live.controller.power.loop
        assert wait_until(lambda: loop.nodes["node-1"].sample.time_unix_s == 3.0, timeout_s=10)
        live.wait_ticks("PowerLoop")
        assert locks() == {1}

        # Persisted with the tree; null removes it (the node's class applies again).
        live.restart()
        assert {k: v.value for k, v in live.controller.power.loop.job_priorities.items()} == {
            "train-a": "high"
        }
        r = op.put("/api/v1/jobs/train-a/priority", json={"priority": None})
        assert r.status_code == 200 and r.json()["priority"] is None
        assert live.controller.power.loop.job_priorities == {}
    finally:
        for c in (op, viewer, agent):
            c.close()
