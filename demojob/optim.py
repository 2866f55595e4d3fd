"""``torch.optim.Adam`` without importing ``torch._dynamo`` at every rank start.

``torch.optim`` marks its methods "not for torch.compile" lazily: the first call of
``add_param_group``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and every
``step`` does ``import torch._dynamo``. That import is ~1.4 s of CPU, about as much as
``import torch`` itself, and every rank of every generation pays it (14 rank starts in
``trainguard demo``, more in the end-to-end tests). This job never compiles anything, so
the marks are no-ops here: outside ``torch.compile``, ``torch._dynamo.disable(fn)(...)`` is
``fn(...)`` and ``torch._dynamo.graph_break()`` does nothing.

The update itself is torch's own (``Adam.step``'s undecorated body, the same
single-tensor kernel on CPU), the step hooks (the checkpoint engine's pre-step wait) still
run, and the state dict is unchanged, so checkpoints and losses are bit for bit what
``torch.optim.Adam`` gives. On a torch whose internals differ, the shortcuts are skipped
(``__wrapped__`` missing) and the plain decorated methods run: slower to start, still right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: ``torch.optim.Optimizer`` methods wrapped by ``torch._disable_dynamo``.
_DISABLE_DYNAMO_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def _resolve_dynamo_marks() -> None:
    """Pre-fill the cache ``torch._disable_dynamo`` fills on first call (the function itself,
    which is what ``torch._dynamo.disable`` amounts to when nothing is being compiled)."""
    for name in _DISABLE_DYNAMO_WRAPPED:
        fn = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
            fn.__dynamo_disable = fn


_resolve_dynamo_marks()

#: ``Adam.step`` without its ``_use_grad_for_differentiable`` wrapper (whose only other
#: job, besides the ``torch._dynamo`` import, is setting grad mode to ``differentiable``).
_ADAM_STEP: Callable[..., Any] | None = getattr(torch.optim.Adam.step, "__wrapped__", None)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` that does not import ``torch._dynamo``."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if _ADAM_STEP is None:
            return super().step(closure)  # type: ignore[no-any-return]
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _ADAM_STEP(self, closure)  # type: ignore[no-any-return]
