"""Acceptance sweep of link-probe result patterns: what the localizer concludes from each.

Pure: plain ``ProbeResult`` lists into ``localize`` (and ``JobTracker.finish_probe``, and
``suspect_links`` on a generated fabric). Ranks sit 4 to a node (``steps.node_of``); pairs
are the ring-neighbour pairs a real round probes. On real servers ranks on one node talk
over NVLink (here 300 GB/s), ranks on different nodes over the network (here 50 GB/s).
"""

from __future__ import annotations

import math

import pytest

from controller.logic.detection.c4d import Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.probe import localize
from controller.logic.traffic.fattree import FatTreeSpec, build_fat_tree
from controller.logic.traffic.jobs import JobSpec
from controller.logic.traffic.localize import pair_links, rank_nic, suspect_links
from controller.logic.traffic.planner import Plan, Planner, PlannerConfig
from tests.controller.c4d.steps import JOB, node_of, step_records
from trainguard.wire import JobRecords, ProbeResult

SIZE = 8 << 20
NVLINK, NET = 300.0, 50.0
Pair = tuple[int, int]


def ring(world: int) -> list[Pair]:
    return [(i, (i + 1) % world) for i in range(world)]


def nodes(world: int) -> dict[int, str]:
    return {r: node_of(r) for r in range(world)}


def result(a: int, b: int, gbps: float | None = None, **kw: object) -> ProbeResult:
    """A probe answer for pair (a, b); ``gbps`` None: whatever ``kw`` says (a failure)."""
    dur = SIZE * 8 / (gbps * 1e9) if gbps else 0.0
    fields = {"size_bytes": SIZE, "duration_s": dur} | kw
    return ProbeResult(job=JOB, probe_id="p1", src_rank=a, dst_rank=b, **fields)


def hostile(a: int, b: int, **kw: object) -> ProbeResult:
    """An answer the wire would refuse (NaN, inf, negative): built without validation, as a
    bug in between could hand it over."""
    base = {"job": JOB, "probe_id": "p1", "src_rank": a, "dst_rank": b, "size_bytes": SIZE}
    base |= {"duration_s": 0.001, "ok": True, "error": "", "missed": False}
    return ProbeResult.model_construct(**(base | kw))  # type: ignore[arg-type]


def realistic(world: int, slow: dict[Pair, float] | None = None) -> list[ProbeResult]:
    """A healthy round on real servers (NVLink inside a node, the network between), with
    the pairs in ``slow`` at the given GB/s."""
    where = nodes(world)
    out = []
    for a, b in ring(world):
        gbps = (slow or {}).get((a, b), NVLINK if where[a] == where[b] else NET)
        out.append(result(a, b, gbps))
    return out


def flat(world: int, slow: dict[Pair, float], healthy: float = 100.0) -> list[ProbeResult]:
    """Every pair of one kind (simulated nodes on one host, as the e2e runs)."""
    return [result(a, b, slow.get((a, b), healthy)) for a, b in ring(world)]


def verdict_of(
    results: list[ProbeResult], world: int
) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    v = localize(results, nodes(world), 0.5)
    return v.scope, v.culprit_ranks, v.culprit_nodes


# ----------------------------------------------------------------- (1)-(3) one fault


def test_healthy_servers_with_nvlink_inside_nodes_report_nothing() -> None:
    """Node-boundary pairs run over the network, ~6x slower than NVLink by design. Judged
    against one median over all pairs (NVLink's, 12 of 16), all 4 were "slow" and a
    healthy cluster got a ``slow_link`` finding; each pair is judged against its kind."""
    v = localize(realistic(16), nodes(16), 0.5)
    assert (v.scope, v.slow_pairs) == ("none", ())


@pytest.mark.parametrize("pair", [(1, 2), (3, 4), (15, 0)])
def test_one_slow_link_is_that_link_inside_a_node_or_across(pair: Pair) -> None:
    """(1) One degraded link, NVLink or network, in a 16-rank ring: the two ranks."""
    v = localize(realistic(16, {pair: 5.0}), nodes(16), 0.5)
    assert (v.scope, v.slow_pairs, v.culprit_ranks) == ("link", (pair,), tuple(sorted(pair)))


def test_one_slow_rank_is_that_rank() -> None:
    """(2) A rank whose GPU is slow slows both of its ring pairs: that rank, its node.
    ``median_gbps`` is the reference the slowest pair was judged against (its kind's)."""
    v = localize(realistic(16, {(1, 2): 20.0, (2, 3): 30.0}), nodes(16), 0.5)
    assert (v.scope, v.culprit_ranks, v.culprit_nodes) == ("rank", (2,), ("node-0",))
    assert v.median_gbps == NVLINK


