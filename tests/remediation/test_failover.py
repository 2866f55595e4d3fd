"""Remediation across a failover: two controller processes on one PostgreSQL database never
act twice on one incident.

The replicas are real ``trainguard controller`` processes (as in
``tests/controller/test_ctl_leader.py``); the fault is an agent report of XID 79 on a node
that hosts a rank of a running job. The policy makes that a slow, two-step remediation:
``checkpoint`` (every node of the job is asked for a checkpoint; no rank exists to answer, so
the step lasts exactly ``checkpoint_timeout_s``) then ``isolate``. That leaves a window of
seconds in which the leader can be killed with its first action row written and ``pending``
and its second not started: the failover a duplicated or lost action would come from.

What is pinned here: no step of the remediation is ever run twice, whichever replica runs
it, across a ``kill -9`` of the leader or a graceful restart of every replica; and a
remediation cut in half is finished, not dropped: the step the old leader was inside ends
``failed`` as interrupted (never run again: it may have taken effect), and the steps after it
run once on the new leader. Left unfinished, a node whose GPU fell off the bus would stay
schedulable, and the job on it would never be restarted.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import http_calls
from tests.environ import clean_env
from tests.remediation.test_engine import ENGINE
from trainguard.cli.procs import Child, ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

#: How long the checkpoint step waits for a checkpoint no rank will ever write.
CHECKPOINT_TIMEOUT_S = 5.0
JOB = "gpt"
#: n1 and n2 run the job's two ranks; n3 is an idle node (so isolating n1 stays within the
#: circuit breaker's share of the cluster).
NODES = ("n1", "n2", "n3")
CULPRIT = "n1"


class Replica:
    """One ``trainguard controller`` process and its HTTP address."""

    def __init__(self, child: Child, port: int, tokens: dict[str, str]) -> None:
        self.child = child
        self.url = f"http://127.0.0.1:{port}"
        self.operator = {"Authorization": f"Bearer {tokens['operator']}"}
        self.agent = {"Authorization": f"Bearer {tokens['agent']}"}

    def ready(self) -> bool:
        try:
            return http_calls.get(f"{self.url}/readyz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def leads(self) -> bool:
        """The leader gauge is 1 (a healthy standby is Ready too, so /readyz cannot tell)."""
        try:
            text = http_calls.get(f"{self.url}/metrics", timeout=2.0).text
        except httpx.TransportError:
            return False
        return "\ntrainguard_controller_leader 1.0" in f"\n{text}"

    def answers(self) -> bool:
        try:
            http_calls.get(f"{self.url}/healthz", timeout=2.0)
        except httpx.TransportError:
            return False
        return True

    def actions(self) -> list[dict[str, Any]]:
        """Every action row, oldest first."""
        reply = http_calls.get(f"{self.url}/api/v1/actions", headers=self.operator, timeout=5.0)
        reply.raise_for_status()
        return list(reversed(reply.json()["data"]))

    def node(self, name: str) -> dict[str, Any]:
        reply = http_calls.get(f"{self.url}/api/v1/nodes", headers=self.operator, timeout=5.0)
        reply.raise_for_status()
        return next(n for n in reply.json()["data"] if n["name"] == name)


class Cluster:
    """Controller replicas on one database, and the agents' side of the wire."""

    def __init__(self, procs: ProcessSet, database_url: str, policy_file: Path) -> None:
        self.procs = procs
        self.database_url = database_url
        self.tokens = {role: secrets.token_urlsafe(24) for role in ("agent", "operator")}
        configured = [{"name": f"t-{r}", "role": r, "token": t} for r, t in self.tokens.items()]
        env = clean_env()
        self.env = env | {
            "TRAINGUARD_TOKENS": json.dumps(configured),
            "TRAINGUARD_ALLOW_SHARED_AGENT_TOKENS": "true",  # one agent token, many nodes
            "TRAINGUARD_POLICY_FILE": str(policy_file),
            # Silent nodes must not open node_lost incidents of their own during the test.
            "TRAINGUARD_NODE_LOST_AFTER_S": "600",
            "TRAINGUARD_LOG_LEVEL": "info",
        }
        self.replicas: list[Replica] = []
        self.seq: dict[str, int] = {}
        #: Agent instance per node; a report's (instance, seq) is what dedupes a retry.
        self.instance = secrets.token_hex(4)

    def start(self) -> Replica:
        port = free_port()
        argv = cli_argv(
            *("controller", "--host", "127.0.0.1", "--port", str(port)),
            *("--database-url", self.database_url),
        )
        child = self.procs.start(f"controller-{len(self.replicas)}", argv, env=self.env)
        replica = Replica(child, port, self.tokens)
        up = wait_until(lambda: replica.answers() or not child.alive(), timeout_s=60)
        assert up and child.alive(), child.log_tail(30)
        self.replicas.append(replica)
        return replica

    def leader(self, timeout_s: float = 15.0) -> Replica:
        """The one live replica whose leader gauge is 1."""
        found: list[Replica] = []

        def one() -> bool:
            found[:] = [r for r in self.replicas if r.child.alive() and r.leads()]
            return len(found) == 1

        assert wait_until(one, timeout_s=timeout_s), f"leaders: {[r.url for r in found]}"
        return found[0]

    def report(self, node: str, **extra: Any) -> None:
        """One agent report, to whichever replica leads; retried on 503 and connection errors
        as an agent's spool would (same seq, so a report that did land is not counted twice)."""
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        now = time.time()
        gpus = [{"index": i, "uuid": f"{node}-g{i}", "power_w": 300.0} for i in range(2)]
        if extra.pop("xid", False):
            gpus[1]["xid_events"] = [{"code": 79, "time_unix_s": now, "gpu_index": 1}]
        body = {
            "node": {
                "name": node,
                "gpus": [{"index": i, "uuid": f"{node}-g{i}"} for i in range(2)],
            },
            "agent_instance": self.instance,
            "seq": seq,
            "sent_unix_s": now,
            "samples": [{"time_unix_s": now, "gpus": gpus}],
            **extra,
        }
        deadline = time.monotonic() + 20
        last = ""
        while time.monotonic() < deadline:
            for replica in self.replicas:
                if not replica.child.alive():
                    continue
                try:
                    reply = http_calls.post(
                        f"{replica.url}/api/v1/reports", json=body, headers=replica.agent
                    )
                except httpx.TransportError as exc:
                    last = f"{replica.url}: {type(exc).__name__}"
                    continue
                if reply.status_code == 200:
                    return
                assert reply.status_code == 503, reply.text
                last = f"{replica.url}: 503 {reply.json()['detail']}"
            time.sleep(0.2)
        raise AssertionError(f"no replica took the report of {node} seq {seq}: {last}")

    def start_job(self) -> None:
        """One step of a two-rank job, rank 0 on n1 and rank 1 on n2: a job with running
        ranks on the culprit node, so the rule's checkpoint step has someone to ask."""
        for rank, node in enumerate(NODES[:2]):
            step = {
                "job": JOB,
                "rank": rank,
                "world_size": 2,
                "step": 1,
                "step_time_s": 0.5,
                "compute_time_s": 0.4,
                "collective_wait_s": 0.1,
                "end_unix_s": time.time(),
            }
            self.report(node, job={"steps": [step]})


