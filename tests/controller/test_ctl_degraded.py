"""Degrading GPUs through a live controller: correctable ECC bursts and persistent hardware
throttling open one ``gpu_degraded`` warning per GPU, counter resets and our own power caps
do not, recovery resolves it, and the default policy answers with a protective checkpoint.

Sample times are set by the test (as an agent's clock would), so a 10 s throttle is ten
samples posted at once, not ten seconds of waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests import http_calls
from tests.waiting import wait_for

# Detection does not depend on the database; test_ctl_health covers both backends.
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

Factory = Callable[..., Any]
MakeReport = Callable[..., dict[str, Any]]

HOT = {"throttle_reasons": ["hw_thermal_slowdown"], "throttle_reasons_mask": 0x40}
CAPPED = {"throttle_reasons": ["sw_power_cap"], "throttle_reasons_mask": 0x4}
IDLE = {"throttle_reasons": ["gpu_idle"], "throttle_reasons_mask": 0x1}


class Agent:
    """One node's agent: reports with per-sample GPU values on its own clock."""

    def __init__(self, live: Any, make_report: Callable[..., dict[str, Any]], node: str) -> None:
        self.live = live
        self.make_report = make_report
        self.node = node
        self.seq = 0
        self.instance = "inst-1"
        self.clock = time.time() - 3600.0  # an hour behind the controller: only durations count

    def post(self, per_sample: list[dict[int, dict[str, Any]]], **extra: Any) -> dict[str, Any]:
        """One report of ``len(per_sample)`` samples 1 s apart; each maps GPU -> overrides."""
        body = self.make_report(
            self.node,
            self.seq,
            instance=self.instance,
            gpus=4,
            samples=len(per_sample),
            t0=self.clock,
            **extra,
        )
        for sample, overrides in zip(body["samples"], per_sample, strict=True):
            for gpu in sample["gpus"]:
                gpu.update(overrides.get(gpu["index"], {}))
        self.seq += 1
        self.clock += len(per_sample)
        r = http_calls.post(
            f"{self.live.url}/api/v1/reports",
            json=body,
            headers=self.live.headers("agent"),
            timeout=10,
        )
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


