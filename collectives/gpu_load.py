"""A short matmul load on one GPU, for the agent's ``clocks_load`` preflight check.

::

    python -m collectives.gpu_load --gpu 0 --seconds 10
    python collectives/gpu_load.py --gpu GPU-5d1c... --seconds 10   # what the agent runs

The agent (which never imports torch) starts this as a subprocess per GPU and reads clocks
and clock-event reasons through NVML while it runs; the load itself only has to keep the
GPU's SMs busy. It multiplies two square matrices (bf16 where the GPU supports it, else
fp16) back to back for ``--seconds``, synchronizing every batch so it stops on time.

``--gpu`` is a UUID (``GPU-...``, what the agent passes: NVML and CUDA number GPUs
differently unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, a UUID names the same board in both) or
a CUDA index, counted in PCI bus order like NVML's.

Exit status tells the agent what happened, so that a node without a way to generate load
is reported *skipped*, never passed: 0 the load ran for the whole time (one JSON line on
stdout), 1 the load started but CUDA failed during it, 2 usage error, 3 torch is not
importable, 4 no CUDA device (or not the one asked for). The agent keeps the same numbers
(``agents.clocks_load``; a test pins them). Run as a file, it needs nothing but the standard
library and torch (the package ``collectives`` is not imported, so a node without torch
gets status 3, not a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if not __package__ and sys.path and Path(sys.path[0]).resolve() == Path(__file__).parent.resolve():
    # Run as a file: this folder must not shadow top-level modules torch imports.
    del sys.path[0]

EXIT_OK = 0
EXIT_LOAD_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_TORCH = 3
EXIT_NO_CUDA = 4
#: Side of the square matrices: 8192² bf16 is 128 MiB per matrix and ~1.1 TFLOP per product,
#: long enough per kernel to keep every SM busy, small enough for any data-center GPU.
DEFAULT_SIZE = 8192
#: Target wall time of one batch of products between synchronizations (s).
BATCH_TARGET_S = 0.1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m collectives.gpu_load", description="Matmul load on one GPU."
    )
    parser.add_argument("--gpu", required=True, help="GPU UUID (GPU-...) or CUDA index")
    parser.add_argument("--seconds", type=float, required=True, help="how long to load it")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="matrix side")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 3600:
        parser.error(f"--seconds {args.seconds:g}: must be in (0, 3600]")
    if not 64 <= args.size <= 65536:
        parser.error(f"--size {args.size}: must be in [64, 65536]")
    if not (args.gpu.startswith(("GPU-", "MIG-")) or args.gpu.isdigit()):
        parser.error(f"--gpu {args.gpu!r}: expected a GPU UUID (GPU-...) or an index")
    return args


def _fail(status: int, message: str) -> int:
    print(f"gpu_load: {message}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.gpu.isdigit():
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # NVML's numbering
        index = int(args.gpu)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu  # before CUDA initialises
        index = 0
    try:
        import torch
    except ImportError as exc:
        return _fail(EXIT_NO_TORCH, f"torch is not importable ({exc})")
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError as exc:
        return _fail(EXIT_NO_CUDA, f"CUDA failed to initialise ({str(exc).splitlines()[0]})")
    if count == 0:
        return _fail(EXIT_NO_CUDA, f"no CUDA device visible (torch {torch.__version__})")
    if index >= count:
        return _fail(EXIT_NO_CUDA, f"GPU {args.gpu} not visible to CUDA ({count} device(s))")
    device = torch.device("cuda", index)
    try:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        a = torch.randn(args.size, args.size, device=device, dtype=dtype)
        b = torch.randn(args.size, args.size, device=device, dtype=dtype)
        out = torch.empty_like(a)
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # busy/exclusive device, out of memory, no context
        return _fail(EXIT_NO_CUDA, f"cannot use GPU {args.gpu}: {str(exc).splitlines()[0]}")
    started = time.monotonic()
    deadline = started + args.seconds
    products, batch = 0, 1
    try:
        while True:
            t0 = time.monotonic()
            for _ in range(batch):
                torch.matmul(a, b, out=out)
            torch.cuda.synchronize(device)
            products += batch
            took = time.monotonic() - t0
            now = time.monotonic()
            if now >= deadline:
                break
            per = took / batch
            batch = max(1, min(int(BATCH_TARGET_S / per) if per > 0 else 64, 4096))
    except RuntimeError as exc:
        return _fail(EXIT_LOAD_FAILED, f"CUDA failed under load: {str(exc).splitlines()[0]}")
    elapsed = time.monotonic() - started
    tflops = 2.0 * args.size**3 * products / elapsed / 1e12
    print(
        json.dumps(
            {
                "gpu": args.gpu,
                "device": torch.cuda.get_device_name(device),
                "dtype": str(dtype).removeprefix("torch."),
                "seconds": round(elapsed, 3),
                "products": products,
                "tflops": round(tflops, 1),
            }
        ),
        flush=True,
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
