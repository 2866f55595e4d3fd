"""Deterministic synthetic token data: a seeded Markov chain, no files, no downloads.

The global batch of step ``s`` is a pure function of ``(seed, s)``; each data-parallel rank
takes its contiguous slice. A restart with another DP size therefore trains on exactly the
same samples at each step, only split differently, and a resumed run needs no saved data
position. The chain gives each token three likely successors, so the loss has somewhere to
go (well below ``log(VOCAB)``) within a few steps.
"""

from __future__ import annotations

import torch

from demojob.model import SEQ, VOCAB

_SUCCESSOR_PROBS = torch.tensor([0.6, 0.3, 0.1])


def _successors(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (VOCAB, len(_SUCCESSOR_PROBS)), generator=g)


def global_batch(seed: int, step: int, size: int) -> torch.Tensor:
    """``size`` sequences of ``SEQ + 1`` tokens (inputs plus the next-token targets)."""
    succ = _successors(seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    out = torch.empty(size, SEQ + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (size,), generator=g)
    choices = torch.multinomial(_SUCCESSOR_PROBS.expand(size, -1), SEQ, True, generator=g)
    for t in range(SEQ):
        out[:, t + 1] = succ[out[:, t], choices[:, t]]
    return out


def local_batch(seed: int, step: int, size: int, dp: int, dp_rank: int) -> torch.Tensor:
    """This DP rank's slice of the global batch of ``step``."""
    per = size // dp
    return global_batch(seed, step, size)[dp_rank * per : (dp_rank + 1) * per]