def incident_actions(actions: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The remediation's rows by kind (one incident in these tests)."""
    triggers = {a["trigger"] for a in actions}
    assert len(triggers) <= 1 and all(t.startswith("incident:") for t in triggers), triggers
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for action in actions:
        by_kind.setdefault(action["kind"], []).append(action)
    return by_kind


def write_policy(tmp_path: Path) -> Path:
    """gpu_fault: checkpoint (takes CHECKPOINT_TIMEOUT_S here), then isolate."""
    policy = {
        "rules": [
            {"kind": "gpu_fault", "severity": "critical", "steps": ["checkpoint", "isolate"]}
        ],
        "guards": {"max_isolated_fraction": 0.9, "checkpoint_timeout_s": CHECKPOINT_TIMEOUT_S},
    }
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(policy))
    return policy_file


def assert_finished_once_after_interruption(actions: list[dict[str, Any]]) -> None:
    rows = incident_actions(actions)
    assert set(rows) == {"checkpoint", "isolate_node"}, rows
    (checkpoint,) = rows["checkpoint"]
    assert checkpoint["status"] == "failed", checkpoint
    assert checkpoint["outcome"].startswith("interrupted: the leader stopped during this step")
    (isolate,) = rows["isolate_node"]
    assert (isolate["status"], isolate["target"]) == ("succeeded", CULPRIT), isolate
    # The resumed step belongs to a new remediation of the same incident and job.
    assert isolate["params"]["remediation"] != checkpoint["params"]["remediation"]
    assert isolate["params"]["job"] == checkpoint["params"]["job"] == JOB


