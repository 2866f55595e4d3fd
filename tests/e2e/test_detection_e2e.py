"""Fault injection end to end: real gloo ranks, real agents, a real controller.

Each scenario runs a small instrumented training job (4 ranks on 2 simulated nodes, 2 ranks
each) whose ranks talk to their node's agent over its Unix socket; the agents report to a
controller process. One fault per job; the test asserts the incident names the true
culprit and that nothing else opened for that job. Margins are wide (fault sizes, time
limits) so the suite holds on a loaded 2-core machine. The ranks are forked from a process
that imported torch once (tests/zygote.py), each then a process of its own.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls
from tests.e2e.e2e_cluster import E2ECluster
from tests.environ import clean_env
from tests.zygote import Zygote
from trainguard.cli.procs import Child, cli_argv, wait_until
from trainguard.ports import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("train_worker.py")
NODES = ("det-node-0", "det-node-1")
WORLD = 4
#: Extra time per transfer over an injected slow link. A probe tells a slow pair only from
#: healthy pairs that time under half of it, and on this loaded 2-core host a loopback
#: round trip between descheduled ranks can take 20-30 ms in every round (a 30 ms link was
#: once found healthy in three rounds running).
SLOW_LINK_S = 0.08


def node_of(rank: int) -> str:
    return NODES[rank * len(NODES) // WORLD]


class DetectionCluster:
    def __init__(self, workdir: Path, zygote: Zygote) -> None:
        self.base = E2ECluster(workdir, f"sqlite:///{workdir / 'tg.db'}")
        self.workdir = workdir
        self.sockets = {n: str(workdir / f"{n}.sock") for n in NODES}
        self.zygote = zygote
        self.ranks: list[Child] = []

    def close(self) -> None:
        for child in self.ranks:
            stop(child, timeout_s=5)
        self.base.close()

    def start(self) -> None:
        # Agents report every 0.5 s here (the default lead of 15 s is sized for 5 s reports):
        # a probe round's command reaches every rank within a second or two.
        self.base.start_controller({"TRAINGUARD_PROBE_LEAD_S": "5"})
        for node in NODES:
            argv = cli_argv(
                *("agent", "--controller", self.base.server, "--token", self.base.agent_token),
                *("--node-name", node, "--gpus", "sim:2"),
                *("--spool-dir", str(self.workdir / node / "spool")),
                *("--socket-path", self.sockets[node], "--metrics-port", "-1"),
                *("--sample-interval", "0.2", "--report-interval", "0.5"),
            )
            self.base.procs.start(node, argv, env=clean_env())
        for node in NODES:
            ok = wait_until(lambda n=node: os.path.exists(self.sockets[n]), timeout_s=30)
            assert ok, self.base.procs[node].log_tail(30)

    def run_job(
        self,
        job: str,
        faults: list[dict[str, Any]],
        steps: int,
        jitter: float = 0.0,
        extra_env: dict[str, str] | None = None,
    ) -> list[Child]:
        port = free_port()
        ranks = []
        for rank in range(WORLD):
            env = clean_env(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(WORLD),
                    "LOCAL_RANK": str(rank % (WORLD // len(NODES))),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "TRAINGUARD_JOB": job,
                    "TRAINGUARD_AGENT_SOCKET": self.sockets[node_of(rank)],
                    "TRAINGUARD_FAULTS": json.dumps(faults),
                    "TG_STEPS": str(steps),
                    "TG_COMPUTE_S": "0.05",
                    "TG_JITTER": str(jitter),
                    "OMP_NUM_THREADS": "1",
                    **(extra_env or {}),
                }
            )
            name = f"{job}-r{rank}"
            log = self.base.procs.log_dir / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            popen: Any = self.zygote.spawn([str(WORKER)], env=env, stdout=log)
            child = Child(name=name, argv=[str(WORKER)], log_path=log, popen=popen)
            self.base.procs.children[child.name] = child  # for the logs of a failure
            ranks.append(child)
        self.ranks += ranks
        return ranks

    def incidents(self, job: str) -> list[dict[str, Any]]:
        with self.base.api() as api:
            return api.incidents(job=job)

    def wait_incident(self, job: str, kind: str, timeout_s: float) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [i for i in self.incidents(job) if i["kind"] == kind]
            return bool(found)

        if not wait_until(seen, timeout_s=timeout_s, interval_s=0.5):
            logs = "\n".join(
                f"--- {c.name}\n{c.log_tail(8)}" for c in self.base.procs.children.values()
            )
            raise AssertionError(f"no {kind} incident for {job}: {self.incidents(job)}\n{logs}")
        return found[0]

    def stop_job(self, ranks: list[Child], timeout_s: float = 5) -> None:
        for child in ranks:
            stop(child, timeout_s=timeout_s)


def stop(child: Child, *, timeout_s: float) -> int | None:
    """``ProcessSet.stop`` for a rank: SIGTERM (and SIGCONT), SIGKILL after ``timeout_s``."""
    if child.alive():
        child.send(signal.SIGTERM)
        child.send(signal.SIGCONT)
        try:
            child.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.send(signal.SIGKILL)
            child.popen.wait(timeout=30)
    return child.popen.returncode


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, torch_zygote: Zygote
) -> Iterator[DetectionCluster]:
    c = DetectionCluster(tmp_path_factory.mktemp("detect"), torch_zygote)
    try:
        c.start()
        yield c
    finally:
        c.close()


def unique(job: str) -> str:
    """A job name of its own per run of a test: the cluster is the module's, and a rerun
    (slow tests run once more on failure) must not find the first attempt's incidents."""
    return f"{job}-{secrets.token_hex(3)}"


