"""NaN/Inf check of reduction inputs that live on a device, without a host sync.

On the CPU the wrapper reads ``float(x.sum())`` before each reduction. On a GPU that read
would block the training thread until the stream catches up, so instead each checked input
adds a few tiny kernels to the stream *before* the reduction is launched (stream order
guarantees they read the input before NCCL overwrites it)::

    bad   = ~isfinite(aminmax(x)).all()             # NaN/Inf survive; no overflow
    count += bad
    first  = where(bad & first == NONE, i, first)   # index of the step's first bad call

At the end of the step the two numbers are copied to (pinned) host memory with
``non_blocking=True`` behind a mark; the step's summary waits for that mark like it waits for
the collectives' end events, and the poller fills ``nonfinite_inputs`` and
``nonfinite_first_op``/``_group``/``_seq`` from the call at index ``first``, the same fields
the CPU path fills, so the controller names the first rank whose local input went bad
exactly as on CPU. ``nonfinite_every_steps`` thins the check out further.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .recorder import CallRecord
    from .timing import EventClock, Mark

#: ``first`` before any bad call was seen.
NONE = 1 << 40


def _extremes(tensor: torch.Tensor) -> torch.Tensor:
    """(min, max) of ``tensor``: one fused reduction, like a sum, that NaN and Inf survive
    but that cannot overflow (a sum of finite float32/bfloat16 values near 3e38 is Inf)."""
    low, high = torch.aminmax(tensor)
    return torch.stack([low, high])


class StepFlags:
    """The on-device NaN/Inf tally of one step."""

    __slots__ = ("calls", "count", "first")

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self.count: torch.Tensor | None = None
        self.first: torch.Tensor | None = None

    def add(self, value: Any, rec: CallRecord, min_bytes: int) -> bool:
        """Queue the check of ``value`` (a tensor or list of them); False if nothing to check."""
        tensors = _float_tensors(value, min_bytes)
        if not tensors:
            return False
        flags = [(~torch.isfinite(_extremes(t))).any() for t in tensors]
        bad = (flags[0] if len(flags) == 1 else torch.stack(flags).any()).to(torch.int64)
        index = len(self.calls)
        self.calls.append(rec)
        if self.count is None or self.first is None:
            self.count = bad
            self.first = torch.where(bad.bool(), index, NONE)
        else:
            self.first = torch.where(bad.bool() & (self.first == NONE), index, self.first)
            self.count = self.count + bad
        return True

    def read_back(self, clock: EventClock) -> tuple[torch.Tensor, Mark] | None:
        if self.count is None or self.first is None:
            return None
        return clock.copy_flag(torch.stack([self.count, self.first]))

    def resolve(self, host: torch.Tensor) -> tuple[int, CallRecord | None]:
        """(bad calls, first bad call) once the host copy is readable."""
        count, first = (int(v) for v in host.tolist())
        return count, (self.calls[first] if count and 0 <= first < len(self.calls) else None)


def warm_up(like: torch.Tensor, clock: EventClock) -> None:
    """Run the check and its read-back once on ``like``'s device, off any step.

    The first time these kernels run, CUDA loads their modules (lazily, by default) and the
    first pinned buffer is allocated, and either may synchronize the device: measured on an
    H100 (torch 2.11, NCCL), a job's first checked step blocked its training thread ~280 ms
    at its first reduction (and, once that was warmed, ~185 ms at its second), more than
    the GPU work queued ahead of it, where later steps took ~1-2 ms. Done at the rank's
    first device-timed call instead (the NCCL communicator's own set-up synchronizes there
    anyway), no step pays it."""
    flags = StepFlags()
    probe = torch.zeros(2, dtype=torch.float32, device=like.device)
    for _ in range(2):  # the step's first checked call, then a later one (other kernels)
        flags.add(probe, None, 0)  # type: ignore[arg-type]
    read = flags.read_back(clock)
    if read is not None:
        read[1].query()


def _float_tensors(value: Any, min_bytes: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.nbytes >= max(min_bytes, 1):
            return [value]
        return []
    if isinstance(value, list | tuple):
        return [t for item in value for t in _float_tensors(item, min_bytes)]
    return []


__all__ = ["NONE", "StepFlags", "warm_up"]
