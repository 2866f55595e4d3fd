"""What the report budgets leave out is on the agent's /metrics.

An XID storm or a hardware-event storm is folded to stay under the wire's cap (agents.batch:
the newest per code or subject, with a count): the controller then sees fewer events than
the node had. The batch counted them, but only in memory; an operator comparing the
controller's view with the node had no number for the difference.
"""

from __future__ import annotations

from typing import Any

from agents.metrics import AgentCollector
from tests.agents.test_agent_leftovers import _storm
from trainguard.wire import CommandAck, NodeSample, XidEvent

DROPPED = (
    "trainguard_agent_xids_dropped",
    "trainguard_agent_hardware_events_dropped",
    "trainguard_agent_command_acks_dropped",
)


def _dropped(agent: Any) -> dict[str, float]:
    return {
        m.name: m.samples[0].value
        for m in AgentCollector(agent.metrics_source).collect()
        if m.name in DROPPED
    }


def test_folded_xid_and_event_storms_are_counted_on_metrics(agent_factory: Any) -> None:
    agent = agent_factory()
    template = agent.sample()
    assert _dropped(agent) == dict.fromkeys(DROPPED, 0.0)
    agent.batch.reset(agent.spool.next_seq)
    for t in range(1, 21):
        xids = [XidEvent(code=13, time_unix_s=t + i / 1e4, gpu_index=0) for i in range(500)]
        gpus = [g.model_copy(update={"xid_events": xids}) for g in template.gpus]
        sample = NodeSample(time_unix_s=float(t), gpus=gpus, events=_storm(float(t)))
        agent.batch.add_sample(sample)
    batch = agent.batch
    assert batch.dropped_xids_total > 0 and batch.dropped_events_total > 0
    assert _dropped(agent) == {
        "trainguard_agent_xids_dropped": float(batch.dropped_xids_total),
        "trainguard_agent_hardware_events_dropped": float(batch.dropped_events_total),
        "trainguard_agent_command_acks_dropped": 0.0,
    }


def test_acks_past_their_budget_are_counted_on_metrics(agent_factory: Any) -> None:
    """An ack past the per-report ack budget is dropped (the controller sends the command
    again): the count says how many answers the controller never got."""
    agent = agent_factory()
    batch = agent.batch
    batch.reset(agent.spool.next_seq)
    reason = "r" * 1000
    sent = batch.ack_budget_bytes // 1000 + 5  # past the budget by a few
    for i in range(sent):
        batch.add_ack(CommandAck(command_id=f"cmd-{i}", status="failed", reason=reason))
    kept = len(batch.peek().acks)
    assert batch.dropped_acks_total > 0 and kept + batch.dropped_acks_total == sent
    assert _dropped(agent)["trainguard_agent_command_acks_dropped"] == float(
        batch.dropped_acks_total
    )
