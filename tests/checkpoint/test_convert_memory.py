"""``checkpoint convert`` streams tensor by tensor: peak memory is about one tensor, not the
checkpoint (issue 19). Measured as the converting process's peak RSS growth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, Checkpointer

TENSORS, TENSOR_MB = 48, 4  # a 192 MiB checkpoint of 4 MiB tensors

PROBE = """
import resource, sys
from pathlib import Path
import torch
from checkpoint import _convert
src, out, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
getattr(_convert, "to_" + kind)(src, out)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big")
    numel = TENSOR_MB * (1 << 20) // 4
    state = {f"w{i:02d}": torch.full((numel,), float(i)) for i in range(TENSORS)}
    with Checkpointer(CheckpointConfig(root=root, writer="thread", include_rng=False)) as c:
        c.save(state, step=1)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["universal", "safetensors", "dcp"])
def test_convert_peak_memory_is_a_few_tensors(
    big_checkpoint: Path, tmp_path: Path, kind: str
) -> None:
    out = tmp_path / ("out.safetensors" if kind == "safetensors" else "out")
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(big_checkpoint), str(out), kind],
        capture_output=True,
        text=True,
        check=True,
    )
    grew_mib = int(run.stdout.split()[-1]) / 1024
    assert grew_mib < 12 * TENSOR_MB, f"peak RSS grew {grew_mib:.0f} MiB converting 192 MiB"
    if kind == "safetensors":
        from safetensors.torch import load_file

        back = load_file(str(out))
        assert len(back) == TENSORS and torch.equal(back["w07"][:3], torch.full((3,), 7.0))
    if kind == "dcp":  # read back by DCP itself, every tensor
        from torch.distributed.checkpoint.state_dict_loader import load

        numel = TENSOR_MB * (1 << 20) // 4
        back = {f"w{i:02d}": torch.empty(numel) for i in range(TENSORS)}
        load(back, checkpoint_id=str(out), no_dist=True)
        for i, name in enumerate(sorted(back)):
            assert torch.equal(back[name], torch.full((numel,), float(i))), name
