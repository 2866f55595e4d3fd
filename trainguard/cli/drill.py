"""Recovery drills: a real training job on simulated nodes meets real faults and recovers.

One :class:`Drill` starts, on this machine, a controller (SQLite, the local-process
actuator, a demo policy), one agent per simulated node (simulated GPUs that take faults
while running), and ``demojob`` (a TP x DP GPT on gloo) that the controller launches on
all nodes but one, the spare. :meth:`Drill.fault` then injects one fault the way it would
happen on a cluster and measures the loop from the outside, on one clock:

- ``straggler``: a rank's GPU overheats (simulated thermal throttling) and its steps slow
  down (a ``delay`` chaos fault through the controller's API);
- ``hang``: a rank stops entering collectives (a ``hang`` chaos fault);
- ``xid``: a GPU falls off the bus (XID 79 from the simulated driver).

For each: when the incident opened (detection), when the job's first step after the
restart completed (recovery), how many steps were run again, and the world size before and
after; the job's own loss log shows the curve continuing. ``trainguard demo`` narrates a
drill; ``python -m bench.recovery`` repeats drills and reports the distribution.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.cli.client import ApiClient
from trainguard.cli.errors import BadInput, DemoFailed
from trainguard.cli.procs import ProcessSet, cli_argv, wait_until
from trainguard.ports import free_port

JsonObject = dict[str, Any]
JOB = "gpt-demo"
FAULT_KINDS = ("straggler", "hang", "xid")
#: Steps between injecting a hang and the step it strikes at.
HANG_LEAD_STEPS = 30

#: The incident kinds that count as detecting each fault.
DETECTED_AS = {"straggler": ("straggler",), "hang": ("hang", "comm_hang"), "xid": ("gpu_fault",)}


def hang_fault(rank: int | None, step: int, generation: int) -> JsonObject:
    """The chaos fault that hangs ``rank`` about :data:`HANG_LEAD_STEPS` steps after
    ``step`` (the job's newest): far enough ahead that the command reaches the rank first
    (the agent's report, then the rank's next poll). ``from_step``, not ``at_step``: on a
    loaded machine the command can still arrive after that step, and a one-step fault then
    never fired, leaving the demo waiting out its timeout for a hang that never happened;
    from a step on, the rank hangs at the next step it starts instead. Armed in this
    ``generation`` only: the restarted job, resuming below that step, must run through it."""
    return {
        "kind": "hang",
        "rank": rank,
        "from_step": step + HANG_LEAD_STEPS,
        "generation": generation,
    }


@dataclass(kw_only=True, slots=True)
class DrillConfig:
    nodes: int = 3
    #: Nodes the job starts on; the rest are spares.
    active_nodes: int = 2
    ranks_per_node: int = 2
    tp: int = 2
    global_batch: int = 8
    ckpt_every: int = 5
    step_sleep_s: float = 0.1
    #: Healthy steps before each fault: the straggler detector compares a window of them.
    warmup_steps: int = 25
    startup_timeout_s: float = 180.0
    #: Fault to training resumed, at most (the issue's target is 60 s; this is the give-up).
    recovery_timeout_s: float = 180.0
    straggler_delay_s: float = 0.25
    sample_interval_s: float = 0.2
    report_interval_s: float = 0.5


def drill_policy() -> JsonObject:
    """The demo's policy: the defaults' shape, with waits short enough for a demo."""
    return {
        "rules": [
            {"kind": "gpu_fault", "severity": "critical",
             "steps": ["checkpoint", "isolate", "restart"]},
            {"kind": "hang", "steps": ["capture_evidence", "isolate", "restart"],
             "isolate_when": "hardware_or_repeat"},
            {"kind": "straggler", "steps": ["alert", "checkpoint", "isolate", "restart"],
             "after_s": 3, "min_cost_pct": 10, "isolate_when": "hardware_or_repeat"},
            {"kind": "*", "steps": ["alert"]},
        ],
        "guards": {"max_isolated_fraction": 0.7, "max_restarts_per_job": 10, "settle_s": 3,
                   "checkpoint_timeout_s": 30},
    }  # fmt: skip


@dataclass(kw_only=True, slots=True)
class FaultOutcome:
    kind: str
    node: str
    rank: int | None
    injected_unix_s: float
    generation_before: int
    world_before: int
    last_step_before: int | None = None
    incident: JsonObject | None = None
    resumed: JsonObject | None = None
    steps_lost: int | None = None
    note: str = ""

    @property
    def detect_s(self) -> float | None:
        if self.incident is None:
            return None
        return max(0.0, float(self.incident["opened_unix_s"]) - self.injected_unix_s)

    @property
    def recover_s(self) -> float | None:
        if self.resumed is None:
            return None
        return max(0.0, float(self.resumed["time_unix_s"]) - self.injected_unix_s)

    @property
    def world_after(self) -> int | None:
        return None if self.resumed is None else int(self.resumed["world_size"])

    def as_dict(self) -> JsonObject:
        return {
            "fault": self.kind,
            "node": self.node,
            "rank": self.rank,
            "incident": None if self.incident is None else self.incident.get("kind"),
            "incident_node": None if self.incident is None else self.incident.get("node"),
            "incident_ranks": None if self.incident is None else self.incident.get("ranks"),
            "detect_s": self.detect_s,
            "recover_s": self.recover_s,
            "steps_lost": self.steps_lost,
            "world_before": self.world_before,
            "world_after": self.world_after,
            "resumed_from": None if self.resumed is None else self.resumed.get("resumed_from"),
            "note": self.note,
        }


@dataclass(slots=True)
class Drill:
    config: DrillConfig
    workdir: Path
    procs: ProcessSet
    server: str = ""
    operator_token: str = field(default_factory=lambda: os.urandom(18).hex(), repr=False)
    node_names: list[str] = field(default_factory=list)
    #: Called with one line whenever something worth narrating happens.
    say: Callable[[str], None] = lambda _line: None

    @property
    def loss_log(self) -> Path:
        return self.workdir / "loss.jsonl"

    def api(self) -> ApiClient:
        return ApiClient(self.server, self.operator_token, timeout_s=5.0)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        self.launch()
        self.wait_for_job()

    def launch(self) -> None:
        """Agents, then the controller, which launches the job on the active nodes."""
        cfg = self.config
        if not 0 < cfg.active_nodes <= cfg.nodes:
            raise BadInput(f"active nodes must be 1..{cfg.nodes}, got {cfg.active_nodes}")
        self.node_names = [f"demo-node-{i}" for i in range(cfg.nodes)]
        self._start_agents()
        self._start_controller()

    def wait_for_job(self) -> None:
        cfg = self.config
        self.say(
            f"job {JOB}: TP={cfg.tp} x DP={cfg.active_nodes * cfg.ranks_per_node // cfg.tp} "
            f"on {', '.join(self.node_names[: cfg.active_nodes])}; "
            f"spare: {', '.join(self.node_names[cfg.active_nodes :]) or 'none'}"
        )
        self.wait(
            "the job's first steps",
            lambda: len(self.losses()) >= cfg.warmup_steps,
            cfg.startup_timeout_s,
        )
        self.say(
            f"training: step {self.losses()[-1]['step']}, loss {self.losses()[-1]['loss']:.3f}"
        )

    def _socket(self, node: str) -> str:
        return str(self.workdir / node / "agent.sock")

    def _fault_file(self, node: str) -> Path:
        return self.workdir / node / "gpu-faults"

    def _token_file(self, node: str) -> Path:
        """The node's own agent token (issued by the controller once it is up)."""
        return self.workdir / node / "agent-token"

    def _start_agents(self) -> None:
        cfg = self.config
        for node in self.node_names:
            (self.workdir / node).mkdir(parents=True, exist_ok=True)
        self.server = f"http://127.0.0.1:{free_port()}"
        for node in self.node_names:
            argv = cli_argv(
                *("agent", "--controller", self.server),
                # Each agent its own token, bound to its node (docs/security.md): the file
                # is written once the controller has issued it; until then reports wait.
                *("--token-file", str(self._token_file(node))),
                *("--node-name", node, "--gpus", f"sim:{cfg.ranks_per_node}"),
                *("--spool-dir", str(self.workdir / node / "spool")),
                *("--socket-path", self._socket(node), "--metrics-port", "0"),
                *("--sample-interval", str(cfg.sample_interval_s)),
                *("--report-interval", str(cfg.report_interval_s)),
                *("--sim-fault-file", str(self._fault_file(node))),
            )
            self.procs.start(node, argv, env=self._env({}))
        for node in self.node_names:
            path = self._socket(node)
            self.wait(f"{node}'s agent", lambda p=path: os.path.exists(p), 60)  # type: ignore[misc]

    def _start_controller(self) -> None:
        cfg = self.config
        jobs = [
            {
                "name": JOB,
                "argv": [sys.executable, "-m", "demojob.train"],
                "pool": self.node_names,
                "nodes_count": cfg.active_nodes,
                "ranks_per_node": cfg.ranks_per_node,
                "tp": cfg.tp,
                "global_batch": cfg.global_batch,
                "log_dir": str(self.workdir / "ranks"),
                "env": {
                    "TG_STEPS": "1000000",
                    "TG_CKPT_DIR": str(self.workdir / "checkpoints"),
                    "TG_CKPT_EVERY": str(cfg.ckpt_every),
                    "TG_GLOBAL_BATCH": str(cfg.global_batch),
                    "TG_STEP_SLEEP_S": str(cfg.step_sleep_s),
                    "TG_LOG": str(self.loss_log),
                    "OMP_NUM_THREADS": "1",
                },
                "node_env": {
                    n: {"TRAINGUARD_AGENT_SOCKET": self._socket(n)} for n in self.node_names
                },
            }
        ]
        (self.workdir / "ranks").mkdir(exist_ok=True)
        (self.workdir / "jobs.json").write_text(json.dumps(jobs, indent=1))
        (self.workdir / "policy.json").write_text(json.dumps(drill_policy(), indent=1))
        tokens = [{"name": "demo-operator", "role": "operator", "token": self.operator_token}]
        env = {
            "TRAINGUARD_TOKENS": json.dumps(tokens),
            "TRAINGUARD_ACTUATOR": "local",
            "TRAINGUARD_LOCAL_JOBS_FILE": str(self.workdir / "jobs.json"),
            "TRAINGUARD_POLICY_FILE": str(self.workdir / "policy.json"),
            "TRAINGUARD_NODE_LOST_AFTER_S": "30",
            # Three nodes and back-to-back faults: the default quarantine budget (10% of
            # the fleet, at least one node, per hour) would refuse the second isolation.
            "TRAINGUARD_QUARANTINE_BUDGET_SHARE": "1.0",
        }
        port = self.server.rsplit(":", 1)[1]
        argv = cli_argv("controller", "--host", "127.0.0.1", "--port", port)
        database = f"sqlite:///{self.workdir / 'trainguard.db'}"
        child = self.procs.start(
            "controller", [*argv, "--database-url", database], env=self._env(env)
        )
        with ApiClient(self.server, timeout_s=2.0) as probe:
            ok = wait_until(lambda: probe.ready() or not child.alive(), timeout_s=60)
            if not (ok and child.alive()):
                raise DemoFailed(f"the controller did not start:\n{child.log_tail(30)}")
        self._issue_agent_tokens()

    def _issue_agent_tokens(self) -> None:
        """One token per node, as an operator provisions agents (``trainguard agent-token
        issue NODE``); shared agent tokens stay off, as they are by default."""
        with self.api() as api:
            for node in self.node_names:
                issued = api.agent_credentials(node)
                path = self._token_file(node)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(str(issued["token"]))
                tmp.chmod(0o600)
                os.replace(tmp, path)  # the agent never reads half a token

    @staticmethod
    def _env(extra: dict[str, str]) -> dict[str, str]:
        """Ours minus any TRAINGUARD_* meant for another controller, plus ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        return env | extra

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``predicate``; a child that died or the deadline passing is a DemoFailed."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            for child in self.procs.dead():
                raise DemoFailed(
                    f"{child.name} exited with status {child.popen.returncode} while waiting "
                    f"for {what}:\n{child.log_tail(20)}"
                )
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"timed out after {timeout_s:.0f} s waiting for {what}" + self._ranks_said()
                )
            time.sleep(0.2)

    def _ranks_said(self, lines: int = 4) -> str:
        """The last lines of the newest generation's rank logs (each distinct tail once).

        The ranks are the controller's children, not ours: one that exits (a bad setting,
        an import error) shows only as steps that never come, and its log goes with the
        work directory when the demo ends, so a timeout says what the ranks said last.
        """
        found: list[tuple[int, int, Path]] = []
        for path in (self.workdir / "ranks").glob(f"{JOB}.g*.rank*.log"):
            gen, _, rank = path.name[len(JOB) + 2 : -len(".log")].partition(".rank")
            if gen.isdigit() and rank.isdigit():
                found.append((int(gen), int(rank), path))
        newest = max((g for g, _, _ in found), default=None)
        shown: dict[str, list[str]] = {}
        for g, r, path in sorted(found):
            if g != newest:
                continue
            try:
                said = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            tail = "\n".join(line for line in said if line.strip())
            tail = "\n".join(tail.splitlines()[-lines:])
            if tail:
                shown.setdefault(tail, []).append(f"rank {r}")
        return "".join(
            f"\n{JOB} generation {newest} {', '.join(ranks)} said last:\n{tail}"
            for tail, ranks in shown.items()
        )

    # ------------------------------------------------------------------ reading

    def losses(self) -> list[JsonObject]:
        try:
            lines = self.loss_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines:
            if line.endswith("}"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line being written
        return rows

    def generation(self) -> int:
        rows = self.losses()
        return max((int(r["generation"]) for r in rows), default=0)

    def placement(self) -> tuple[list[str], int]:
        """(nodes in rank order, generation) of the job's newest launch."""
        with self.api() as api:
            restarts = [
                a
                for a in api.actions()
                if a.get("kind") == "restart_job" and a.get("status") == "succeeded"
            ]
        if restarts:
            newest = max(restarts, key=lambda a: a["params"].get("generation", 0))
            return list(newest["params"]["nodes"]), int(newest["params"]["generation"])
        return self.node_names[: self.config.active_nodes], 0

    # ------------------------------------------------------------------ faults

    def fault(self, kind: str) -> FaultOutcome:
        """Inject one fault after ``warmup_steps`` healthy steps and wait for the recovery."""
        if kind not in FAULT_KINDS:
            raise BadInput(f"unknown fault {kind!r}: choose from {', '.join(FAULT_KINDS)}")
        cfg = self.config
        gen = self.generation()
        self.wait(
            f"{cfg.warmup_steps} healthy steps before the {kind}",
            lambda: sum(1 for r in self.losses() if r["generation"] == gen) >= cfg.warmup_steps,
            cfg.recovery_timeout_s,
        )
        nodes, _ = self.placement()
        rows = self.losses()
        last = rows[-1]
        rpn = cfg.ranks_per_node
        if kind == "straggler":
            node = nodes[1 % len(nodes)]
            rank = nodes.index(node) * rpn + rpn - 1
        elif kind == "hang":
            node = nodes[-1]
            rank = nodes.index(node) * rpn + rpn - 1
        else:
            node, rank = nodes[0], None
        outcome = FaultOutcome(
            kind=kind,
            node=node,
            rank=rank,
            injected_unix_s=time.time(),
            generation_before=gen,
            world_before=int(last["world_size"]),
        )
        self._inject(kind, node, rank, int(last["step"]), gen)
        where = f"{node} rank {rank}" if rank is not None else f"{node} GPU 0"
        self.say(f"injected {kind} on {where}")
        self._await(outcome)
        return outcome

    def _inject(self, kind: str, node: str, rank: int | None, step: int, gen: int) -> None:
        gpu = 0 if rank is None else rank % self.config.ranks_per_node
        if kind == "xid":
            self._gpu_fault(node, f"kind=xid,code=79,gpu={gpu},at=0")
            return
        if kind == "straggler":
            # The hardware view (a hot, throttled GPU) and the job view (slow steps) together,
            # as a failing fan gives both.
            self._gpu_fault(node, f"kind=thermal,gpu={gpu},at=0,duration=600")
            fault = {"kind": "delay", "rank": rank, "from_step": 0,
                     "delay_s": self.config.straggler_delay_s}  # fmt: skip
        else:
            fault = hang_fault(rank, step, gen)
        self._chaos([fault])

    def _gpu_fault(self, node: str, spec: str) -> None:
        with self._fault_file(node).open("a") as f:
            f.write(spec + "\n")

    def _chaos(self, faults: list[JsonObject]) -> None:
        """Chaos faults through the API; 409 (ranks still reporting in) is retried."""
        deadline = time.monotonic() + 60
        with self.api() as api:
            while True:
                try:
                    api.inject_faults(JOB, faults, reason="trainguard demo")
                    return
                except BadInput as exc:
                    if "have not reported" not in str(exc) or time.monotonic() > deadline:
                        raise DemoFailed(f"chaos drill refused: {exc}") from None
                    time.sleep(0.5)

    def _await(self, outcome: FaultOutcome) -> None:
        wanted = DETECTED_AS[outcome.kind]
        timeout = self.config.recovery_timeout_s

        # One client for the whole wait: a new one per poll (five a second) cost ~20 ms of
        # CPU each, mostly building its TLS context.
        with self.api() as api:

            def detected() -> bool:
                found = [
                    i
                    for i in api.incidents()
                    if i.get("kind") in wanted
                    and float(i.get("opened_unix_s", 0)) >= outcome.injected_unix_s - 1.0
                ]
                if found:
                    outcome.incident = min(found, key=lambda i: float(i["opened_unix_s"]))
                return bool(found)

            self.wait(f"the {outcome.kind} to be detected", detected, timeout)
        if outcome.kind == "hang":
            # The fault began when the old run's last step completed: the step after it
            # hung (HANG_LEAD_STEPS on, or later where the command reached the rank late).
            done = [r for r in self.losses() if r["generation"] == outcome.generation_before]
            began = max((float(r["time_unix_s"]) for r in done), default=0.0)
            if began > outcome.injected_unix_s:
                outcome.injected_unix_s = began
        inc = outcome.incident or {}
        self.say(
            f"detected in {outcome.detect_s:.1f} s: incident #{inc.get('id')} {inc.get('kind')} "
            f"on {inc.get('node') or '-'} ranks {inc.get('ranks') or '-'}"
        )

        def resumed() -> bool:
            newer = [r for r in self.losses() if r["generation"] > outcome.generation_before]
            if newer:
                outcome.resumed = newer[0]
            return bool(newer)

        self.wait(f"the job to resume after the {outcome.kind}", resumed, timeout)
        before = [r for r in self.losses() if r["generation"] == outcome.generation_before]
        first = outcome.resumed or {}
        last_step = max((int(r["step"]) for r in before), default=None)
        outcome.last_step_before = last_step
        start = first.get("resumed_from")
        if last_step is not None and isinstance(start, int):
            outcome.steps_lost = max(0, last_step + 1 - start)
        self.say(
            f"resumed in {outcome.recover_s:.1f} s: generation {first.get('generation')} on "
            f"world size {first.get('world_size')} (was {outcome.world_before}), from step "
            f"{start}, {outcome.steps_lost} steps run again, loss {first.get('loss', 0.0):.3f}"
        )

    def goodput(self) -> JsonObject:
        with self.api() as api:
            return api.goodput(JOB)
