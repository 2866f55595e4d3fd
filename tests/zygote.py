"""Processes forked from one parent that imported their modules once (a "zygote").

Importing torch costs each new interpreter ~2.2 s of CPU here, and ``collectives.instrument()``
1.6 s more (it imports ``torch.distributed.pipelining``, which pulls in DTensor, dynamo and
sympy). The multi-process tests start about a hundred rank processes (gloo jobs in
tests/collectives, the demo job's ranks in tests/demojob, the detection scenarios in
tests/e2e), so on a 2-core machine the imports alone were minutes of ``make test``. The
zygote imports all that once, then forks one child per request. Each child is a real process
of its own: its own session, working directory, environment, ``sys.argv``/``sys.path`` and
stdout/stderr files, and it runs its program (``python SCRIPT ARGS`` or ``python -m MODULE
ARGS``, as :mod:`runpy` does) from there: the process group, the instrumentation and every
socket start after the fork, exactly as in a fresh interpreter. At the end the child waits
for its non-daemon threads, hands an uncaught exception to ``sys.excepthook`` and runs its
``atexit`` handlers as interpreter shutdown would, and its exit code (or the signal that
ended it) reaches the test as ``subprocess.Popen`` reports it.

The same machinery forks the CLI's own runs (``python -m trainguard.cli ...``, the
``cli_zygote`` fixture): a zygote imports the modules named on its command line, the
ranks' set (:data:`PRELOAD`, torch's) when none are.

What differs from a fresh interpreter: modules are imported once with the zygote's
environment, so a setting that a module reads *at import time* is the zygote's, not the
rank's. None of the preloaded modules reads the environment at import (torch reads
``OMP_NUM_THREADS`` when it loads its OpenMP runtime: the zygote starts with 1, as every
launcher here sets; Flight Recorder's ``TORCH_FR_BUFFER_SIZE`` and gloo's settings are read
when a process group is made, in the child).

Protocol (one JSON object per line; the server loop stays single-threaded so forking it is
safe). stdin: ``{"argv", "env", "cwd", "stdout", "stderr"}`` forks a child; stdout:
``{"pid": N}`` answers each request in order, ``{"exit": N, "code": C}`` reports a child's
end (``C`` as ``subprocess.Popen.returncode``: negative for a signal). It exits when its
stdin closes; its children then get SIGTERM (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: What the zygote imports before it forks: torch and everything a rank of these tests runs.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.optim",
    # What collectives.instrument() imports to watch for meshes and pipeline stages: 1.6 s
    # of CPU in each rank otherwise (torch.distributed.pipelining pulls in DTensor, dynamo
    # and sympy).
    "torch.distributed.device_mesh",
    "torch.distributed.pipelining",
    "collectives",
    "checkpoint",
    # The demo job's modules, not demojob.train itself: the program a child runs is
    # executed fresh as __main__ (runpy warns about a module run that is already imported).
    "demojob.config",
    "demojob.data",
    "demojob.model",
    "demojob.parallel",
    "demojob.resume",
)

_PR_SET_PDEATHSIG = 1


# --------------------------------------------------------------------------- the test's side


class ZygoteProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of the zygote (which
    reaps it and reports its exit code)."""

    def __init__(self, pid: int, argv: Sequence[str], zygote: Zygote) -> None:
        self.pid = pid
        self.args = [sys.executable, *argv]
        self._zygote = zygote

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self._zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        # As Popen: never signal a pid already reaped (it may belong to someone else now).
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """Starts the zygote (this file run as a script) and forks children from it on request."""

    def __init__(
        self,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = PRELOAD,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log_dir = log_dir
        self.log_path = log_dir / "zygote.log"
        base = dict(os.environ if env is None else env)
        base["OMP_NUM_THREADS"] = "1"  # read once, when torch loads its OpenMP runtime
        base["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p
        )
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                # -m from the repository root: the script's own folder (tests/) first on
                # sys.path would shadow the packages by the test folders of the same names.
                [sys.executable, "-m", "tests.zygote", *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=base,
                cwd=ROOT,
                start_new_session=True,
            )
        self._codes: dict[int, int] = {}
        self._pids: queue.Queue[int] = queue.Queue()
        self._lock = threading.Lock()
        self._spawning = threading.Lock()
        threading.Thread(target=self._read, name="torch-zygote", daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            message = json.loads(line)
            if "pid" in message:
                self._pids.put(message["pid"])
            else:
                with self._lock:
                    self._codes[message["exit"]] = message["code"]
        self._pids.put(-1)  # the zygote is gone

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if pid in self._codes:
                return self._codes[pid]
        if self.alive():
            return None
        try:  # the zygote is gone (teardown): its orphans are reaped by init
            os.kill(pid, 0)
        except ProcessLookupError:
            return -int(signal.SIGKILL)
        return None

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: Path,
        stderr: Path | None = None,
        cwd: Path | str = ROOT,
    ) -> ZygoteProcess:
        """Fork ``python *argv`` (``["-m", "pkg.mod", ...]`` or ``["script.py", ...]``) with
        exactly ``env``; stdout and stderr (the same file when ``stderr`` is None) append
        to the files given."""
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr or stdout),
        }
        assert self.popen.stdin is not None
        with self._spawning:  # one request at a time: answers come back in order
            self.popen.stdin.write(json.dumps(request).encode() + b"\n")
            self.popen.stdin.flush()
            pid = self._pids.get(timeout=120)
        if pid < 0:
            raise AssertionError(f"zygote died:\n{self.log_path.read_text()[-3000:]}")
        return ZygoteProcess(pid, argv, self)

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(python *argv, capture_output=True, text=True, timeout=...)``
        for a child of the zygote: its output comes back once it exits; past ``timeout`` it
        is killed and ``subprocess.TimeoutExpired`` raised, as ``run`` does."""
        with tempfile.TemporaryDirectory(dir=self._log_dir) as out:
            stdout, stderr = Path(out) / "stdout", Path(out) / "stderr"
            proc = self.spawn(
                argv,
                env=dict(os.environ if env is None else env),
                stdout=stdout,
                stderr=stderr,
                cwd=os.getcwd() if cwd is None else cwd,
            )
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            return subprocess.CompletedProcess(
                proc.args, code, stdout.read_text(), stderr.read_text()
            )

    def close(self) -> None:
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


# --------------------------------------------------------------------------- the zygote


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _child(request: dict[str, Any], base_path: list[str]) -> None:  # pragma: no cover - child
    """Become ``python *argv`` (never returns)."""
    import atexit
    import ctypes
    import runpy

    code: int = 1
    try:
        os.setsid()
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv: list[str] = request["argv"]
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[:] = [os.path.dirname(script), *extra, *base_path]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        # As the interpreter: an uncaught exception goes to sys.excepthook (which the
        # instrumentation hooks to record why the rank died), exit status 1.
        _excepthook(exc)
        if isinstance(exc, KeyboardInterrupt):
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # die of SIGINT, as python does
            os.kill(os.getpid(), signal.SIGINT)
    # What interpreter shutdown does before finalizing: join non-daemon threads, atexit.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _excepthook(exc: BaseException) -> None:  # pragma: no cover - in the child
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except BaseException:
        import traceback

        traceback.print_exception(exc)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    import importlib
    import select

    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    for name in sys.argv[1:] or PRELOAD:
        importlib.import_module(name)
    if threading.active_count() > 1:  # forking copies no thread: a preload must start none
        names = ", ".join(t.name for t in threading.enumerate())
        raise SystemExit(f"zygote: preloading started threads ({names}); cannot fork safely")
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
                    _child(request, base_path)
                _send({"pid": pid})
        _reap()
    _reap()


if __name__ == "__main__":
    serve()
