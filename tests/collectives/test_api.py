"""The public face of :mod:`collectives` is small and frozen."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import collectives


def test_public_names_are_pinned() -> None:
    assert sorted(collectives.__all__) == [
        "CollectivesConfigError",
        "CollectivesError",
        "FaultSpecError",
        "InstrumentConfig",
        "NotInstrumentedError",
        "add_faults",
        "checkpoint_agreed",
        "checkpoint_vote",
        "current",
        "hook_optimizer",
        "instrument",
        "on_checkpoint",
        "report_checkpoint",
        "set_role",
        "should_checkpoint",
        "should_stop",
        "step",
        "uninstrument",
    ]
    for name in collectives.__all__:
        assert getattr(collectives, name) is not None


def test_exception_tree() -> None:
    assert issubclass(collectives.FaultSpecError, collectives.CollectivesConfigError)
    assert issubclass(collectives.CollectivesConfigError, collectives.CollectivesError)
    assert issubclass(collectives.NotInstrumentedError, collectives.CollectivesError)


def test_instrument_before_init_process_group_says_what_to_do() -> None:
    assert not dist.is_initialized()
    with pytest.raises(collectives.CollectivesConfigError, match="init_process_group"):
        collectives.instrument("job")
