"""An acceptance sweep of job layouts and call patterns, through real gloo ranks (world 4).

The other multi-rank tests run one layout each (the world and one sub-group made before
``instrument()``, FSDP2/DTensor/pipelining on two ranks). Real jobs build their groups in
many shapes, often after the wrapper is on, and reach the same group through different
APIs. Every one of those must still give the controller what it aligns ranks by: one group
id per group on every member, the group's right ranks, and the same sequence numbers for
the same call on every member; and none may raise into the job or deadlock it.

Swept here (``layout_worker.py``), every group made after ``instrument()``:

- non-contiguous groups ``[0, 2]`` / ``[1, 3]`` (``new_group``), ``new_subgroups(2)``, a 2-D
  ``DeviceMesh`` (dp x tp) and its ``get_group()``s, a nested ``[0, 1, 2]`` and a
  ``[1, 2, 3]`` that rank 0 is not in (its call is torch's no-op there);
- one group reached through eager ``all_reduce``, functional collectives (given the
  ProcessGroup, ``(mesh, dim)`` or the group's name), ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor``, async calls waited out of order, ``batch_isend_irecv`` over
  the world and over the tp group (``group_peer``);
- a subgroup destroyed and one over the same ranks made again;
- step hooks entered twice per iteration (the same number twice, nested blocks, two
  optimizers both given to ``hook_optimizer``), and calls outside any step;
- a rank entering a collective on ``[0, 2]`` that its peer enters only seconds later: the
  in-flight report must name the group's ranks so the controller can tell who is absent.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.collectives.conftest import FakeAgent

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("layout_worker.py")
WORLD = 4


def _run(
    rank_launcher: Any, scenario: str, out: Path, agent: FakeAgent, **env: str
) -> list[dict[str, Any]]:
    ranks = rank_launcher(
        scenario, WORLD, out, socket_path=agent.path, env=env or None, worker=WORKER
    )
    return ranks.results(60)


def test_groups_of_every_shape_keep_ids_ranks_and_sequences_aligned(
    tmp_path: Path, collectives_agent: FakeAgent, rank_launcher: Any
) -> None:
    results = _run(rank_launcher, "sweep", tmp_path, collectives_agent)

    # 1. Each labelled group: one id on all of its members, its right ranks, no two alike.
    expected = {
        "pair": lambda r: [r % 2, r % 2 + 2],
        "sub": lambda r: [r // 2 * 2, r // 2 * 2 + 1],
        "tp": lambda r: [r // 2 * 2, r // 2 * 2 + 1],
        "dp": lambda r: [r % 2, r % 2 + 2],
        "g012": lambda r: [0, 1, 2],
        "g123": lambda r: [1, 2, 3],
        "g012b": lambda r: [0, 1, 2],
        "world": lambda r: [0, 1, 2, 3],
    }
    ids: dict[str, dict[tuple[int, ...], set[str]]] = defaultdict(lambda: defaultdict(set))
    for rank, res in enumerate(results):
        for label, want in expected.items():
            if (label in ("g012", "g012b") and rank == 3) or (label == "g123" and rank == 0):
                assert label not in res["groups"]
                continue
            group = res["groups"][label]
            assert group["ranks"] == want(rank), (rank, label)
            assert res["group_ranks"][group["id"]] == want(rank), (rank, label)
            ids[label][tuple(want(rank))].add(group["id"])
    all_ids: list[str] = []
    for label, by_ranks in ids.items():
        for ranks, seen in by_ranks.items():
            assert len(seen) == 1, f"{label} {ranks}: ids differ across members: {seen}"
            all_ids += seen
    # same ranks, other group (pair vs dp, sub vs tp, g012 vs its successor): other id
    assert len(all_ids) == len(set(all_ids)), all_ids

    # 2. Every group's calls: only its members record them, all with the same sequence.
    calls: dict[str, dict[int, list[tuple[Any, ...]]]] = defaultdict(dict)
    for rank, res in enumerate(results):
        assert res["inflight"] == 0, f"rank {rank} left calls in flight"
        assert all(h["ok"] and h["done"] for h in res["history"])
        per_group: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for h in sorted(res["history"], key=lambda h: (h["group"], h["seq"])):
            per_group[h["group"]].append((h["seq"], h["op"], h["size_bytes"], h["step"]))
        for group, seqs in per_group.items():
            assert [s[0] for s in seqs] == list(range(1, len(seqs) + 1)), (rank, group)
            members = res["group_ranks"][group]
            assert rank in members, (rank, group, members)
            calls[group][rank] = seqs
    for group, by_rank in calls.items():
        members = results[min(by_rank)]["group_ranks"][group]
        assert sorted(by_rank) == members, f"{group}: recorded by {sorted(by_rank)}"
        first = by_rank[members[0]]
        if group.startswith("p2p-"):
            # A pair channel counts calls in the order each end issues them: a symmetric
            # exchange (both ends list isend, then irecv, as pipelines do) numbers a's send
            # 2 and b's receive of it 3. Counts, sizes and steps agree; the ops mirror.
            (_, fa), (_, fb) = sorted(by_rank.items())
            assert [(s, n, st) for s, _, n, st in fa] == [(s, n, st) for s, _, n, st in fb]
            mirror = {"isend": "irecv", "irecv": "isend"}
            assert sorted(mirror[op] for _, op, _, _ in fa) == sorted(op for _, op, _, _ in fb)
            continue
        for rank in members[1:]:
            assert by_rank[rank] == first, f"{group}: rank {rank} differs from {members[0]}"

    # 3. Specific calls landed on the group they were issued on, with the right op.
    for rank, res in enumerate(results):
        g = {label: v["id"] for label, v in res["groups"].items()}
        by_step: dict[Any, list[tuple[str, str, int]]] = defaultdict(list)
        for h in sorted(res["history"], key=lambda h: (h["group"], h["seq"])):
            by_step[h["step"]].append((h["op"], h["group"], h["seq"]))
        # eager and functional calls on the same mesh group share its one counter
        tp_step2 = [(op, seq) for op, grp, seq in by_step[2] if grp == g["tp"]]
        assert tp_step2 == [
            ("all_reduce", 1),
            ("all_reduce", 2),  # funcol via (mesh, 1)
            ("all_gather_into_tensor", 3),  # funcol via the group's name
            ("all_reduce", 4),
        ]
        dp_step2 = [(op, seq) for op, grp, seq in by_step[2] if grp == g["dp"]]
        assert dp_step2 == [("all_reduce", 1), ("reduce_scatter_tensor", 2)]
        p2p = sorted((op, grp) for op, grp, _ in by_step[4])
        nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
        partner = rank ^ 1
        pairs = {f"p2p-{min(rank, p)}-{max(rank, p)}" for p in (nxt, prv, partner)}
        assert {grp for _, grp in p2p} == pairs
        assert sorted(op for op, _ in p2p) == ["irecv", "irecv", "isend", "isend"]
        if rank == 0:
            assert not any(grp.startswith("g3-") and grp != g["g012"] for _, grp, _ in by_step[5])
        # the successor of a destroyed group counts from 1
        if rank != 3:
            assert [(op, s) for op, grp, s in by_step[6] if grp == g["g012b"]] == [
                ("all_reduce", 1)
            ]
        # calls outside any step are recorded with no step: one after step 10, then the
        # two gradients before the first hooked optimizer.step()
        assert [op for op, _, _ in by_step[None]] == ["all_reduce"] * 3

    # 4. Results are what the job computed (the wrapper changed nothing).
    for rank, res in enumerate(results):
        tp_peer = rank ^ 1
        r1, r2, r3, r4 = res["results"]["funcol"]
        assert r1 == [float((rank % 2 + 1) + (rank % 2 + 3))] * 2
        assert r2 == [float(rank // 2 * 2 + 1 + rank // 2 * 2 + 2)] * 2
        assert sorted(r3) == sorted([float(rank + 1)] * 2 + [float(tp_peer + 1)] * 2)
        assert r4 == [float((rank % 2 + 1) + (rank % 2 + 3))] * 2
        got, got_tp = res["results"]["p2p"]
        assert got == [float((rank - 1) % WORLD + 1)] * 2
        assert got_tp == [float(tp_peer + 1)] * 3
        assert res["results"]["async"][0] == [10.0] * 3

    # 5. Step summaries (as the agent got them): the same step numbers on every rank, the
    # calls of each step counted alike.
    agent_steps = collectives_agent.steps()
    memberships = {
        g.id: g.ranks for _, batch in collectives_agent.records() for g in batch.peer_groups
    }
    for rank, res in enumerate(results):
        numbers = sorted(s for r, s in agent_steps if r == rank)
        # the repeated 7 goes out as 8, and the loop's 9 keeps its spacing from it: 10
        # then two hooked optimizers: the first's hook marks 20 and 21 (sent as 21, 22: the
        # offset stays), the second's are refused as nested; the last step is still open
        assert numbers == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 21, 22], (rank, numbers)
        by_num = {s: agent_steps[rank, s] for s in numbers}
        counted: dict[int, int] = defaultdict(int)
        for h in res["history"]:
            if h["step"] is not None:
                counted[h["step"]] += 1
        for step, summary in by_num.items():
            assert summary.collective_calls == counted[step], (rank, step)
        # the nested block was refused: the outer step (sent as 10) has both its calls
        assert by_num[8].collective_calls == 1 and by_num[10].collective_calls == 2
        assert by_num[21].collective_calls == by_num[22].collective_calls == 2
        # the mesh (dp x tp, no pp dim) names dp/tp ranks from step 2 on, all four as peers
        assert (by_num[2].dp_rank, by_num[2].tp_rank) == (rank // 2, rank % 2)
        peer_group = by_num[2].peer_group
        assert peer_group is not None and memberships[peer_group] == [0, 1, 2, 3]


def test_a_rank_alone_in_a_noncontiguous_group_is_reported_with_its_peers(
    tmp_path: Path, collectives_agent: FakeAgent, rank_launcher: Any
) -> None:
    """Rank 0 waits in an all_reduce on [0, 2] that rank 2 enters ~2.5 s late: rank 0's
    in-flight report names the group's ranks and its last completed call there, so the
    controller finds rank 2 absent (neither inside the call nor past it)."""
    results = _run(
        rank_launcher,
        "absent",
        tmp_path,
        collectives_agent,
        TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S="0.5",
        TRAINGUARD_COLLECTIVES_WATCHDOG_INTERVAL_S="0.1",
        TRAINGUARD_COLLECTIVES_WATCHDOG_REPEAT_S="0.5",
    )
    pair = results[0]["pair"]
    assert results[2]["pair"] == pair and results[1]["pair"] != pair
    reports = [x for x in collectives_agent.inflight() if x.group == pair]
    assert reports, "rank 0's wait on [0, 2] was never reported"
    assert {x.rank for x in reports} == {0}  # rank 2 never entered it while 0 waited
    for x in reports:
        assert (x.op, x.seq, x.step) == ("all_reduce", 2, 1)
        assert x.group_ranks == [0, 2]
        assert x.last_completed_seq[pair] == 1
    # the other pair finished its call at once: nothing of it was reported stuck
    assert not [x for x in collectives_agent.inflight() if x.group == results[1]["pair"]]
    for rank in (0, 2):
        mine = [
            (h["op"], h["seq"], h["ok"]) for h in results[rank]["history"] if h["group"] == pair
        ]
        assert mine == [("all_reduce", 1, True), ("all_reduce", 2, True)]
