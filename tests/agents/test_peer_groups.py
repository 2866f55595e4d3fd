"""The agent answers a controller that lost its peer groups (``ReportReply.peer_groups_unknown``)
from the memberships its ranks declared, in its next report."""

from __future__ import annotations

import tempfile
from pathlib import Path

from agents.daemon import Agent
from agents.peer_groups import PeerGroupCache
from tests.agents.test_daemon import settings
from trainguard import wire

RANKS = [0, 8, 16, 24]
GID = wire.peer_group_id(RANKS)


def _declared(job: str = "train") -> wire.JobRecords:
    return wire.JobRecords(peer_groups=[wire.PeerGroup(job=job, id=GID, ranks=RANKS)])


def test_the_agent_declares_again_what_the_controller_asks_for(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="tga-") as sock_dir:
        agent = Agent(settings(tmp_path, Path(sock_dir), "http://127.0.0.1:9"))
        try:
            agent._on_records(None, _declared(), 100)  # type: ignore[arg-type]
            with agent.batch.lock:
                agent.batch.reset(agent.spool.next_seq)  # that report went out
            unknown = [
                wire.PeerGroupRef(job="train", id=GID),
                wire.PeerGroupRef(job="train", id="pg4-000000000000000000000000"),
            ]
            agent._on_reply(wire.ReportReply(seq=0, peer_groups_unknown=unknown))
            with agent.batch.lock:
                again = agent.batch.peek().records.peer_groups
        finally:
            agent.batch.close()
            agent.backend.shutdown()
    assert [(g.job, g.id, g.ranks) for g in again] == [("train", GID, RANKS)]


def test_the_cache_is_bounded_and_keeps_the_newest() -> None:
    cache = PeerGroupCache(limit=2)
    for job in ("a", "b", "c"):
        cache.remember(_declared(job))
    refs = [wire.PeerGroupRef(job=j, id=GID) for j in ("a", "b", "c")]
    assert [g.job for g in cache.wanted(refs).peer_groups] == ["b", "c"] and len(cache) == 2
