"""Real multi-process torch.distributed jobs (gloo on CPU) under instrumentation.

Each test launches rank processes with a torchrun-like environment and judges what the
ranks recorded (their own JSON dumps) and what reached a real Unix-socket agent stand-in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from collectives import flight
from trainguard.wire import JobDumpTrace

pytestmark = pytest.mark.slow

OPS_IN_ORDER = [
    ("all_reduce", 16),
    ("all_gather", 48),
    ("all_gather_into_tensor", 48),
    ("reduce_scatter", 48),
    ("reduce_scatter_tensor", 48),
    ("broadcast", 16),
    ("barrier", 0),
    ("all_to_all", 48),
    ("all_to_all_single", 48),
    ("reduce", 16),
    ("gather", 16),
    ("scatter", 16),
    ("all_reduce", 16),  # async_op=True
]


def _load(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_every_op_is_recorded_alike_on_every_rank_and_no_agent_costs_nothing(
    tmp_path: Path, short_dir: Path, rank_launcher: Any
) -> None:
    ranks = rank_launcher("ops", 3, tmp_path, socket_path=str(short_dir / "absent.sock"))
    try:
        codes = ranks.wait(90)
        assert codes == [0, 0, 0], "\n".join(
            f"--- rank {r} exited {c}:\n{ranks.stderr(r)[-3000:]}"
            for r, c in enumerate(codes)
            if c != 0
        )
    finally:
        ranks.kill()
    results = _load(tmp_path, 3)
    world_ids = set()
    for rank, res in enumerate(results):
        assert res["wrapped"] and res["restored"]
        # link probes get their own group over all ranks, on the CPU under gloo
        assert res["probe_group"] == {"ranks": [0, 1, 2], "own": True, "device": "cpu"}
        hist = res["history"]
        step0 = [h for h in hist if h["step"] == 0]
        world = [h for h in step0 if h["group"] == step0[0]["group"]]
        world_ids.add(step0[0]["group"])
        assert [(h["op"], h["size_bytes"]) for h in world] == OPS_IN_ORDER
        assert [h["seq"] for h in world] == list(range(1, len(OPS_IN_ORDER) + 1))
        assert all(h["dtype"] == "float32" for h in world if h["op"] != "barrier")
        assert all(h["exit_s"] >= h["enter_s"] and h["ok"] for h in hist)
        assert [h["async_op"] for h in world] == [False] * 12 + [True]
        assert res["async_sum"] == [6.0] * 4  # the async all_reduce really ran: 1+2+3
        sub = [h for h in step0 if h["group"].startswith("g2-")]
        if rank in (0, 2):
            assert [(h["op"], h["seq"], h["async_op"]) for h in sub] == [
                ("all_reduce", 1, False),
                ("broadcast", 2, True),
            ]
        else:
            assert sub == []
        p2p = [(h["op"], h["group"], h["seq"]) for h in step0 if h["group"].startswith("p2p")]
        expected_p2p = {
            0: [
                ("send", "p2p-0-1", 1),
                ("recv", "p2p-0-1", 2),
                ("isend", "p2p-0-2", 1),  # batch_isend_irecv
                ("irecv", "p2p-0-2", 2),
            ],
            1: [("recv", "p2p-0-1", 1), ("send", "p2p-0-1", 2), ("isend", "p2p-1-2", 1)],
            2: [("irecv", "p2p-1-2", 1), ("isend", "p2p-0-2", 1), ("irecv", "p2p-0-2", 2)],
        }
        assert p2p == expected_p2p[rank]
        # step summary counts exactly the calls the step issued
        (summary,) = res["summaries"]
        assert summary["collective_calls"] == len(step0)
        assert summary["collective_bytes"] == sum(h["size_bytes"] for h in step0)
        assert summary["compute_time_s"] + summary["collective_wait_s"] == pytest.approx(
            summary["step_time_s"]
        )
        # training steps: two all_reduces each (weight, bias), nothing recorded after uninstrument
        assert [h["step"] for h in hist if h["step"] != 0] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert res["history_after"] == len(hist)
        assert res["losses"][-1] < res["losses"][0]
        # no agent: said once, retried quietly
        assert ranks.stderr(rank).count("no node agent") == 1
        assert res["connect_failures"] >= 2
    assert len(world_ids) == 1  # the group id is the same on every rank
    assert results[0]["weights"] == results[1]["weights"] == results[2]["weights"]


SIGNATURE_FAULTS = [
    {"kind": "delay", "rank": 1, "from_step": 2, "to_step": 5, "delay_s": 0.15},
    {"kind": "slowdown", "rank": 2, "from_step": 8, "to_step": 11, "factor": 4},
    {"kind": "slow_link", "ranks": [0, 1], "from_step": 14, "to_step": 17, "delay_s": 0.05},
    {"kind": "nan", "rank": 0, "at_step": 19},
    {"kind": "slow_link", "ranks": [0, 1], "at_step": 21, "delay_s": 0.05},
]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def test_fault_signatures_commands_and_probe_reach_the_agent(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    from trainguard.wire import JobCheckpoint, JobLinkProbe, JobStop

    agent = collectives_agent
    agent.commands = [
        (
            -1,
            JobLinkProbe(
                id="p1",
                job="test-job",
                at_step=21,
                pairs=[(0, 1), (1, 2), (0, 2)],
                size_bytes=65536,
            ),
        ),
        (-1, JobCheckpoint(id="c1", job="test-job", at_step=23)),
        (-1, JobCheckpoint(id="other-job", job="another-job", at_step=3)),
        (25, JobStop(id="s1", job="test-job", reason="drill")),
    ]
    ranks = rank_launcher(
        "signatures",
        3,
        tmp_path,
        socket_path=agent.path,
        env={
            "TRAINGUARD_FAULTS": json.dumps(SIGNATURE_FAULTS),
            "TRAINGUARD_COLLECTIVES_HEARTBEAT_INTERVAL_S": "0.3",
        },
    )
    try:
        codes = ranks.wait(90)
        assert codes == [0, 0, 0], "\n".join(
            f"--- rank {r} exited {c}:\n{ranks.stderr(r)[-3000:]}"
            for r, c in enumerate(codes)
            if c != 0
        )
    finally:
        ranks.kill()
    results = _load(tmp_path, 3)
    stopped = {res["stopped_at"] for res in results}
    assert len(stopped) == 1 and 25 <= stopped.pop() < 80
    assert all(res["nan_steps"] == [19] for res in results)
    assert all(res["ckpt_steps"] == [23] for res in results)

    assert sorted((h.rank, h.world_size, h.job) for h in agent.hellos) == [
        (r, 3, "test-job") for r in range(3)
    ]
    steps = agent.steps()
    last = results[0]["stopped_at"]
    assert set(steps) == {(r, s) for r in range(3) for s in range(last + 1)}
    comp = {k: v.compute_time_s for k, v in steps.items()}
    wait = {k: v.collective_wait_s for k, v in steps.items()}
    base = [1, 6, 7, 12, 13]
    # delay on rank 1: it computes longer, the others wait for it (the C4 straggler signature)
    for s in range(2, 6):
        assert comp[1, s] - max(comp[0, s], comp[2, s]) > 0.1, s
        assert min(wait[0, s], wait[2, s]) - wait[1, s] > 0.1, s
    # slowdown x4 of a 30 ms compute on rank 2: ~90 ms more compute, the others wait
    for s in range(8, 12):
        assert comp[2, s] - max(comp[0, s], comp[1, s]) > 0.05, s
        assert min(wait[0, s], wait[1, s]) - wait[2, s] > 0.05, s
    # slow link 0-1 (50 ms per collective, 2 per step): every rank waits, nobody computes more
    for r in range(3):
        base_wait = _median([wait[r, s] for s in base])
        base_comp = _median([comp[r, s] for s in base])
        for s in range(14, 18):
            assert wait[r, s] - base_wait > 0.07, (r, s)
            assert comp[r, s] - base_comp < 0.05, (r, s)
    # the poisoned all_reduce input is seen on rank 0 only, before the call spread it
    nonfinite = {k: v for k, v in steps.items() if v.nonfinite_inputs}
    assert list(nonfinite) == [(0, 19)]
    assert (nonfinite[0, 19].nonfinite_first_op, nonfinite[0, 19].nonfinite_first_seq) == (
        "all_reduce",
        2 + 2 * 19,  # the barrier, then two all_reduces per step
    )
    assert all(v.collective_calls == 2 for v in steps.values())
    assert all(v.collective_bytes == 256 * 4 + 4 for v in steps.values())
    # the link probe at step 21: pair (0, 1) carries the injected slow link
    probes = {(p.src_rank, p.dst_rank): p for p in agent.probes()}
    assert set(probes) == {(0, 1), (1, 2), (0, 2)}
    assert all(p.ok and p.probe_id == "p1" and p.size_bytes == 65536 for p in probes.values())
    assert probes[0, 1].duration_s >= 0.04
    assert probes[0, 1].duration_s > 5 * max(probes[1, 2].duration_s, probes[0, 2].duration_s)
    # rank events: started, heartbeats, exited (exit code unknown for a clean interpreter exit)
    events = agent.wait_for(lambda: [e for e in agent.events() if e.kind == "exited"], 5)
    assert sorted(e.rank for e in events) == [0, 1, 2]
    kinds = {(e.rank, e.kind) for e in agent.events()}
    assert all((r, k) in kinds for r in range(3) for k in ("started", "heartbeat"))


def test_hang_before_a_collective_is_reported_while_it_lasts(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    """...and, with torch's Flight Recorder on, a ``JobDumpTrace`` command sent once the hang
    is reported (as the controller does) gets every rank's buffer while all three training
    threads are stuck (ranks 0 and 1 inside gloo's all_reduce, rank 2 in the injected hang);
    the analysis of the three dumps names the collective and the rank that never entered it,
    as trainguard's own reports do."""
    agent = collectives_agent
    fault = [{"kind": "hang", "rank": 2, "at_step": 4, "op": "all_reduce", "where": "before"}]
    ranks = rank_launcher(
        "loop",
        3,
        tmp_path,
        socket_path=agent.path,
        env={
            "TRAINGUARD_FAULTS": json.dumps(fault),
            "TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S": "0.5",
            "TRAINGUARD_COLLECTIVES_WATCHDOG_REPEAT_S": "0.4",
            "TRAINGUARD_COLLECTIVES_WATCHDOG_INTERVAL_S": "0.1",
            "TRAINGUARD_COLLECTIVES_HEARTBEAT_INTERVAL_S": "0.2",
            "TORCH_FR_BUFFER_SIZE": "200",
            "TRAINGUARD_COLLECTIVES_TRACE_DUMP_DIR": str(tmp_path / "fr"),
        },
        # the hung rank also reports its stall outside collectives (opt-in; default: in-process)
        rank_env={2: {"TRAINGUARD_COLLECTIVES_REPORT_COMPUTE_STALLS": "1"}},
    )

    def enough() -> bool:
        stuck = [x for x in agent.inflight() if x.step == 4]
        return all(sum(1 for x in stuck if x.rank == r) >= 3 for r in (0, 1, 2))

    def heartbeats(rank: int) -> int:
        return sum(1 for e in agent.events() if e.rank == rank and e.kind == "heartbeat")

    def traces() -> dict[int, Any]:
        return {t.rank: t for _, b in agent.records() for t in b.traces}

    try:
        # start-up (three torch imports on a shared 2-core box) can take a while
        assert agent.wait_for(lambda: (2, 3) in agent.steps(), 60), ranks.stderr(2)[-2000:]
        assert agent.wait_for(enough, 30), agent.inflight()
        with agent.lock:
            agent.commands.append((3, JobDumpTrace(id="fr1", job="test-job", incident_id="i-1")))
        assert agent.wait_for(lambda: len(traces()) == 3, 30), ranks.stderr(0)[-2000:]
        beats = heartbeats(2)
        assert agent.wait_for(lambda: heartbeats(2) > beats, 5)  # the hung rank is alive
        assert [p.poll() for p in ranks.procs] == [None, None, None]  # still hung
    finally:
        ranks.kill()
    # On a loaded box the start-up barrier (outside any step) can pass the 0.5 s floor too and
    # be reported while ranks start at different speeds: that is not the hang looked at here.
    stuck = [x for x in agent.inflight() if x.step is not None]
    # barrier after instrument is world seq 1; step k's all_reduce is seq k + 2
    world = {x.group for x in stuck if x.rank in (0, 1)}
    assert len(world) == 1
    gid = world.pop()
    for r in (0, 1):
        mine = [x for x in stuck if x.rank == r]
        assert {(x.op, x.seq, x.step) for x in mine} == {("all_reduce", 6, 4)}
        assert all(x.elapsed_s >= 0.5 and x.last_completed_seq[gid] == 5 for x in mine)
        assert all(x.group_ranks == [0, 1, 2] for x in mine)
        elapsed = [x.elapsed_s for x in mine]
        assert elapsed == sorted(elapsed) and elapsed[-1] > elapsed[0]  # re-reported, growing
    # the hung rank never entered seq 6 (it is absent from the call, which is what names it);
    # asked to, it reports itself stuck in compute at step 4, its last completed seq lagging
    culprit = [x for x in stuck if x.rank == 2]
    assert {(x.op, x.group, x.seq, x.step) for x in culprit} == {("compute", "", 0, 4)}
    assert all(x.last_completed_seq == {gid: 5} for x in culprit)
    steps = agent.steps()
    assert max(s for r, s in steps if r == 2) == 3
    assert max(s for r, s in steps if r in (0, 1)) == 3
    # Flight Recorder's verdict, from the dumps alone, against trainguard's above
    dumps = traces()
    assert all(t.enabled and t.command_id == "fr1" and not t.error for t in dumps.values())
    assert all(Path(t.path).is_file() for t in dumps.values())  # full dumps kept on the node
    members: dict[str, list[int]] = {}
    for t in dumps.values():
        members.update(t.pg_ranks)
    (div,) = flight.analyze({r: {"entries": t.entries} for r, t in dumps.items()}, members)
    assert (div.entered, div.missing) == ([0, 1], [2])  # trainguard: 0 and 1 stuck, 2 absent
    assert flight.family(div.op) == "all_reduce" and div.input_sizes == [[8]]
    assert div.seq == 6  # the wrapper numbers the world group as Flight Recorder does


def test_crash_faults_exit_with_the_code_or_signal_and_say_so(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    agent = collectives_agent
    faults = [
        {"kind": "crash", "rank": 1, "at_step": 3, "exit_code": 7},
        {"kind": "crash", "rank": 2, "at_step": 3, "op": "all_reduce", "signal": "SIGKILL"},
    ]
    ranks = rank_launcher(
        "loop",
        3,
        tmp_path,
        socket_path=agent.path,
        env={"TRAINGUARD_FAULTS": json.dumps(faults)},
    )
    try:
        codes = ranks.wait(40)
    finally:
        ranks.kill()
    assert codes[1] == 7 and codes[2] == -9, codes
    exited = {e.rank: e for e in agent.events() if e.kind == "exited"}
    assert exited[1].exit_code == 7 and exited[1].signal is None
    assert exited[2].signal == "SIGKILL" and exited[2].exit_code is None
    assert not exited[1].collective_failed and not exited[2].collective_failed
    # rank 0 was left waiting in an all_reduce with dead peers: gloo raised there, the rank
    # died of it, and says the error escaped a collective (collateral, not a culprit)
    assert codes[0] == 1, ranks.stderr(0)[-2000:]
    assert exited[0].exit_code == 1 and exited[0].collective_failed
    assert exited[0].error and "\n" not in exited[0].error
    steps = agent.steps()
    assert max(s for r, s in steps if r == 1) == 2  # crashed at the start of step 3


def test_a_poisoned_gradient_is_traced_to_the_rank_that_produced_it(
    tmp_path: Path, collectives_agent: Any, rank_launcher: Any
) -> None:
    from controller.logic.detection.c4d import FindingKind, JobTrackers

    agent = collectives_agent
    # rank 2's third gradient (the second layer's weight) turns NaN at step 5; the all_reduce
    # hands it to every rank, and from step 6 on every rank's weights and gradients are NaN
    fault = [{"kind": "nan", "rank": 2, "at_step": 5, "op": "all_reduce", "call": 3}]
    ranks = rank_launcher(
        "train",
        4,
        tmp_path,
        socket_path=agent.path,
        env={"TRAINGUARD_FAULTS": json.dumps(fault), "TG_STEPS": "10"},
    )
    try:
        codes = ranks.wait(120)
        assert codes == [0, 0, 0, 0], "\n".join(
            f"--- rank {r} exited {c}:\n{ranks.stderr(r)[-3000:]}"
            for r, c in enumerate(codes)
            if c != 0
        )
    finally:
        ranks.kill()
    results = _load(tmp_path, 4)
    assert all(res["nan_losses"] == [6, 7, 8, 9] for res in results)  # it spread to everyone
    steps = agent.steps()
    assert {r for (r, s), v in steps.items() if s == 5 and v.nonfinite_inputs} == {2}
    # from step 6 both weight gradients (1 KiB each) carry it; the biases are below the floor
    assert all(steps[r, s].nonfinite_inputs == 2 for r in range(4) for s in range(6, 10))
    first = steps[2, 5]
    assert (first.nonfinite_first_op, first.nonfinite_first_seq) == ("all_reduce", 1 + 5 * 4 + 3)
    trackers = JobTrackers()
    for rank, batch in agent.records():
        trackers.observe(f"node-{rank // 2}", batch, 0.0)
    found = trackers.evaluate(1.0)
    assert [(f.kind, f.ranks, f.nodes) for f in found] == [
        (FindingKind.NONFINITE, (2,), ("node-1",))
    ]
    assert found[0].evidence.step == 5 and found[0].evidence.nonfinite_ranks == [2]


def test_a_rank_killed_from_outside_is_named_not_its_survivors(
    tmp_path: Path, short_dir: Path, rank_launcher: Any
) -> None:
    """SIGKILL leaves no exit record: the real agent endpoint reports the vanished rank,
    and the controller's crash logic names it, the survivors' failures its collateral."""
    import signal
    import threading
    import time

    from agents.local_endpoint import LocalEndpoint, Session
    from controller.logic.detection.c4d import FindingKind, JobTrackers
    from trainguard.wire import JobRecords

    arrived: list[tuple[str, JobRecords]] = []
    lock = threading.Lock()

    def sink(session: Session, records: JobRecords, _size: int) -> None:
        assert session.hello is not None
        with lock:
            arrived.append((f"node-{session.hello.rank // 2}", records))

    def stepped(rank: int) -> int:
        with lock:
            return max((s.step for n, b in arrived for s in b.steps if s.rank == rank), default=-1)

    endpoint = LocalEndpoint(short_dir / "agent.sock", on_records=sink, vanish_grace_s=0.5)
    endpoint.start()
    ranks = rank_launcher(
        "loop", 3, tmp_path, socket_path=str(endpoint.path), env={"TG_STEPS": "100000"}
    )
    try:
        deadline = time.monotonic() + 60
        while stepped(1) < 3:
            assert time.monotonic() < deadline, ranks.stderr(1)[-2000:]
            time.sleep(0.05)
        ranks.procs[1].send_signal(signal.SIGKILL)
        codes = ranks.wait(30)
        deadline = time.monotonic() + 10
        while not any(e.disconnected for _, b in list(arrived) for e in b.rank_events):
            assert time.monotonic() < deadline, "the agent never reported the killed rank"
            time.sleep(0.05)
    finally:
        ranks.kill()
        endpoint.stop()
    assert codes[1] == -9 and codes[0] == codes[2] == 1, (
        codes,  # a survivor still running: its stderr says where it waits
        {r: ranks.stderr(r)[-1500:] for r in (0, 2) if codes[r] != 1},
    )
    exits = {e.rank: e for _, b in arrived for e in b.rank_events if e.kind == "exited"}
    assert exits[1].disconnected and exits[1].exit_code is None and exits[1].signal is None
    assert exits[0].collective_failed and exits[2].collective_failed
    assert not exits[0].disconnected and not exits[2].disconnected
    # feed the controller in arrival order (its clock: well inside the collateral grace)
    trackers = JobTrackers()
    found = []
    failed_before: list[int] = []  # survivors' failures that arrived by the finding
    for i, (node, batch) in enumerate(arrived):  # one batch: one rank's records
        if not found:
            failed_before += [e.rank for e in batch.rank_events if e.collective_failed]
        trackers.observe(node, batch, float(i) * 0.01)
        found += trackers.evaluate(float(i) * 0.01)
    found += trackers.evaluate(100.0)
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.RANK_CRASH, (1,))]
    # The crash is named as soon as the job is seen broken; a survivor's failure arriving
    # after that is folded in silently (the finding is not re-issued), so the evidence
    # lists exactly the survivors whose failures had arrived by then: at least one.
    assert failed_before and set(failed_before) <= {0, 2}
    assert found[0].evidence.collateral_ranks == sorted(set(failed_before))
