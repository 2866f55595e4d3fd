"""Roles and peer groups in step summaries: derived from DeviceMesh / pipelining, or declared.

Meshes here are real ``DeviceMesh`` objects laid out for an 8-rank job and seen from one of
its ranks (``_rank``) without creating its process groups: the layout arithmetic is what is
tested; the multi-process FSDP2/pipelining runs (test_torch_parallel.py) check it on real
groups.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import collectives
from collectives.config import config_from_env
from collectives.roles import RoleTracker, mesh_fields, pg_sizes_role
from tests import fresh_python

pytestmark = pytest.mark.usefixtures("single_rank")


def _mesh(names: tuple[str, ...], shape: tuple[int, ...], rank: int) -> DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    return DeviceMesh(
        "cpu",
        torch.arange(n).reshape(shape),
        mesh_dim_names=names,
        _init_backend=False,
        _rank=rank,
    )


def _one_step(session: Any) -> Any:
    with collectives.step(0):
        dist.all_reduce(torch.ones(4))
    return list(session.outbox.steps.items)[-1]


def test_pp_dp_tp_mesh_gives_stage_ranks_and_stage_peers() -> None:
    # rank r sits at (pp, dp, tp) = (r // 4, r // 2 % 2, r % 2)
    for rank in range(8):
        fields = mesh_fields(_mesh(("pp", "dp", "tp"), (2, 2, 2), rank))
        assert fields is not None
        assert (fields["pp_stage"], fields["dp_rank"], fields["tp_rank"]) == (
            rank // 4,
            rank // 2 % 2,
            rank % 2,
        )
        stage = rank // 4
        assert fields["group_ranks"] == list(range(4 * stage, 4 * stage + 4))


def test_hsdp_dims_flatten_row_major_and_without_pp_every_rank_is_a_peer() -> None:
    fields = mesh_fields(_mesh(("dp_replicate", "dp_shard", "tp"), (2, 2, 2), 6))
    assert fields is not None
    assert fields["dp_rank"] == 3 and fields["tp_rank"] == 0
    assert "pp_stage" not in fields
    assert fields["group_ranks"] == list(range(8))


def test_a_mesh_built_after_instrument_sets_the_summary_role_fields() -> None:
    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
    first = _one_step(session)
    assert (first.role, first.pp_stage, first.group_ranks) == (None, None, [])
    mesh = _mesh(("pp", "dp", "tp"), (2, 2, 2), 5)
    _mesh(("dp",), (8,), 5)  # a later, smaller helper mesh must not hide the 3-D one
    summary = _one_step(session)
    assert summary.role == "pp_stage=1"
    assert (summary.pp_stage, summary.dp_rank, summary.tp_rank) == (1, 0, 1)
    assert summary.group_ranks == [4, 5, 6, 7]
    collectives.uninstrument()
    assert DeviceMesh.__init__.__name__ == "__init__"
    assert not hasattr(DeviceMesh.__init__, "__wrapped__")
    del mesh


def test_a_mesh_built_before_instrument_is_found() -> None:
    mesh = _mesh(("pp", "tp"), (4, 2), 7)
    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
    summary = _one_step(session)
    assert (summary.role, summary.pp_stage, summary.tp_rank) == ("pp_stage=3", 3, 1)
    assert summary.group_ranks == [6, 7]
    del mesh


def test_declared_role_wins_and_set_role_refines_it() -> None:
    mesh = _mesh(("pp", "dp"), (2, 4), 1)
    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock", role="expert")
    summary = _one_step(session)
    assert summary.role == "expert"
    assert (summary.pp_stage, summary.dp_rank) == (0, 1)  # the rest still derived
    collectives.set_role(group_ranks=[1, 3])
    summary = _one_step(session)
    assert (summary.role, summary.group_ranks) == ("expert", [1, 3])
    with pytest.raises(collectives.CollectivesConfigError, match="role must be"):
        collectives.set_role("x" * 200)
    del mesh


def test_explicit_mesh_is_kept_over_a_bigger_one() -> None:
    small = _mesh(("pp",), (8,), 2)
    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock", mesh=small)
    big = _mesh(("pp", "dp", "tp"), (2, 2, 2), 2)
    summary = _one_step(session)
    assert (summary.pp_stage, summary.group_ranks) == (2, [2])
    del small, big


def test_a_pipeline_stage_spanning_the_job_is_its_own_peer_group() -> None:
    from torch.distributed.pipelining import PipelineStage

    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
    stage = PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"))
    summary = _one_step(session)
    assert (summary.role, summary.pp_stage, summary.group_ranks) == ("pp_stage=0", 0, [0])
    del stage


def test_role_comes_from_the_launcher_env_too() -> None:
    cfg = config_from_env("unit", env={"TRAINGUARD_COLLECTIVES_ROLE": "expert"})
    assert cfg.role == "expert"
    tracker = RoleTracker(0, 1, role=cfg.role)
    assert tracker.fields["role"] == "expert"


def test_process_group_sizes_give_the_role_when_nothing_says_more() -> None:
    """TP groups of two sizes, no mesh, no declared role: ranks are told apart by the sizes
    of the groups their collectives use (world group and p2p channels aside)."""
    groups: dict[str, list[int]] = {"g8-world": list(range(8))}
    tracker = RoleTracker(5, 8, groups=groups)
    assert tracker.fields["role"] is None  # the world group only: plain data parallel
    groups["g2-a"] = [4, 5]
    groups["p2p-5-6"] = [5, 6]
    assert tracker.fields["role"] == "pg_sizes=2"
    groups["g4-dp"] = [1, 3, 5, 7]
    assert tracker.fields["role"] == "pg_sizes=2,4"
    assert tracker.fields["group_ranks"] == []
    # A mesh says more (the ranks of this rank's stage); a declared role wins over both.
    tracker.see_mesh(_mesh(("pp", "dp"), (2, 4), 5))
    assert tracker.fields["role"] == "pp_stage=1"
    tracker.declare(role="expert")
    assert tracker.fields["role"] == "expert"


def test_pg_sizes_role_ignores_the_world_and_point_to_point_channels() -> None:
    assert pg_sizes_role([("g4-w", [0, 1, 2, 3]), ("p2p-0-1", [0, 1])], 4) is None
    assert pg_sizes_role([("g2-a", [0, 1]), ("g2-b", [0, 2]), ("g1-c", [0])], 4) == ("pg_sizes=1,2")


def test_the_session_derives_the_role_from_the_groups_its_collectives_use() -> None:
    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
    assert _one_step(session).role is None
    # A real (1-rank) subgroup next to the 1-rank world is still the world's size here;
    # the session passes the wrapper's own group map, which this reads.
    assert session.roles.fields is session.roles.fields
    session.recorder.group_ranks["g2-fake"] = [0, 1]
    assert _one_step(session).role == "pg_sizes=2"


def test_the_scan_for_live_meshes_skips_dead_weak_proxies() -> None:
    """gc.get_objects() can hand back a weakref.proxy whose referent died; isinstance() on it
    raises ReferenceError, which once failed every later instrument() in the process."""
    import weakref

    from torch.distributed.device_mesh import DeviceMesh

    from collectives.roles import _live

    class Gone:
        pass

    target = Gone()
    holder = [weakref.proxy(target)]
    del target
    assert _live((DeviceMesh,)) == [] or all(
        isinstance(m, DeviceMesh) for m in _live((DeviceMesh,))
    )
    assert holder  # the dead proxy was in gc's objects during the scan


_LAZY_STAGES = """
import sys, tempfile, torch, torch.distributed as dist, collectives
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
assert "torch.distributed.pipelining" not in sys.modules, "instrument() imported pipelining"
def step(i):
    with collectives.step(i):
        dist.all_reduce(torch.ones(4))
    return list(session.outbox.steps.items)[-1]
