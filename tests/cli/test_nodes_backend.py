"""`trainguard nodes` never lets simulated GPUs pass for real ones."""

from __future__ import annotations

from trainguard.cli.output import OutputFormat
from trainguard.cli.views import NODES, render_list, render_node


def _node(name: str, backend: str, gpus: int) -> dict[str, object]:
    return {"name": name, "health": "healthy", "gpu_count": gpus, "gpus_unhealthy": 0,
            "open_incidents": 0, "backend": backend, "gpus": []}  # fmt: skip


def test_sim_nodes_are_marked_and_real_ones_are_not() -> None:
    items = [_node("real-1", "nvml", 8), _node("sim-1", "sim", 8), _node("cpu-1", "nvml", 0)]
    text = render_list(NODES, items, OutputFormat.TABLE, now_unix_s=0.0)
    assert text is not None
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["real-1"][2] == "8" and rows["cpu-1"][2] == "0"
    assert rows["sim-1"][2:4] == ["8", "(sim)"]
    detail = render_node(_node("sim-1", "sim", 8), OutputFormat.TABLE, now_unix_s=0.0)
    assert "Backend:" in detail and "sim (simulated GPUs, not real hardware)" in detail
    assert "nvml (real GPUs)" in render_node(
        _node("r", "nvml", 8), OutputFormat.TABLE, now_unix_s=0.0
    )
