"""A rank's declared role fields make its role as derived ones do (acceptance probe, p7).

``set_role(pp_stage=3)`` with no role once left ``role`` unset (the role was made before the
declared fields were applied): every stage then reported one peer group, and the stage
slower by design was called stragglers. With the process-group sizes known it reported
``pg_sizes=...``, the same string on every stage. These are plain ``RoleTracker`` checks:
no process group, no mesh.
"""

from __future__ import annotations

from collectives.roles import RoleTracker


def test_a_declared_stage_alone_gives_the_stage_role() -> None:
    tracker = RoleTracker(6, 64)
    tracker.declare(pp_stage=3, dp_rank=0, tp_rank=0)
    fields = tracker.fields
    assert (fields["role"], fields["pp_stage"], fields["group_ranks"]) == ("pp_stage=3", 3, [])


def test_declared_stages_are_told_apart_even_with_the_group_sizes_known() -> None:
    """Every stage uses groups of the same sizes (TP 2, DP 8): the sizes alone cannot tell
    the stages apart, the declared stage must."""
    roles = {}
    for rank, stage in ((0, 0), (6, 3)):
        groups = {"tp": [rank, rank + 1], "dp": [rank + 8 * i for i in range(8)]}
        tracker = RoleTracker(rank, 64, groups=groups)
        assert tracker.fields["role"] == "pg_sizes=2,8"
        tracker.declare(pp_stage=stage)
        roles[rank] = tracker.fields["role"]
    assert roles == {0: "pp_stage=0", 6: "pp_stage=3"}


def test_a_declared_role_still_wins_over_a_declared_stage() -> None:
    tracker = RoleTracker(6, 64)
    tracker.declare(pp_stage=3)
    tracker.declare(role="loss-stage")
    assert (tracker.fields["role"], tracker.fields["pp_stage"]) == ("loss-stage", 3)
    # Declared at construction (the launcher's env), then refined by a stage: role kept.
    tracker = RoleTracker(1, 8, role="expert")
    tracker.declare(pp_stage=1)
    assert (tracker.fields["role"], tracker.fields["pp_stage"]) == ("expert", 1)
