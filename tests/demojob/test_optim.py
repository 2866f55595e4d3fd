"""``demojob.optim.Adam`` is ``torch.optim.Adam`` bit for bit, minus the ``torch._dynamo``
import (~1.4 s of CPU per rank start, paid by every rank of every generation)."""

from __future__ import annotations

import textwrap

from tests import fresh_python

#: Run in a fresh interpreter: this process may have imported ``torch._dynamo`` already.
_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from demojob.optim import Adam

    def train(cls):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        opt = cls(model.parameters(), lr=1e-2)
        hooked = []
        opt.register_step_pre_hook(lambda o, a, k: hooked.append(1))
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = opt.state_dict()
        opt.load_state_dict(state)
        assert len(hooked) == 5, hooked  # the checkpoint engine's pre-step wait still runs
        return [p.detach().clone() for p in model.parameters()], state

    ours, our_state = train(Adam)
    assert "torch._dynamo" not in sys.modules, "demojob.optim.Adam imported torch._dynamo"
    theirs, their_state = train(torch.optim.Adam)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for i, s in their_state["state"].items():
        assert set(s) == set(our_state["state"][i])
        assert all(torch.equal(s[k], our_state["state"][i][k]) for k in s)
    assert our_state["param_groups"] == their_state["param_groups"]
    print("ok")
    """
)


def test_adam_matches_torch_bit_for_bit_without_importing_dynamo() -> None:
    done = fresh_python.run(_SCRIPT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
