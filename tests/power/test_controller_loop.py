"""The power policy in a live controller, with simulated agents as real processes.

One row over three 2-GPU servers whose simulated training load exceeds T1 of the row
budget: a low-priority node (capped through its simulated NVML), a high-priority node, and
a low-priority node whose agent may not set anything (``sim_no_permission``), so its clock
command fails, the policy escalates to the power-limit knob and raises incidents. Then the
high-priority agent stops (stale telemetry: caps held even after the budget is raised),
comes back, and the caps are lifted. Actions carry the row's power before and after.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import http_calls
from tests.environ import clean_env
from trainguard.cli.procs import Child, ProcessSet, cli_argv, wait_until

pytestmark = pytest.mark.slow

SAMPLE_S = 0.25
REPORT_S = 0.5
#: T1 as in POLCA; T2 and the brake out of reach and a wide hysteresis, so the row sits at
#: T1 through the whole test whatever the simulated load's noise does.
POLICY = {
    "min_hold_s": 2.0,
    "t2_frac": 0.97,
    "brake_frac": 1.2,
    "hysteresis_frac": 0.15,
    "stale_after_s": 2.5,
}
#: Three simulated 2-GPU H100 servers peak near 3.8 kW under the default training load.
ROW_BUDGET_W = 4600.0


def tree(row_budget_w: float) -> dict[str, Any]:
    servers = [
        {"name": n, "kind": "server", "budget_w": 10_000} for n in ("node-lp", "node-hp", "node-np")
    ]
    return {
        "name": "row-a",
        "kind": "row",
        "budget_w": row_budget_w,
        "policy": POLICY,
        "children": servers,
    }


class Cluster:
    def __init__(self, live: Any, procs: ProcessSet, workdir: Path) -> None:
        self.live = live
        self.procs = procs
        self.workdir = workdir
        self.http = http_calls.client(
            base_url=live.url, headers=live.headers("operator"), timeout=10
        )

    def start_agent(self, node: str, *, priority: str, no_permission: bool = False) -> Child:
        argv = cli_argv(
            *("agent", "--controller", self.live.url, "--token", self.live.agent_token),
            *("--node-name", node, "--gpus", "sim:2"),
            *("--spool-dir", str(self.workdir / node / "spool")),
            *("--socket-path", "", "--metrics-port", "-1"),
            *("--sample-interval", str(SAMPLE_S), "--report-interval", str(REPORT_S)),
        )
        env = clean_env()
        env["TRAINGUARD_AGENT_LABELS"] = json.dumps({"trainguard.io/priority": priority})
        env["TRAINGUARD_AGENT_BACKOFF_MAX_S"] = "0.5"
        if no_permission:
            env["TRAINGUARD_AGENT_SIM_NO_PERMISSION"] = "true"
        return self.procs.start(node, argv, env=env)

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(f"/api/v1{path}", params=params)
        r.raise_for_status()
        return r.json()

    def domains(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in self.get("/power/domains")["data"]}

    def locks(self, node: str) -> list[int | None]:
        r = self.http.get(f"/api/v1/nodes/{node}")
        if r.status_code == 404:
            return []  # before its first report
        r.raise_for_status()
        gpus = r.json()["gpus"]
        return [(g["latest"] or {}).get("locked_sm_clock_mhz") for g in gpus]

    def commands(self, node: str) -> list[dict[str, Any]]:
        return list(self.get("/commands", node=node)["data"])

    def incidents(self, kind: str) -> list[dict[str, Any]]:
        return list(self.get("/incidents", kind=kind)["data"])

    def actions(self) -> list[dict[str, Any]]:
        return list(self.get("/actions")["data"])

    def locked(self, node: str) -> bool:
        locks = self.locks(node)
        return bool(locks) and all(m is not None for m in locks)

    def unlocked(self, node: str) -> bool:
        locks = self.locks(node)
        return bool(locks) and all(m is None for m in locks)

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        if not wait_until(predicate, timeout_s=timeout_s, interval_s=0.2):
            logs = "\n".join(f"--- {c.name}\n{c.log_tail(8)}" for c in self.procs.children.values())
            raise AssertionError(f"timed out waiting for {what}\n{self.domains()}\n{logs}")


@pytest.fixture
def cluster(controller_factory: Any, tmp_path: Path) -> Iterator[Cluster]:
    path = tmp_path / "domains.yaml"
    path.write_text(yaml.safe_dump(tree(ROW_BUDGET_W)))
    live = controller_factory(
        power_domains_file=path, power_tick_interval_s=0.25, command_expire_after_s=60.0
    )
    with ProcessSet(tmp_path / "logs") as procs:
        c = Cluster(live, procs, tmp_path)
        yield c
        c.http.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_caps_escalation_stale_hold_and_uncap(cluster: Cluster) -> None:
    c = cluster
    c.start_agent("node-lp", priority="low")
    c.start_agent("node-hp", priority="high")
    c.start_agent("node-np", priority="low", no_permission=True)

    # Load above T1: the low-priority GPUs get locked clocks through the simulated NVML.
    c.wait("node-lp GPUs locked", lambda: c.locked("node-lp"))
    row = c.domains()["row-a"]
    print("row at cap:", row["power_w"], row["utilization_pct"], row["level"])
    assert row["level"] == "T1"
    assert max(m for m in c.locks("node-lp") if m is not None) <= 1800  # H100 LP cap at T1
    c.wait(
        "capped GPUs in the view",
        lambda: set(c.domains()["row-a"]["capped_gpus"]) >= {"node-lp:gpu0", "node-lp:gpu1"},
    )

    # The agent without permission: the clock command fails, the policy moves to the
    # power-limit knob (which fails too) and raises incidents.
    c.wait(
        "clock failure incident on node-np",
        lambda: any(i["node"] == "node-np" for i in c.incidents("power_clock_command_failed")),
    )

    def lock_np_commands() -> list[dict[str, Any]]:
        return [x for x in c.commands("node-np") if x["kind"] == "lock_clocks"]

    # The incident comes with the first GPU's failure; the other GPU's command may still be
    # on its way (a race in this test, seen once under load): wait until none is in flight.
    in_flight = {"pending", "sent", "relayed"}
    c.wait(
        "node-np's clock commands ended",
        lambda: all(x["status"] not in in_flight for x in lock_np_commands()),
    )
    lock_np = lock_np_commands()
    assert lock_np and all(x["status"] == "failed" for x in lock_np)
    assert "permission" in lock_np[0]["reason"].lower()
    c.wait(
        "power-limit command to node-np",
        lambda: any(x["kind"] == "set_power_limit" for x in c.commands("node-np")),
    )
    assert c.unlocked("node-np")
    c.wait(
        "no knob left on node-np",
        lambda: any(
            i["node"] == "node-np" and i["severity"] == "critical"
            for i in c.incidents("power_limit_command_failed")
        ),
    )
    # The capped node now draws less than the uncapped one under the same load.
    c.wait(
        "node-lp below node-hp",
        lambda: c.domains()["node-lp"]["power_w"] < 0.9 * c.domains()["node-hp"]["power_w"],
    )

    from power.cli import status_table

    print(status_table(c.get("/power/domains")))

    # Every cap is an Action; the row's power after and the time until it showed follow.
    def lp_cap_with_effect() -> dict[str, Any] | None:
        for a in c.actions():
            p = a["params"]
            if a["kind"] == "power_cap" and a["target"] == "node-lp:gpu0" and "power_after_w" in p:
                return a
        return None

    c.wait("effect on the node-lp cap action", lambda: lp_cap_with_effect() is not None)
    cap = lp_cap_with_effect()
    assert cap is not None
    p = cap["params"]
    assert cap["status"] == "succeeded"
    assert cap["trigger"].startswith("power:row-a:")
    assert p["knob"] == "clocks" and p["clock_mhz"] <= 1800
    assert p["effect_observed"] is True
    assert p["power_after_w"] <= p["power_before_w"] - 0.01 * p["budget_w"]
    assert p["reflected_after_s"] is not None and p["reflected_after_s"] >= 0
    c.wait(
        "level change effect on the cap",
        lambda: "level_change" in (lp_cap_with_effect() or {}).get("params", {}),
    )
    change = (lp_cap_with_effect() or {})["params"]["level_change"]
    assert change["domain"] == "row-a" and change["from"] == "NONE" and change["to"] == "T1"
    failed = [a for a in c.actions() if a["target"].startswith("node-np:")]
    assert failed and all(a["status"] in ("failed", "pending") for a in failed)
    assert any(a["status"] == "failed" for a in failed)

    # Stale telemetry: the high-priority agent stops. The row is stale; raising the budget
    # must not lift the caps while it is.
    c.procs.stop("node-hp")
    c.wait("row-a stale", lambda: c.domains()["row-a"]["stale"])
    c.wait("stale incident", lambda: len(c.incidents("power_telemetry_stale")) > 0)
    r = c.http.put("/api/v1/power/domains", json=tree(100_000.0))
    assert r.status_code == 200, r.text
    assert r.json()["source"] == "api"
    time.sleep(POLICY["min_hold_s"] + 2.0)
    assert c.locked("node-lp"), "caps lifted on stale telemetry"
    assert not any(x["kind"] == "unlock_clocks" for x in c.commands("node-lp"))

    # Telemetry back: the caps come off, recorded as uncap actions.
    c.start_agent("node-hp", priority="high")
    c.wait("node-lp unlocked", lambda: c.unlocked("node-lp"))
    assert c.domains()["row-a"]["level"] == "NONE"

    def uncaps() -> list[dict[str, Any]]:
        return [
            a
            for a in c.actions()
            if a["kind"] == "power_uncap"
            and a["target"].startswith("node-lp:")
            and a["status"] == "succeeded"
            and a["params"].get("effect_observed")
        ]

    c.wait("uncap actions succeeded", lambda: len(uncaps()) == 2)
    for u in uncaps():
        q = u["params"]
        assert q["command"] == "unlock_clocks" and q["domain"] == "node-lp"
        assert q["power_after_w"] >= q["power_before_w"] + 0.01 * 10_000
    uncap_s = uncaps()[0]["params"]["reflected_after_s"]
    c.wait(
        "stale incident resolved",
        lambda: (
            not c.incidents("power_telemetry_stale")
            or all(i["state"] == "resolved" for i in c.incidents("power_telemetry_stale"))
        ),
    )
    latency = c.get("/power/domains")["actuation_latency"]
    assert latency["samples"] > 0 and latency["p50_s"] is not None
    print(
        f"measured: command->ack p50 {latency['p50_s']:.3f}s p99 {latency['p99_s']:.3f}s; "
        f"cap reflected after {p['reflected_after_s']:.3f}s, uncap after {uncap_s:.3f}s"
    )