def test_a_slow_nic_at_a_node_boundary_looks_like_its_link() -> None:
    """Trade-off: rank 4's NIC carries only its pair across the boundary (3, 4); its other
    pair (4, 5) is NVLink. One slow pair cannot tell a NIC from a cable: the link."""
    v = localize(realistic(16, {(3, 4): 5.0}), nodes(16), 0.5)
    assert (v.scope, v.culprit_ranks) == ("link", (3, 4))


def test_a_node_with_slow_network_is_named_from_its_two_boundary_pairs() -> None:
    """(3) Ranks 4-7 on node-1 with a slow network: the ring shows it only on the two pairs
    crossing its boundaries, (3, 4) and (7, 8); their intra-node pairs ride NVLink and are
    healthy. node-1 is the one node in both: the node, through its boundary ranks."""
    v = localize(realistic(16, {(3, 4): 10.0, (7, 8): 12.0}), nodes(16), 0.5)
    assert (v.scope, v.culprit_nodes, v.culprit_ranks) == ("node", ("node-1",), (4, 7))


def test_a_whole_slow_node_is_named() -> None:
    """(3) The whole node slow (its host): all 5 pairs touching ranks 4-7; the culprits are
    its ranks, not their partners on the nodes either side."""
    slow = {(3, 4): 10.0, (4, 5): 60.0, (5, 6): 60.0, (6, 7): 60.0, (7, 8): 10.0}
    v = localize(realistic(16, slow), nodes(16), 0.5)
    assert (v.scope, v.culprit_nodes, v.culprit_ranks) == ("node", ("node-1",), (4, 5, 6, 7))


def test_two_node_job_with_one_slow_nic_cannot_say_which_node() -> None:
    """Trade-off: with 2 nodes, both boundary pairs run through both nodes' NICs, and with
    both slow their kind has no healthy pair to compare with: nothing stands out."""
    v = localize(realistic(8, {(3, 4): 10.0, (7, 0): 10.0}), nodes(8), 0.5)
    assert v.scope == "none"


# ------------------------------------------------------------ (4)-(6) several, or all


def test_two_independent_slow_links_are_two_links_not_a_rank_or_node() -> None:
    """(4) Slow links (1, 2) and (9, 10) share no rank and no node: both links, and the
    finding names each pair (not "the link between ranks [1, 2, 9, 10]")."""
    results = realistic(16, {(1, 2): 5.0, (9, 10): 8.0})
    v = localize(results, nodes(16), 0.5)
    assert (v.scope, v.slow_pairs, v.culprit_ranks) == ("link", ((1, 2), (9, 10)), (1, 2, 9, 10))
    finding = finish(results, 16)
    assert finding is not None and "links between ranks 1-2, 9-10" in finding.summary


def test_a_uniformly_slow_fabric_is_nothing_a_probe_can_localize() -> None:
    """(5) Every pair equally slow: nothing is slow relative to the others. "none" means
    "no link stands out", not "the fabric is healthy" (the reference is the slow speed
    itself); the comm_slow incident stays open and the round runs again."""
    v = localize(flat(8, {}, healthy=3.0), nodes(8), 0.5)
    assert (v.scope, v.median_gbps) == ("none", 3.0)


def test_exactly_half_slow_still_stands_out() -> None:
    """(6) A slow rank in a 4-rank ring slows 2 of its 4 pairs. The plain median was the
    mean of a slow and a healthy pair (70), and a 2.5x slow rank (40 vs 100) passed as
    healthy; the upper median is a healthy pair's."""
    v = localize(flat(4, {(0, 1): 40.0, (1, 2): 40.0}), {}, 0.5)
    assert (v.scope, v.culprit_ranks, v.median_gbps) == ("rank", (1,), 100.0)


def test_more_than_half_slow_makes_the_reference_slow() -> None:
    """(6) Trade-off: with 5 of 8 pairs slow the reference is slow itself, and the 3
    healthy pairs are faster than it, which says nothing: a relative probe cannot tell
    "most links slow" from "this is their speed". Nothing is reported, not the healthy."""
    slow = {p: 10.0 for p in ring(8)[:5]}
    v = localize(flat(8, slow), {}, 0.5)
    assert (v.scope, v.slow_pairs, v.median_gbps) == ("none", (), 10.0)


# ------------------------------------------------------------ (7) failed and missed


def test_failed_transfers_with_a_slow_pair_blame_their_common_rank() -> None:
    """(7) Rank 5 gone: its transfer to 6 failed, the one from 4 crawled."""
    results = flat(8, {(4, 5): 5.0})
    results[5] = result(5, 6, ok=False, error="timeout")
    assert verdict_of(results, 8) == ("rank", (5,), ("node-1",))


