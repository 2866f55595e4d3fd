"""One rank of a real FSDP2 / DTensor / pipelining job on gloo (launched by test_parallel.py).

Usage: ``python parallel_worker.py all <out_dir>``: the scenarios of
``bench.collectives_parallel`` (FSDP2 at steps 0-1, DTensor at 2-3, pipelining at 4-5; one
launch: starting torch costs more than the runs); writes ``rank<N>.json``. Flight Recorder
is on (``TORCH_FR_BUFFER_SIZE`` from the launcher) before the process group exists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

import collectives
from bench.collectives_parallel import run


def main() -> None:
    out = Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['TG_STORE']}", rank=rank, world_size=world
    )
    collectives.instrument()
    result = run(steps=2)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    collectives.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
