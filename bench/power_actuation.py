"""The power cap's actuation latency, measured through the real agent path in this run.

A controller (SQLite) and one agent on simulated NVML (``--gpus sim:2``) run as real
processes on this machine. For each sample the bench asks the controller's API for a
``set_power_limit`` on one GPU and times, from the API's answer, until the node's latest
sample in ``GET /nodes/{name}`` shows the new limit: the command waits for the agent's next
report, rides the reply, the agent applies it through (simulated) NVML, samples the GPU and
reports again. That is the delay the power policy sees between deciding a cap and seeing it
in force, so ``bench.power`` feeds it to its simulator instead of a constant.

What it leaves out: real NVML takes milliseconds to set a limit on a GPU (not measured
here: no GPU on this machine), and the machine is shared, so the figure is an upper bound
of the path's cost at the given report interval.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from trainguard.cli.procs import ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

NODE = "node-pw"
AGENT_TOKEN = "bench-power-agent-token"
OPERATOR_TOKEN = "bench-power-operator-token"


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return env | extra


def _latest_limit(http: httpx.Client, gpu: int) -> float | None:
    r = http.get(f"/api/v1/nodes/{NODE}")
    if r.status_code == 404:
        return None
    r.raise_for_status()
    gpus = r.json()["gpus"]
    if len(gpus) <= gpu:
        return None
    value = (gpus[gpu].get("latest") or {}).get("power_limit_w")
    return None if value is None else float(value)


def measure_actuation(
    *, samples: int = 5, report_interval_s: float = 1.0, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Seconds from "cap requested" to "cap seen applied in the node's report", per sample.

    Raises ``RuntimeError`` when a process does not come up or a cap is never seen: a
    latency that was not measured must not turn into a number.
    """
    sample_s = min(0.25, report_interval_s)
    with (
        tempfile.TemporaryDirectory(prefix="tg-bench-power-") as tmp,
        ProcessSet(Path(tmp) / "logs") as procs,
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        tokens = [
            {"name": "bench-agent", "role": "agent", "token": AGENT_TOKEN},
            {"name": "bench-operator", "role": "operator", "token": OPERATOR_TOKEN},
        ]
        ctl = procs.start(
            "controller",
            [
                *cli_argv("controller", "--host", "127.0.0.1", "--port", str(port)),
                *("--database-url", f"sqlite:///{Path(tmp) / 'tg.db'}"),
            ],
            env=_env(
                {
                    "TRAINGUARD_TOKENS": json.dumps(tokens),
                    # One agent token for every simulated node (the default is off).
                    "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",
                }
            ),
        )
        http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=10
        )
        try:

            def ready() -> bool:
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            if not wait_until(lambda: ready() or not ctl.alive(), timeout_s=timeout_s):
                raise RuntimeError(f"controller did not start:\n{ctl.log_tail(20)}")
            if not ctl.alive():
                raise RuntimeError(f"controller exited:\n{ctl.log_tail(20)}")
            agent = procs.start(
                NODE,
                cli_argv(
                    *("agent", "--controller", url, "--token", AGENT_TOKEN),
                    *("--node-name", NODE, "--gpus", "sim:2"),
                    *("--spool-dir", str(Path(tmp) / "spool")),
                    *("--socket-path", "", "--metrics-port", "-1"),
                    *("--sample-interval", str(sample_s)),
                    *("--report-interval", str(report_interval_s)),
                ),
                env=_env({"TRAINGUARD_AGENT_BACKOFF_MAX_S": "0.5"}),
            )
            if not wait_until(lambda: _latest_limit(http, 1) is not None, timeout_s=timeout_s):
                raise RuntimeError(f"agent never reported its GPUs:\n{agent.log_tail(20)}")
            latencies: list[float] = []
            acks: list[float] = []
            default = _latest_limit(http, 1) or 700.0
            for i in range(samples):
                gpu = i % 2
                # A limit different from the current one, so "applied" cannot be a leftover.
                limit = round(default * (0.55 + 0.05 * i), 1)
                t0 = time.monotonic()
                r = http.post(
                    f"/api/v1/nodes/{NODE}/commands",
                    json={"kind": "set_power_limit", "gpu_index": gpu, "limit_w": limit},
                )
                if r.status_code != 201:  # what refused it, for whoever reads the failure
                    raise RuntimeError(f"set_power_limit refused: {r.status_code} {r.text}")
                created = r.json()
                seen = wait_until(
                    lambda g=gpu, w=limit: (_latest_limit(http, g) or -1.0) == w,  # type: ignore[misc]
                    timeout_s=timeout_s,
                    interval_s=0.02,
                )
                if not seen:
                    raise RuntimeError(f"cap {limit} W on gpu{gpu} never showed in a report")
                latencies.append(time.monotonic() - t0)
                cmd = next(
                    c
                    for c in http.get("/api/v1/commands", params={"node": NODE}).json()["data"]
                    if c["id"] == created["id"]
                )
                if cmd["finished_unix_s"] is not None:
                    acks.append(cmd["finished_unix_s"] - cmd["created_unix_s"])
        finally:
            http.close()
    return {
        "samples_s": [round(x, 3) for x in latencies],
        "p50_s": round(statistics.median(latencies), 3),
        "max_s": round(max(latencies), 3),
        "ack_p50_s": round(statistics.median(acks), 3) if acks else None,
        "report_interval_s": report_interval_s,
        "sample_interval_s": sample_s,
        "how": "measured here: controller + agent processes, simulated NVML (sim:2)",
    }