def test_all_failed_is_failed_scope_unless_one_node_holds_every_pair() -> None:
    """(7) No transfer completed across 2 nodes: ``failed`` (the placement marks no link
    for it). Failed pairs count as slow ones, as documented, so where one node is in every
    pair (a one-node job) that node is named, as it would be for slow pairs."""
    results = [result(a, b, ok=False, error="timeout") for a, b in ring(8)]
    v = localize(results, nodes(8), 0.5)
    assert (v.scope, v.culprit_ranks, v.median_gbps) == ("failed", tuple(range(8)), 0.0)
    results = [result(a, b, ok=False, error="timeout") for a, b in ring(4)]
    assert verdict_of(results, 4) == ("node", (0, 1, 2, 3), ("node-0",))


def test_missed_answers_are_no_evidence_not_failed_links() -> None:
    """(7) A rank that got its command late answers ``missed`` (ok=False, no timing). The
    service drops those before the tracker; ``localize`` read one as a failed transfer and
    blamed the pair, so it ignores them too."""
    late = [result(1, 2, ok=False, missed=True, error="late")]
    assert localize(late, nodes(4), 0.5).scope == "none"
    results = [*flat(8, {}), result(3, 4, ok=False, missed=True, error="late")]
    assert localize(results, nodes(8), 0.5).scope == "none"
    assert finish(late, 4) is None


# ------------------------------------------------------------------ (8) hostile input


@pytest.mark.parametrize(
    "bad",
    [
        {"duration_s": 0.0},  # ok, but nothing timed
        {"size_bytes": 0},  # 0 GB/s from 0 bytes
        {"duration_s": -1.0},
        {"duration_s": math.nan},
        {"duration_s": math.inf},
        {"duration_s": 1e-320},  # an infinite bandwidth
    ],
)
def test_a_timing_that_measured_nothing_blames_nobody(bad: dict[str, float]) -> None:
    """(8) Before, a zero duration counted as a failed link and zero bytes as 0 GB/s: each
    put a link nobody measured in the verdict. Such an answer is no evidence."""
    results = flat(8, {})
    results[3] = hostile(3, 4, **bad)
    v = localize(results, nodes(8), 0.5)
    assert (v.scope, v.slow_pairs) == ("none", ())
    assert (3, 4) not in v.pair_gbps and all(math.isfinite(g) for g in v.pair_gbps.values())


def test_hostile_timing_beside_a_real_slow_link_keeps_the_link() -> None:
    results = [*flat(8, {(5, 6): 5.0}), hostile(1, 2, duration_s=math.nan)]
    assert verdict_of(results, 8) == ("link", (5, 6), ("node-1",))


def test_duplicate_answers_keep_the_fastest_and_a_success_beats_a_failure() -> None:
    """(8) A pair answered twice (a retried report, a rank that ran twice): its fastest
    timing, as the probe keeps the fastest of its own rounds (a degraded link is slow
    every time, a busy host only sometimes); a completed transfer proves the pair did carry
    it, so a failure beside it does not count."""
    results = [*flat(8, {}), result(2, 3, 5.0), result(4, 5, ok=False, error="timeout")]
    v = localize(results, nodes(8), 0.5)
    assert v.scope == "none" and v.pair_gbps[(2, 3)] == pytest.approx(100.0)
    results = flat(8, {(2, 3): 5.0}) * 2  # the same answers twice
    assert verdict_of(results, 8) == ("link", (2, 3), ("node-0",))


def test_self_pairs_and_unknown_ranks_do_not_raise_or_blame() -> None:
    """(8) A rank paired with itself is no link; a rank nobody placed gets node "?"."""
    results = [*flat(8, {}), result(6, 6, 1.0)]
    assert localize(results, nodes(8), 0.5).scope == "none"
    v = localize(flat(8, {(6, 7): 1.0}), {}, 0.5)
    assert (v.scope, v.culprit_ranks, v.culprit_nodes) == ("link", (6, 7), ("?",))


def test_tracker_drops_answers_for_ranks_outside_the_world() -> None:
    """(8) The tracker keeps only pairs inside the world it learned from step summaries."""
    results = [*flat(8, {}), result(7, 40, 1.0), result(99, 0, ok=False, error="x")]
    assert finish(results, 8) is None


# --------------------------------------------------------------- (9) a 2-rank job


def test_a_two_rank_job_has_no_reference_to_be_slow_against() -> None:
    """(9) Trade-off: one pair is its own median, so it is never slow (a slow link there
    is for comm_slow, which compares with the job's own history); a failed transfer still
    names both ranks."""
    assert localize([result(0, 1, 0.5)], nodes(2), 0.5).scope == "none"
    v = localize([result(0, 1, ok=False, error="timeout")], nodes(2), 0.5)
    assert (v.scope, v.culprit_ranks) == ("failed", (0, 1))


