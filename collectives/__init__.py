"""Job-side instrumentation of torch.distributed: the two lines a training script adds.

::

    import collectives
    dist.init_process_group("nccl")
    collectives.instrument(job="llama-7b")          # or TRAINGUARD_JOB from the launcher
    batches = (b for epoch in range(epochs) for b in loader)
    for step, batch in enumerate(batches):          # one count across epochs, not each
        with collectives.step(step):                # epoch's own i: numbers that go back
            ...                                     # are carried on within a process
        if collectives.should_checkpoint(step): save(...)
        if collectives.should_stop(): break

Every collective and point-to-point call is timed on this rank; per-step summaries,
in-flight reports of stuck calls and rank events go to the node agent's Unix socket from a
background thread. See ``docs/collectives.md``.
"""

from __future__ import annotations

from .config import InstrumentConfig
from .errors import CollectivesConfigError, CollectivesError, FaultSpecError, NotInstrumentedError
from .runtime import (
    add_faults,
    checkpoint_agreed,
    checkpoint_vote,
    current,
    hook_optimizer,
    instrument,
    on_checkpoint,
    report_checkpoint,
    set_role,
    should_checkpoint,
    should_stop,
    step,
    uninstrument,
)

__all__ = [
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