def kinds(incidents: list[dict[str, Any]]) -> list[str]:
    return sorted(i["kind"] for i in incidents)


def test_healthy_job_with_20pct_jitter_opens_nothing(cluster: DetectionCluster) -> None:
    job = unique("healthy")
    ranks = cluster.run_job(job, [], steps=150, jitter=0.2)
    assert wait_until(lambda: all(not r.alive() for r in ranks), timeout_s=90)
    assert [r.popen.returncode for r in ranks] == [0] * WORLD
    time.sleep(2.5)  # the last reports and a detector tick
    assert cluster.incidents(job) == []


@pytest.mark.parametrize(
    ("job", "fault", "min_slowdown_pct"),
    [
        # A fixed delay per step (a straggler's extra work).
        ("straggle", {"kind": "delay", "rank": 2, "from_step": 5, "delay_s": 0.04}, 40),
        # Compute stretched by a factor (a GPU at lower clocks).
        ("slowdown", {"kind": "slowdown", "rank": 1, "from_step": 5, "factor": 1.5}, 25),
    ],
    ids=["delay", "slowdown"],
)
def test_straggler_names_the_slowed_rank_and_its_node(
    cluster: DetectionCluster, job: str, fault: dict[str, Any], min_slowdown_pct: float
) -> None:
    job = unique(job)
    ranks = cluster.run_job(job, [fault], steps=400)
    try:
        incident = cluster.wait_incident(job, "straggler", timeout_s=60)
        slowed = fault["rank"]
        assert incident["ranks"] == [slowed] and incident["node"] == node_of(slowed)
        assert incident["evidence"]["slowdown_pct"] > min_slowdown_pct
        assert kinds(cluster.incidents(job)) == ["straggler"]
    finally:
        cluster.stop_job(ranks)


def test_pipeline_straggler_roles_come_from_a_real_device_mesh(cluster: DetectionCluster) -> None:
    """2 pipeline stages x 2 replicas from a real DeviceMesh; the last stage (ranks 2, 3)
    computes 60% longer throughout, and from step 150 rank 1 is delayed. Only rank 1 is
    named, compared with its own stage (ranks 0, 1); the last stage never is."""
    delay = {"kind": "delay", "rank": 1, "from_step": 150, "delay_s": 0.03}
    env = {"TG_PP": "2", "TG_LAST_STAGE_EXTRA": "0.6"}
    job = unique("pipeline")
    ranks = cluster.run_job(job, [delay], steps=450, extra_env=env)
    try:
        incident = cluster.wait_incident(job, "straggler", timeout_s=90)
        assert incident["ranks"] == [1], incident
        group = incident["evidence"]["peer_group"]
        assert group["ranks"] == [0, 1] and group["basis"] == "group_ranks"
        assert group["role"] == "pp_stage=0"
        assert kinds(cluster.incidents(job)) == ["straggler"]
    finally:
        cluster.stop_job(ranks)


def test_hang_names_the_rank_that_never_entered(cluster: DetectionCluster) -> None:
    job = unique("hang")
    faults = [{"kind": "hang", "rank": 1, "at_step": 20, "op": "all_reduce", "where": "before"}]
    ranks = cluster.run_job(job, faults, steps=400)
    try:
        incident = cluster.wait_incident(job, "hang", timeout_s=60)
        assert incident["ranks"] == [1] and incident["node"] == node_of(1)
        assert incident["evidence"]["op"] == "all_reduce"
        assert set(incident["evidence"]["entered"]) == {0, 2, 3}
        assert kinds(cluster.incidents(job)) == ["hang"]
    finally:
        cluster.stop_job(ranks)


def test_crash_names_the_rank_and_its_exit_code(cluster: DetectionCluster) -> None:
    job = unique("crash")
    faults = [{"kind": "crash", "rank": 3, "at_step": 15, "exit_code": 7}]
    ranks = cluster.run_job(job, faults, steps=400)
    try:
        incident = cluster.wait_incident(job, "rank_crash", timeout_s=60)
        assert incident["ranks"] == [3] and incident["node"] == node_of(3)
        assert incident["evidence"]["exit_code"] == 7
        assert ranks[3].popen.wait(timeout=10) == 7
    finally:
        cluster.stop_job(ranks)
    # The peers then hang in the collective rank 3 never joined: that is the same fault,
    # seen from the survivors, and it names the same rank.
    for incident in cluster.incidents(job):
        assert incident["ranks"] == [3], incident


