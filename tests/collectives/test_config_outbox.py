"""Settings from arguments and env vars; the bounded outbox between the two threads."""

from __future__ import annotations

import pytest

from collectives.config import DEFAULT_AGENT_SOCKET, InstrumentConfig, config_from_env
from collectives.errors import CollectivesConfigError
from collectives.outbox import Outbox
from trainguard.wire import RankEvent, StepSummary


def test_env_vars_fill_what_the_script_leaves_out() -> None:
    env = {
        "TRAINGUARD_JOB": "from-env",
        "TRAINGUARD_AGENT_SOCKET": "/tmp/a.sock",
        "TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S": "3.5",
        "TRAINGUARD_COLLECTIVES_HISTORY_CALLS": "10",
        "TRAINGUARD_COLLECTIVES_CUDA_EVENTS": "off",
    }
    cfg = config_from_env(env=env)
    assert (cfg.job, cfg.agent_socket, cfg.watchdog_floor_s) == ("from-env", "/tmp/a.sock", 3.5)
    assert cfg.history_calls == 10 and cfg.cuda_events is False
    assert config_from_env("explicit", env=env).job == "explicit"
    assert config_from_env("j", env={}).agent_socket == DEFAULT_AGENT_SOCKET
    assert DEFAULT_AGENT_SOCKET.endswith("/trainguard-agent.sock")  # the agent's default
    assert config_from_env("j", env={}, watchdog_multiplier=8).watchdog_multiplier == 8


@pytest.mark.parametrize(
    ("job", "env", "overrides", "fragment"),
    [
        (None, {}, {}, "no job name"),
        ("Bad_Name", {}, {}, "RFC 1123"),
        ("j", {"TRAINGUARD_COLLECTIVES_WATCHDOG_FLOOR_S": "soon"}, {}, "not a valid float"),
        ("j", {"TRAINGUARD_COLLECTIVES_CUDA_EVENTS": "maybe"}, {}, "not a valid bool"),
        ("j", {}, {"watchdog_floor_s": 0}, "watchdog_floor_s must be > 0"),
        ("j", {}, {"watchdog_multiplier": 0.5}, "watchdog_multiplier must be >= 1"),
        ("j", {}, {"history_calls": 0}, "history_calls must be >= 1"),
        ("j", {}, {"colour": "red"}, "unknown setting(s): colour"),
    ],
)
def test_bad_settings_are_refused_in_one_line(
    job: str | None, env: dict[str, str], overrides: dict[str, object], fragment: str
) -> None:
    with pytest.raises(CollectivesConfigError) as info:
        config_from_env(job, env=env, **overrides)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def _summary(step: int) -> StepSummary:
    return StepSummary(
        job="j",
        rank=0,
        world_size=1,
        step=step,
        step_time_s=1,
        compute_time_s=1,
        collective_wait_s=0,
    )


def test_outbox_drops_oldest_and_counts_drops() -> None:
    box = Outbox(limit=3)
    for i in range(5):
        box.add_step(_summary(i))
    assert box.dropped_total == 2
    batch = box.drain()
    assert [s.step for s in batch.steps] == [2, 3, 4]
    assert box.pending() == 0


def test_requeued_batch_goes_back_ahead_of_newer_records() -> None:
    box = Outbox(limit=4)
    for i in range(3):
        box.add_step(_summary(i))
    box.add_event(RankEvent(job="j", rank=0, kind="started", time_unix_s=1))
    batch = box.drain()
    box.add_step(_summary(3))
    box.add_step(_summary(4))
    box.requeue(batch)  # 5 steps now, limit 4: the oldest goes
    again = box.drain()
    assert [s.step for s in again.steps] == [1, 2, 3, 4]
    assert [e.kind for e in again.rank_events] == ["started"]
    assert box.dropped_total == 1


def test_config_is_a_keyword_only_dataclass() -> None:
    with pytest.raises(TypeError):
        InstrumentConfig("j")  # type: ignore[misc]


def test_a_batch_never_exceeds_the_wire_limits_and_the_excess_counts_as_dropped() -> None:
    from trainguard.wire import InflightCollective, LocalRecords

    box = Outbox(limit=10_000)
    for i in range(5_000):
        box.add_inflight(
            InflightCollective(job="j", rank=0, group="g", op="all_reduce", seq=i, elapsed_s=3)
        )
    batch = box.drain()
    assert len(batch.inflight) == 4_096 and batch.inflight[-1].seq == 4_999
    assert box.dropped_total == 5_000 - 4_096
    # what the client sends validates against the wire models on the agent's side
    frame = LocalRecords(records=batch).model_dump_json()
    assert len(LocalRecords.model_validate_json(frame).records.inflight) == 4_096


def test_checkpoint_events_ride_with_the_next_batch_and_survive_a_requeue() -> None:
    from trainguard.wire import CheckpointEvent

    box = Outbox(limit=10)
    event = CheckpointEvent(
        job="j", rank=0, step=7, kind="durable", size_bytes=1 << 20, duration_s=0.5, time_unix_s=1.0
    )
    box.add_checkpoint(event)
    assert box.pending() == 1
    batch = box.drain()
    assert batch.checkpoints == [event]
    box.requeue(batch)
    assert box.drain().checkpoints == [event]


def test_report_checkpoint_is_a_no_op_without_instrument() -> None:
    import collectives
    from trainguard.wire import CheckpointEvent

    assert collectives.current() is None
    collectives.report_checkpoint(
        CheckpointEvent(job="j", rank=0, step=1, kind="started", time_unix_s=1.0)
    )