def finish(results: list[ProbeResult], world: int) -> Finding | None:
    """The tracker's finding for a round with these answers (world learned from steps)."""
    trackers = JobTrackers()
    steps = step_records(0, world)
    for node in sorted({node_of(s.rank) for s in steps}):
        rows = [s for s in steps if node_of(s.rank) == node]
        trackers.observe(node, JobRecords(steps=rows), 0.0)
    trackers.observe("node-0", JobRecords(probes=results), 0.0)
    finding = trackers.jobs[JOB].finish_probe("p1")
    assert finding is None or finding.kind is FindingKind.SLOW_LINK
    return finding


# ------------------------------------------------------- (10) from pairs to fabric links


def two_nic_plan() -> Plan:
    """16 two-NIC servers, two GPUs each, one data-parallel ring in launcher order."""
    topo = build_fat_tree(FatTreeSpec(nodes=16, nics_per_node=2, ports_per_nic=1, nodes_per_leaf=4))
    job = JobSpec(
        nodes=[n.name for n in topo.nodes], gpus_per_node=2, tp=1, channels=1, grad_bytes=1 << 26
    )
    return Planner(topo, PlannerConfig(reorder_ring=False)).plan(job)


def test_a_probe_pair_with_no_planned_flows_still_names_its_access_links() -> None:
    """(10) The ring's planned flows cross nodes NIC k to NIC k; the probe pair (1, 2) runs
    from node 0's NIC 1 to node 1's NIC 0, a route the plan never uses. Its slow answer
    marked nothing (no links); now the links every route between those NICs crosses."""
    plan = two_nic_plan()
    topo = plan.topology
    assert rank_nic(plan, 1) == (0, 1) and rank_nic(plan, 2) == (1, 0)
    links = {topo.link_names[i] for i in pair_links(plan, 1, 2)}
    src, dst = topo.nodes[0].name, topo.nodes[1].name
    assert links and all(f"{src}/nic1/" in n or f"{dst}/nic0/" in n for n in links)
    assert pair_links(plan, 0, 1) == set()  # one node: NVLink, no fabric link
    ok = [p for p in ring(plan.job.world) if p != (1, 2)]
    suspects = suspect_links(plan, [(1, 2)], ok)
    assert suspects and set(suspects) <= links


def test_slow_pairs_sharing_no_link_name_each_ones_own_links() -> None:
    """(10) Two slow pairs far apart share no link: each one's links no healthy pair uses,
    and none a healthy pair uses."""
    plan = two_nic_plan()
    world = plan.job.world
    slow = [(3, 4), (21, 22)]
    ok = [p for p in ring(world) if p not in slow]
    suspects = suspect_links(plan, slow, ok)
    healthy = set().union(*(pair_links(plan, a, b) for a, b in ok))
    per_pair = [pair_links(plan, a, b) for a, b in slow]
    assert not per_pair[0] & per_pair[1]
    found = {plan.topology.link_index[s] for s in suspects}
    assert found & per_pair[0] and found & per_pair[1] and not found & healthy


# ------------------------------------------------------------ (8) unequal severities


def test_a_marginal_pair_beside_a_badly_slow_link_does_not_make_their_rank_the_culprit() -> None:
    """(8) Link (1, 2) 16x slow and pair (2, 3) 2.5x slow (a descheduled rank 2 under load):
    a slow GPU or NIC of rank 2 would slow both about alike, so the link is named, and the
    lesser pair is reported as marginal. Before, rank 2 was named (scope ``rank``)."""
    results = flat(8, {(1, 2): 100.0 / 16, (2, 3): 40.0})
    v = localize(results, nodes(8), 0.5)
    assert (v.scope, v.slow_pairs, v.culprit_ranks) == ("link", ((1, 2),), (1, 2))
    assert v.marginal_pairs == ((2, 3),)
    finding = finish(results, 8)
    assert finding is not None and finding.ranks == (1, 2)
    assert "far less: 2-3" in finding.summary
    assert finding.evidence.model_dump()["marginal_pairs"] == [[2, 3]]  # the API shows it


def test_pairs_of_one_severity_still_name_their_common_rank() -> None:
    """(8) The band is relative to each pair's kind: an NVLink pair and a network pair of
    one slow rank, each ~5x slow against its own kind, are one severity."""
    v = localize(realistic(16, {(2, 3): 60.0, (3, 4): 9.0}), nodes(16), 0.5)
    assert (v.scope, v.culprit_ranks, v.marginal_pairs) == ("rank", (3,), ())