def test_slow_link_is_probed_and_localized(cluster: DetectionCluster) -> None:
    job = unique("slowlink")
    faults = [{"kind": "slow_link", "ranks": [1, 2], "from_step": 60, "delay_s": SLOW_LINK_S}]
    ranks = cluster.run_job(job, faults, steps=3000)
    try:
        slow = cluster.wait_incident(job, "comm_slow", timeout_s=60)
        assert slow["evidence"]["wait_s"] > slow["evidence"]["reference_wait_s"]
        # The controller schedules a probe round ~5 s of training ahead (probe_lead_s); every
        # rank runs it at the same step and the pair through the slow link stands out.
        # A round that tells nothing (a rank got the command late) or finds the links
        # healthy (a loaded host) runs again with twice the lead: 5 s, then 10 s, then 20 s.
        link = cluster.wait_incident(job, "slow_link", timeout_s=150)
        assert link["ranks"] == [1, 2] and link["evidence"]["scope"] == "link"
        assert link["evidence"]["slow_pairs"] == [[1, 2]]
        assert kinds(cluster.incidents(job)) == ["comm_slow", "slow_link"]
    finally:
        cluster.stop_job(ranks)


def test_chaos_drill_on_a_running_job_is_detected(cluster: DetectionCluster) -> None:
    """Faults injected at run time through the controller's API, relayed by the agents."""
    job = unique("chaos")
    ranks = cluster.run_job(job, [], steps=3000)
    try:
        headers = {"Authorization": f"Bearer {cluster.base.operator_token}"}
        url = f"{cluster.base.server}/api/v1/jobs/{job}/faults"
        body = {"faults": [{"kind": "delay", "rank": 3, "from_step": 0, "delay_s": 0.04}]}
        assert wait_until(
            lambda: http_calls.post(url, json=body, headers=headers).status_code == 201,
            timeout_s=30,
            interval_s=0.5,
        )
        incident = cluster.wait_incident(job, "straggler", timeout_s=60)
        assert incident["ranks"] == [3] and incident["node"] == node_of(3)
        bad = http_calls.post(url, json={"faults": [{"kind": "delay", "rank": 9}]}, headers=headers)
        assert bad.status_code == 422 and "rank 9 is not in job" in bad.json()["detail"]
        viewer = {"Authorization": f"Bearer {cluster.base.viewer_token}"}
        assert http_calls.post(url, json=body, headers=viewer).status_code == 403
    finally:
        cluster.stop_job(ranks)


def test_communication_hang_is_localized_by_the_probe_after_restart(
    cluster: DetectionCluster,
) -> None:
    """A degraded link (slow from the first step, so no rise for ``comm_slow`` to see) and a
    transfer over it that never finishes: every rank is inside the call. The hang is
    reported as a communication hang; the job is restarted in place (what the policy's
    restart does), and the probe deferred to the new run names the link."""
    link = {"kind": "slow_link", "ranks": [1, 2], "from_step": 0, "delay_s": SLOW_LINK_S}
    stuck = {"kind": "hang", "rank": 1, "at_step": 20, "op": "all_reduce", "where": "inside"}
    job = unique("commhang")
    ranks = cluster.run_job(job, [link, stuck], steps=400)
    try:
        hang = cluster.wait_incident(job, "comm_hang", timeout_s=60)
        assert hang["ranks"] == [0, 1, 2, 3] and hang["evidence"]["op"] == "all_reduce"
        assert hang["evidence"]["probe"].startswith("deferred")
        assert kinds(cluster.incidents(job)) == ["comm_hang"]
    finally:
        for child in ranks:  # the whole job at once, as a restart stops it
            child.send(signal.SIGTERM)
        cluster.stop_job(ranks, timeout_s=10)
    ranks = cluster.run_job(job, [link], steps=3000)
    try:
        found = cluster.wait_incident(job, "slow_link", timeout_s=120)
        assert found["ranks"] == [1, 2] and found["evidence"]["scope"] == "link"
        assert found["evidence"]["slow_pairs"] == [[1, 2]]
        assert found["evidence"]["after_incident"].startswith(f"comm_hang:{job}:")
    finally:
        cluster.stop_job(ranks)
    by_kind = {i["kind"]: i for i in cluster.incidents(job)}
    # the restart closed the hang; stopping a hung job is no crash of any rank
    assert by_kind["comm_hang"]["state"] == "resolved", by_kind["comm_hang"]
    assert "rank_crash" not in by_kind and "comm_failure" not in by_kind, by_kind