assert step(0).role is None
from torch.distributed.pipelining import PipelineStage
built_before_the_next_step = PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("cpu"))
summary = step(1)
assert (summary.role, summary.pp_stage, summary.group_ranks) == ("pp_stage=0", 0, [0]), summary
collectives.uninstrument()
from torch.distributed.pipelining.stage import _PipelineStageBase
assert not hasattr(_PipelineStageBase.__init__, "__wrapped__")
print("ok")
"""


@pytest.mark.slow
def test_instrument_leaves_pipelining_unimported_and_still_sees_a_later_stage() -> None:
    """In a fresh interpreter (this one has imported pipelining long ago): instrument()
    does not pay for ``torch.distributed.pipelining`` (1.6 s of CPU per rank); a job that
    imports it later and builds a stage still gets the stage's role in its next summary."""
    done = fresh_python.run(_LAZY_STAGES)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_scan_finds_instances_of_subclasses_and_nothing_else() -> None:
    """The scan matches exact types against every subclass (isinstance through torch's
    metaclass was 3x slower): a job's own DeviceMesh subclass must still be found."""
    from collectives.roles import _live

    class Base:
        pass

    class Mine(Base):
        pass

    class Deeper(Mine):
        pass

    class Slotted(Base):
        __slots__ = ("x",)

    class Other:
        pass

    kept = [Base(), Mine(), Deeper(), Slotted(), Other(), Mine]
    found = _live((Base,))
    assert sorted(type(obj).__name__ for obj in found) == ["Base", "Deeper", "Mine", "Slotted"]
    assert kept


def test_a_declared_group_is_checked_at_set_role_not_on_the_training_step() -> None:
    """The wire refuses a rank listed twice in group_ranks (bdaf5ee); the summary carrying
    a declared group is built inside step(), so set_role([3, 1, 1]) made every later step
    raise. A repeated rank is the same rank; a rank that cannot be one is refused at once."""
    import numpy as np

    session = collectives.instrument("unit", agent_socket="/nonexistent/tg.sock")
    collectives.set_role(group_ranks=[3, 1, 1, np.int64(0)])
    assert _one_step(session).group_ranks == [0, 1, 3]
    for bad in ([-1], [1.5], [True], ["2"], [2**31]):
        with pytest.raises(collectives.CollectivesConfigError, match="group_ranks must be"):
            collectives.set_role(group_ranks=bad)
    assert _one_step(session).group_ranks == [0, 1, 3]  # a refused call changed nothing
