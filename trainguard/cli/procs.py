"""Child processes the demo (and the end-to-end tests) start, watch and always clean up.

Each child runs in its own session, so a terminal Ctrl-C reaches only the orchestrator,
which then stops every child: SIGTERM to all at once, SIGKILL to those still alive after a
grace period, so cleanup time is bounded however many children there are. Children also
get ``PR_SET_PDEATHSIG`` on Linux: if the orchestrator itself is killed with SIGKILL, the
kernel sends them SIGTERM instead of leaving orphans. Output goes to one log file per
child, whose tail is shown when something fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """Resolve prctl(2) once, in the parent: the forked child must not dlopen or import."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _load_prctl()
_SIGTERM = int(signal.SIGTERM)


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, _SIGTERM)


#: The signals that stop a demo or a drill (Ctrl-C, a supervisor's SIGTERM, a closed
#: terminal's SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals_handled(
    handler: Callable[[int, FrameType | None], object], *, only_handled: bool = False
) -> Iterator[None]:
    """``handler`` for :data:`STOP_SIGNALS` inside the block, the previous handlers after
    (``only_handled``: only for those Python handles now, not ignored or default ones).
    Outside the main thread, where handlers cannot be set, the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in STOP_SIGNALS:
        if not only_handled or callable(signal.getsignal(sig)):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP, where Python handles them (Ctrl-C; the demo's SIGTERM),
    take effect when the block ends. Raised inside ``Popen`` after the fork, the exception
    would lose the child just started: not in the set, nobody would stop it."""
    pending: list[int] = []

    def defer(signum: int, _frame: FrameType | None) -> None:
        pending.append(signum)

    try:
        with stop_signals_handled(defer, only_handled=True):
            yield
    finally:
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def cli_argv(*args: str) -> list[str]:
    """Run our own CLI with this interpreter, independent of what PATH holds."""
    return [sys.executable, "-m", "trainguard.cli", *args]


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; returns the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        """Signal the child's whole process group (it leads its own session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ProcessSet:
    """Owns a set of named children; leaving the ``with`` block stops every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, Child] = {}
        self._order: list[str] = []

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Child:
        """Start ``argv`` as ``name`` (a dead child's name may be reused, e.g. for a restart).

        ``env`` is the child's whole environment when given; otherwise it inherits ours.
        """
        old = self.children.get(name)
        if old is not None and old.alive():
            raise RuntimeError(f"child {name!r} is already running (pid {old.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        child_env = dict(os.environ if env is None else env)
        with _signals_deferred(), log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                preexec_fn=_die_with_parent if _PRCTL is not None else None,
            )
            child = Child(name=name, argv=list(argv), log_path=log_path, popen=popen)
            self.children[name] = child
            if name in self._order:
                self._order.remove(name)
            self._order.append(name)
        return child

    def __getitem__(self, name: str) -> Child:
        return self.children[name]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Deliver ``sig`` (default SIGKILL) and, for fatal signals, reap the child."""
        child = self.children[name]
        child.send(sig)
        if sig == signal.SIGKILL:
            child.popen.wait()

    def stop(self, name: str, *, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (and SIGCONT, in case it was stopped), then SIGKILL after ``timeout_s``."""
        child = self.children.get(name)
        if child is None:
            return None
        if child.alive():
            child.send(signal.SIGTERM)
            child.send(signal.SIGCONT)
            try:
                child.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.send(signal.SIGKILL)
                child.popen.wait()
        return child.popen.returncode

    def stop_all(self, *, timeout_s: float = 10.0) -> None:
        """Stop every child: SIGTERM all, then SIGKILL whatever outlives ``timeout_s``."""
        names = [n for n in reversed(self._order) if self.children[n].alive()]
        for name in names:
            self.children[name].send(signal.SIGTERM)
            self.children[name].send(signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        try:
            for name in names:
                child = self.children[name]
                try:
                    child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.send(signal.SIGKILL)
                    child.popen.wait()
        except BaseException:
            # Interrupted while waiting (a second Ctrl-C): no more grace, but no child left
            # behind either; one that ignores SIGTERM would also ignore PR_SET_PDEATHSIG's.
            self._kill_rest(names)
            raise

    def _kill_rest(self, names: list[str]) -> None:
        """SIGKILL and reap every child in ``names`` still running, even if interrupted."""
        for name in names:
            self.children[name].send(signal.SIGKILL)
        for name in names:
            while True:
                try:
                    self.children[name].popen.wait()
                    break
                except KeyboardInterrupt:  # another Ctrl-C: reaping takes milliseconds
                    continue

    def dead(self) -> list[Child]:
        """Children that exited on their own (not the ones we stopped)."""
        return [c for c in self.children.values() if not c.alive()]


__all__ = ["Child", "ProcessSet", "cli_argv", "wait_until"]
