"""Peer groups leave the rank once per registration, not in every step summary (issue 15).

The outbox replaces each shipped summary's ``group_ranks`` by its id and declares the
membership the first time the id goes out on a connection; a new connection (the client
registers again with its agent) declares it again. The summaries the rank keeps (tests and
the job read ``outbox.steps``) keep their lists.
"""

from __future__ import annotations

from typing import Any

from collectives.outbox import Outbox
from trainguard import wire


def _step(step: int, ranks: list[int], **extra: Any) -> wire.StepSummary:
    return wire.StepSummary(
        job="train",
        rank=ranks[0],
        world_size=2000,
        step=step,
        step_time_s=1.0,
        compute_time_s=0.9,
        collective_wait_s=0.1,
        group_ranks=ranks,
        **extra,
    )


STAGE = list(range(0, 2000, 8))  # 250 ranks: one pipeline stage of a 2,000-rank job


def test_membership_goes_out_once_per_registration() -> None:
    box = Outbox(1000)
    box.registered()
    for i in range(3):
        box.add_step(_step(i, STAGE))
    first = box.drain()
    gid = wire.peer_group_id(STAGE)
    assert [s.peer_group for s in first.steps] == [gid] * 3
    assert all(s.group_ranks == [] for s in first.steps)
    assert [(g.id, g.ranks) for g in first.peer_groups] == [(gid, STAGE)]
    # the frame is what the agent validates: it round-trips through the wire model
    again = wire.JobRecords.model_validate_json(first.model_dump_json())
    assert again.peer_groups[0].ranks == STAGE and again.steps[0].peer_group == gid

    box.add_step(_step(3, STAGE))
    second = box.drain()
    assert second.peer_groups == [] and second.steps[0].peer_group == gid

    box.registered()  # reconnected: the agent (maybe a new one) hears of the group again
    box.add_step(_step(4, STAGE))
    assert [g.id for g in box.drain().peer_groups] == [gid]


def test_a_role_change_declares_the_new_group_and_requeue_redeclares() -> None:
    box = Outbox(1000)
    other = list(range(1, 2000, 8))
    box.add_step(_step(0, STAGE))
    box.add_step(_step(1, other))
    batch = box.drain()
    assert [g.ranks for g in batch.peer_groups] == [STAGE, other]
    box.requeue(batch)  # the agent never got it: referred summaries and all go again
    again = box.drain()
    assert [s.peer_group for s in again.steps] == [s.peer_group for s in batch.steps]
    assert [g.ranks for g in again.peer_groups] == [STAGE, other]


def test_the_kept_summary_still_lists_its_peers_and_unknown_peers_stay_empty() -> None:
    box = Outbox(1000)
    box.add_step(_step(0, STAGE))
    box.add_step(_step(1, [5]).model_copy(update={"group_ranks": []}))
    assert box.steps.items[0].group_ranks == STAGE  # before shipping
    batch = box.drain()
    assert batch.steps[1].peer_group is None and batch.steps[1].group_ranks == []
    assert len(batch.peer_groups) == 1


def test_the_reference_is_much_smaller_than_the_list() -> None:
    """The reason for all this: a 2,000-rank job whose peer group is the whole data-parallel
    world sent every rank's 2,000 ranks in every summary."""
    world = list(range(2000))
    with_list = len(_step(0, world).model_dump_json())
    box = Outbox(1000)
    box.add_step(_step(0, world))
    box.drain()  # the declaration went out with the first one
    box.add_step(_step(1, world))
    referred = len(box.drain().steps[0].model_dump_json())
    assert referred * 10 < with_list
