"""A preloaded parent for the detection end-to-end tests' ranks: torch is imported once.

Importing torch costs each rank ~3 s of CPU; the detection scenarios start 44 ranks, so on
a 2-core machine a third of their time went to imports. This process imports torch,
``torch.distributed`` and ``collectives`` once, then forks one child per rank on request.
A child is a real process of its own (its own session, log file and environment) that runs
``train_worker.main()``: gloo, the instrumentation and the agent connection all start in
the child, after the fork, exactly as in a fresh interpreter. Started with
``OMP_NUM_THREADS=1`` (read once, when torch loads its OpenMP runtime).

Protocol, one JSON object per line. stdin: ``{"env": {...}, "log": PATH}`` forks a rank.
stdout: ``{"pid": N}`` answers each request in order; ``{"exit": N, "code": C}`` reports a
child's end (``C`` as ``subprocess.Popen.returncode``: negative for a signal). The loop
stays single-threaded so that forking it is safe. It exits when stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

# The point of this process: train_worker imports torch, torch.distributed and
# collectives once, here, before any fork.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_worker  # type: ignore[import-not-found]

_PR_SET_PDEATHSIG = 1


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run_rank(env: dict[str, str], log: str) -> None:  # pragma: no cover - in the child
    code = 1
    try:
        os.setsid()
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        train_worker.main()  # ends with os._exit(0)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main() -> None:
    requests = sys.stdin.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 65536)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_rank(request["env"], request["log"])
                _send({"pid": pid})
        _reap()
    _reap()


if __name__ == "__main__":
    main()