def _incidents(live: Any, **params: Any) -> list[dict[str, Any]]:
    r = http_calls.get(
        f"{live.url}/api/v1/incidents",
        params={"kind": "gpu_degraded", **params},
        headers=live.headers("viewer"),
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def _ecc(values: list[int], gpu: int = 1) -> list[dict[int, dict[str, Any]]]:
    return [{gpu: {"ecc_corrected_total": v}} for v in values]


def test_ecc_burst_opens_one_incident_and_a_storm_bumps_it(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    # The storm's bumps are written at most every 0.5 s (``degraded_bump_interval_s``, 2 s
    # in production): the test waits for the held ones to be written.
    live = controller_factory(
        degraded_ecc_rise=50, degraded_ecc_window_s=60.0, degraded_bump_interval_s=0.5
    )
    agent = Agent(live, ctl_report, "deg-e")
    agent.post(_ecc([1000, 1000]))  # the first value is a baseline, however large
    began = agent.clock
    agent.post(_ecc([1010, 1020]))  # 20 in the window: below the threshold
    assert _incidents(live) == []
    agent.post(_ecc([1030, 1045, 1060]))  # 60 since 1000 within 60 s
    (incident,) = _incidents(live)
    assert (incident["node"], incident["gpu_index"], incident["job"]) == ("deg-e", 1, None)
    assert (incident["severity"], incident["state"], incident["count"]) == ("warning", "open", 1)
    ecc = incident["evidence"]["ecc"]
    assert (ecc["rise"], ecc["threshold"], ecc["window_s"]) == (60, 50, 60.0)
    assert ecc["ecc_corrected_total"] == 1060
    # The condition began with the first rise in the window, on the agent's clock.
    assert incident["evidence"]["since_unix_s"] == began
    assert incident["summary"] == "deg-e: GPU 1 degrading: 60 correctable ECC errors within 60 s"

    value = 1060
    for _ in range(4):  # the storm goes on: the same incident counts it
        agent.post(_ecc([value + 100, value + 200]))
        value += 200
    bumped = wait_for(lambda: [i for i in _incidents(live) if i["count"] == 9])
    assert len(bumped) == 1 and len(_incidents(live)) == 1
    assert bumped[0]["evidence"]["ecc"]["ecc_corrected_total"] == value
    assert bumped[0]["evidence"]["since_unix_s"] == began


def test_counter_resets_are_not_a_burst(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    live = controller_factory(degraded_ecc_rise=50, degraded_ecc_window_s=60.0)
    agent = Agent(live, ctl_report, "deg-r")
    agent.post(_ecc([5000, 5000]))
    agent.post(_ecc([0, 10, 20]))  # a driver reload: the counter starts again at zero
    agent.instance = "inst-2"  # an agent restart whose counter reads higher than before
    agent.post(_ecc([400, 420]))
    agent.clock += 120.0  # the agent was down for two windows: errors it missed are no burst
    agent.post(_ecc([900, 910]))
    assert _incidents(live) == []
    # Still watching: a real burst after all that is seen.
    agent.post(_ecc([960, 990]))
    assert [i["gpu_index"] for i in _incidents(live)] == [1]


def test_persistent_thermal_throttling_opens_one_incident(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    live = controller_factory(degraded_throttle_s=10.0)
    agent = Agent(live, ctl_report, "deg-t")
    agent.post([{}] * 3)
    # Bursts (2 s hot, 3 s cool) and our own power cap or idle clocks for 20 s: never.
    agent.post([{2: HOT}, {2: HOT}, {}, {}, {}] * 4)
    agent.post([{2: CAPPED, 3: IDLE}] * 20)
    assert _incidents(live) == []
    began = agent.clock
    hot = {**HOT, "temperature_c": 91.0}
    agent.post([{2: hot}] * 6)
    assert _incidents(live) == []  # 6 s so far
    # A short cool moment in between does not reset it: most samples count.
    agent.post([{2: hot}, {2: {"temperature_c": 80.0}}, {2: hot}, {2: hot}, {2: hot}])
    (incident,) = _incidents(live)
    assert (incident["node"], incident["gpu_index"], incident["job"]) == ("deg-t", 2, None)
    throttle = incident["evidence"]["throttle"]
    assert throttle["reasons"] == ["hw_thermal_slowdown"]
    assert throttle["duration_s"] == 10.0 and throttle["min_duration_s"] == 10.0
    assert throttle["temperature_c"] == throttle["max_temperature_c"] == 91.0
    assert 0.5 < throttle["throttled_fraction"] < 1.0
    assert incident["evidence"]["since_unix_s"] == began
    assert incident["summary"] == "deg-t: GPU 2 degrading: hw_thermal_slowdown for 10 s at 91 °C"
    # It stays one incident while the GPU keeps throttling.
    agent.post([{2: hot}] * 10)
    assert len(_incidents(live)) == 1 and _incidents(live)[0]["count"] == 1


def test_recovery_resolves_the_incident(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    live = controller_factory(
        degraded_ecc_rise=10, degraded_ecc_window_s=1.0, degraded_throttle_s=1.0
    )
    agent = Agent(live, ctl_report, "deg-c")
    last_bad = time.time()
    agent.post(
        [{0: {"ecc_corrected_total": 0}}, {0: {"ecc_corrected_total": 50}, 3: HOT}, {3: HOT}]
    )
    assert sorted(i["gpu_index"] for i in _incidents(live, state="open")) == [0, 3]

    # Healthy reports from here on; both resolve 2 x their window after the last bad one.
    def resolved() -> list[dict[str, Any]]:
        agent.post([{0: {"ecc_corrected_total": 50}}])
        time.sleep(0.2)
        return _incidents(live, state="resolved")

    wait_for(lambda: len(resolved()) == 2)
    assert _incidents(live, state="open") == []
    for incident in _incidents(live, state="resolved"):
        assert incident["resolved_unix_s"] - last_bad >= 2.0  # not before 2 x 1 s of quiet
        assert incident["evidence"]["resolution"].startswith("no ECC burst or hardware throttling")
    # Degrading again later: a new incident.
    agent.post([{0: {"ecc_corrected_total": 50}}, {0: {"ecc_corrected_total": 99}}])
    assert [i["gpu_index"] for i in _incidents(live, state="open")] == [0]


def test_default_policy_asks_the_job_for_a_protective_checkpoint(
    controller_factory: Factory, ctl_report: MakeReport
) -> None:
    live = controller_factory(degraded_throttle_s=3.0)
    agent = Agent(live, ctl_report, "deg-j")
    row = {"job": "gpt", "world_size": 2, "step": 0, "step_time_s": 1.0}
    row |= {"compute_time_s": 0.9, "collective_wait_s": 0.1}
    steps = [row | {"rank": r, "gpu_index": r} for r in range(2)]
    agent.post([{}], job={"steps": steps})
    agent.post([{1: HOT}] * 4)
    (incident,) = _incidents(live)
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)

    def checkpoint_commands() -> list[dict[str, Any]]:
        data = viewer.get("/api/v1/commands", params={"node": "deg-j"}).json()["data"]
        return [c for c in data if c["kind"] == "job_checkpoint"]

    (command,) = wait_for(checkpoint_commands)
    assert command["params"]["job"] == "gpt"
    actions = viewer.get("/api/v1/actions").json()["data"]
    (action,) = [a for a in actions if a["kind"] == "checkpoint"]
    assert action["target"] == "gpt" and action["trigger"] == f"incident:{incident['id']}"
    assert action["params"]["nodes"] == ["deg-j"]
    # The agent receives it with its next reply.
    reply = agent.post([{1: HOT}])
    assert [c["kind"] for c in reply["commands"]] == ["job_checkpoint"]
