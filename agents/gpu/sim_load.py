"""Stand-in for the CUDA load generator on simulated GPUs (tests, the demo).

::

    python agents/gpu/sim_load.py --dir LOAD_DIR --gpu 0 --seconds 10

While it runs, ``LOAD_DIR/gpu<N>.pid`` holds its pid, and the simulated driver
(:class:`agents.gpu.sim.SimNvml` with that ``load_dir``) reports GPU N fully busy, with the
clocks and clock-event reasons its model gives a loaded board: the agent's ``clocks_load``
check then runs exactly as on a real node, NVML reads included. The marker goes when the
process ends (killed too: the driver checks that the pid is alive). Standard library only,
and it uses the exit statuses of ``collectives.gpu_load`` (0 ran, 1 failed under load).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulated GPU load (marker file).")
    parser.add_argument("--dir", type=Path, required=True, help="the driver's load_dir")
    parser.add_argument("--gpu", type=int, required=True, help="simulated GPU index")
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    marker = args.dir / f"gpu{args.gpu}.pid"
    partial = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    partial.write_text(f"{os.getpid()}\n")
    partial.replace(marker)  # atomic: the driver never reads half a pid
    try:
        time.sleep(args.seconds)
    finally:
        marker.unlink(missing_ok=True)
    print(f'{{"gpu": {args.gpu}, "seconds": {args.seconds:g}, "simulated": true}}', flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