@pytest.fixture
def cluster(db_url: str, tmp_path: Path) -> Iterator[Cluster]:
    from controller.db.migrate import upgrade

    upgrade(db_url)  # PostgreSQL is never migrated by the controller itself
    policy_file = write_policy(tmp_path)
    with ProcessSet(tmp_path / "logs") as procs:
        yield Cluster(procs, db_url, policy_file)


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.postgres
@pytest.mark.slow
def test_leader_killed_mid_remediation_the_new_leader_finishes_it_once(
    cluster: Cluster,
) -> None:
    first = cluster.start()
    assert cluster.leader() is first
    second = cluster.start()
    assert not second.leads()  # standby
    for node in NODES:
        cluster.report(node)
    cluster.start_job()

    cluster.report(CULPRIT, xid=True)
    pending: list[dict[str, Any]] = []

    def checkpoint_pending() -> bool:
        pending[:] = [a for a in first.actions() if a["kind"] == "checkpoint"]
        return bool(pending)

    assert wait_until(checkpoint_pending, timeout_s=10), first.child.log_tail(30)
    assert pending[0]["status"] == "pending", pending  # the kill lands inside the step
    assert sorted(pending[0]["params"]["nodes"]) == ["n1", "n2"]
    first.child.send(signal.SIGKILL)
    first.child.popen.wait()
    killed = time.monotonic()
    assert cluster.leader() is second
    print(f"\nfailover: standby leading {time.monotonic() - killed:.2f} s after kill -9")

    def isolated() -> bool:
        return bool(second.node(CULPRIT)["isolated_reason"])

    assert wait_until(isolated, timeout_s=10), second.child.log_tail(30)
    print(f"remediation finished by the new leader {time.monotonic() - killed:.2f} s after kill")
    # Past the old checkpoint deadline, the same fault reported again (the open incident,
    # bumped) and a few more engine ticks: nothing is run a second time.
    time.sleep(max(0.0, killed + CHECKPOINT_TIMEOUT_S + 1 - time.monotonic()))
    cluster.report(CULPRIT, xid=True)
    time.sleep(2.5)
    assert_finished_once_after_interruption(second.actions())


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
@pytest.mark.postgres
@pytest.mark.slow
def test_graceful_restart_of_both_replicas_acts_on_nothing_twice(cluster: Cluster) -> None:
    first = cluster.start()
    cluster.start()
    assert cluster.leader() is first
    for node in NODES:
        cluster.report(node)
    cluster.start_job()
    started = time.monotonic()
    cluster.report(CULPRIT, xid=True)

    def remediated() -> bool:
        rows = incident_actions(first.actions())
        return [a["status"] for a in rows.get("isolate_node", [])] == ["succeeded"]

    assert wait_until(remediated, timeout_s=CHECKPOINT_TIMEOUT_S + 10), first.actions()
    print(f"\nremediation (checkpoint timed out, isolate): {time.monotonic() - started:.1f} s")
    before = first.actions()
    rows = incident_actions(before)
    assert [a["status"] for a in rows["checkpoint"]] == ["failed"], rows
    assert "no durable checkpoint within 5 s" in rows["checkpoint"][0]["outcome"]

    for replica in cluster.replicas:  # graceful: SIGTERM, the leader releases the lock last
        cluster.procs.stop(replica.child.name, timeout_s=20)
        # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly.
        assert replica.child.popen.returncode in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in replica.child.log_tail(5)
    cluster.replicas.clear()
    third, fourth = cluster.start(), cluster.start()
    leader = cluster.leader()
    assert leader in (third, fourth)
    cluster.report(CULPRIT, xid=True)  # the fault persists: the open incident, bumped
    cluster.report("n2")
    time.sleep(3)  # three engine ticks on the new leader
    assert leader.actions() == before
    assert leader.node(CULPRIT)["isolated_reason"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("fast_remediation_engine")
def test_graceful_restart_inside_a_step_is_finished_once_by_the_next_start(
    controller_factory: Any, tmp_path: Path
) -> None:
    """Shutdown cancels a remediation inside its checkpoint step (the same cut as a failover,
    in one in-process controller); the next start closes the step and isolates, once."""
    live = controller_factory(policy_file=write_policy(tmp_path), node_lost_after_s=600.0)
    agent = http_calls.client(base_url=live.url, headers=live.headers("agent"), timeout=10)
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)
    seq = dict.fromkeys(NODES, 0)

    def report(node: str, **extra: Any) -> None:
        now = time.time()
        gpus: list[dict[str, Any]] = [{"index": 0, "uuid": f"{node}-g0"}]
        if extra.pop("xid", False):
            gpus[0]["xid_events"] = [{"code": 79, "time_unix_s": now, "gpu_index": 0}]
        body = {
            "node": {"name": node, "gpus": [{"index": 0, "uuid": f"{node}-g0"}]},
            "agent_instance": "i1",
            "seq": seq[node],
            "sent_unix_s": now,
            "samples": [{"time_unix_s": now, "gpus": gpus}],
            **extra,
        }
        seq[node] += 1
        assert agent.post("/api/v1/reports", json=body).status_code == 200

    def actions() -> list[dict[str, Any]]:
        return list(reversed(viewer.get("/api/v1/actions").json()["data"]))

    for node in NODES:
        report(node)
    step = {"job": JOB, "world_size": 1, "step": 1, "step_time_s": 0.5}
    step |= {"compute_time_s": 0.4, "collective_wait_s": 0.1, "rank": 0}
    report(CULPRIT, job={"steps": [step]})
    report(CULPRIT, xid=True)
    assert wait_until(lambda: any(a["kind"] == "checkpoint" for a in actions()), timeout_s=10)
    assert [a["status"] for a in actions()] == ["pending"]
    live.restart()  # graceful: the engine's task is cancelled inside the step

    def isolated() -> bool:
        reply = viewer.get("/api/v1/nodes").json()["data"]
        return any(n["name"] == CULPRIT and n["isolated_reason"] for n in reply)

    assert wait_until(isolated, timeout_s=10)
    live.wait_ticks(ENGINE, 2)  # more ticks: nothing runs twice
    assert_finished_once_after_interruption(actions())
    live.restart()  # and nothing is left for a third start to resume
    live.wait_ticks(ENGINE, 2)  # the new engine loaded what was left and looked again
    assert_finished_once_after_interruption(actions())
