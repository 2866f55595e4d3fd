"""``trainguard demo``: a real training job hits real faults and recovers by itself.

It starts, on this machine, a controller (SQLite, dev tokens, the local-process actuator),
agents for three simulated nodes, and a small GPT trained with tensor + data parallelism on
gloo, launched by the controller on two nodes with the third as the spare
(:mod:`trainguard.cli.drill`). Then, one after another, a straggler, a hang and a fatal
XID: each is detected, localized, acted on (checkpoint, isolate, restart), and the job
resumes from its checkpoint, the last time on fewer ranks through a resharded universal
checkpoint. It ends with a table of every fault (time to detect, time to recover, steps run
again, world size) and the job's goodput, and exits 0 only when every check holds, so
``make demo`` doubles as a smoke test of the whole loop.

Every child process and the temporary directory are removed on success, failure, Ctrl-C or
SIGTERM.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console

from trainguard.cli.demo_view import Check, fault_table, print_checks
from trainguard.cli.drill import FAULT_KINDS, JOB, Drill, DrillConfig, FaultOutcome, JsonObject
from trainguard.cli.errors import DemoFailed
from trainguard.cli.output import OutputFormat, align
from trainguard.cli.procs import ProcessSet, stop_signals_handled
from trainguard.cli.views import ACTIONS, render_list


class Scenario(StrEnum):
    ALL = "all"
    STRAGGLER = "straggler"
    HANG = "hang"
    XID = "xid"

    def faults(self) -> tuple[str, ...]:
        return FAULT_KINDS if self is Scenario.ALL else (self.value,)


class Demo:
    def __init__(self, config: DrillConfig, console: Console, faults: tuple[str, ...]) -> None:
        self.config = config
        self.console = console
        self.faults = faults
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        self.console.out(f"[{time.monotonic() - self.started:5.1f}s] {text}", highlight=False)

    def intro(self, procs: ProcessSet) -> None:
        """Printed first, so even a failed start says where its logs were."""
        self.console.out(
            f"trainguard demo: {self.config.nodes} simulated nodes, one controller, a TP+DP "
            f"training job; faults: {', '.join(self.faults)}",
            highlight=False,
        )
        self.console.out(f"  logs       {procs.log_dir}", highlight=False)

    def hints(self, drill: Drill) -> None:
        out = self.console.out
        out(f"  API        {drill.server}/api/v1", highlight=False)
        out(f"  dashboard  {drill.server}/ui/  (paste the TRAINGUARD_TOKEN below)", highlight=False)
        out(f"    the job    {drill.server}/ui/#/job/{JOB}", highlight=False)
        out(f"    incidents  {drill.server}/ui/#/incidents", highlight=False)
        out("  use the CLI against it from another shell:", highlight=False)
        out(f"    export TRAINGUARD_SERVER={drill.server}", highlight=False)
        out(f"    export TRAINGUARD_TOKEN={drill.operator_token}", highlight=False)
        out("    trainguard remediation", highlight=False)

    def run(self, *, keep_running: bool = False) -> None:
        with workspace() as (workdir, procs):
            drill = Drill(self.config, workdir, procs, say=self.say)
            self.intro(procs)
            drill.launch()
            self.hints(drill)
            drill.wait_for_job()
            outcomes = [drill.fault(kind) for kind in self.faults]
            self.report(drill, outcomes)
            checks = self.verify(outcomes, drill.losses())
            print_checks(self.console, checks)
            failed = [c.text for c in checks if not c.ok]
            if failed:
                raise DemoFailed("demo failed: " + "; ".join(failed))
            if keep_running:
                with suppress(KeyboardInterrupt):
                    # Said inside the block: a Ctrl-C right after the line ends it cleanly.
                    self.console.out("running until Ctrl-C (--keep-running)", highlight=False)
                    self.linger(drill)
            self.console.out(
                f"demo passed in {time.monotonic() - self.started:.0f} s: "
                f"{len(outcomes)} faults detected, localized and recovered from; "
                "stopping the controller, agents and job",
                highlight=False,
            )

    def report(self, drill: Drill, outcomes: list[FaultOutcome]) -> None:
        goodput = drill.goodput()
        self.console.out("\n" + fault_table(outcomes), highlight=False)
        ettr = goodput.get("ettr")
        self.console.out(
            "\n"
            + align(
                [
                    ("GOODPUT", f"{ettr:.1%}" if isinstance(ettr, float) else "-"),
                    ("WALL", f"{goodput.get('wall_s', 0.0):.0f} s"),
                    ("LOST", f"{goodput.get('lost_s', 0.0):.0f} s"),
                    ("STEPS", str(goodput.get("high_water_step"))),
                ]
            ),
            highlight=False,
        )
        with drill.api() as api:
            actions = render_list(ACTIONS, api.actions(), OutputFormat.TABLE)
        self.console.out(f"\n$ trainguard actions\n{actions or '(none)'}", highlight=False)

    def verify(self, outcomes: list[FaultOutcome], rows: list[JsonObject]) -> list[Check]:
        """What the demo promises about each fault; ``rows`` is the job's loss log."""
        cfg = self.config
        first_loss = float(rows[0]["loss"]) if rows else 0.0
        checks = []
        for o in outcomes:
            inc = o.incident or {}
            culprit_ok = inc.get("node") == o.node and (
                o.rank is None or o.rank in inc.get("ranks", [])
            )
            where = o.node + (f" rank {o.rank}" if o.rank is not None else "")
            checks.append(Check(culprit_ok, f"{o.kind}: the incident names {where}"))
            checks.append(
                Check(
                    o.steps_lost is not None and o.steps_lost <= cfg.ckpt_every,
                    f"{o.kind}: resumed with at most {cfg.ckpt_every} steps run again "
                    f"(ran {o.steps_lost} again)",
                )
            )
            checks.append(_loss_goes_on(o, rows, first_loss))
        if len(outcomes) == len(FAULT_KINDS):
            last = outcomes[-1]
            checks.append(
                Check(
                    (last.world_after or 0) < last.world_before,
                    f"the last restart ran on fewer ranks ({last.world_before} -> "
                    f"{last.world_after}), resharding the checkpoint",
                )
            )
        return checks

    def linger(self, drill: Drill) -> None:
        """Until Ctrl-C; a child that dies meanwhile still fails the demo."""
        drill.wait("Ctrl-C", lambda: False, math.inf)


#: How far a step run again may land from its first run. The same layout reproduces it bit
#: for bit; resharded onto fewer ranks the same global batch is summed in another order,
#: measured within 2.4e-7 (tests/demojob/test_resume.py). A restart from scratch or from the
#: wrong checkpoint misses by orders of magnitude more.
RERUN_LOSS_ABS_TOL = 1e-4


def _loss_goes_on(o: FaultOutcome, rows: list[JsonObject], first_loss: float) -> Check:
    """The generation after the fault continues the curve of the one before: the steps it ran
    again reproduce their losses, and it did not start over (its loss is below the first)."""
    resumed = o.resumed or {}
    before = {
        int(r["step"]): float(r["loss"]) for r in rows if r["generation"] == o.generation_before
    }
    again = [
        abs(float(r["loss"]) - before[int(r["step"])])
        for r in rows
        if r["generation"] == resumed.get("generation") and int(r["step"]) in before
    ]
    worst = max(again, default=0.0)
    loss = float(resumed.get("loss", first_loss))
    text = f"{o.kind}: the loss went on from where it was ({loss:.3f} < first {first_loss:.3f}"
    if again:
        text += f"; re-run steps so far match within {worst:.1e}"
    return Check(loss < first_loss and worst <= RERUN_LOSS_ABS_TOL, text + ")")


@contextmanager
def workspace() -> Iterator[tuple[Path, ProcessSet]]:
    """A temporary directory and the children started in it; on the way out, however it
    is left, every child is stopped and then the directory removed.

    Signals that arrive meanwhile (a second Ctrl-C, a supervisor's SIGTERM after the
    first) wait until both are done: raised at once they cut the cleanup short, leaving a
    child that was still stopping (a controller stopping its ranks) running and writing
    into a directory removed under it, which it then recreates.
    """
    workdir = Path(tempfile.mkdtemp(prefix="trainguard-demo-", dir=_short_tmp_root()))
    procs = ProcessSet(workdir / "logs")
    try:
        yield workdir, procs
    finally:
        with signals_held():
            procs.stop_all()
            shutil.rmtree(workdir, ignore_errors=True)


#: sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


def _short_tmp_root() -> str | None:
    """Where the work directory goes: the temporary directory (``None``), unless the
    agents' sockets there (``<dir>/trainguard-demo-XXXXXXXX/demo-node-0/agent.sock``) would
    be too long for a Unix socket, as under a deep ``TMPDIR``; then ``/tmp``. Every agent
    would refuse its socket path and the demo could not run at all."""
    longest = os.path.join(tempfile.gettempdir(), "trainguard-demo-abcdefgh", "demo-node-99")
    if len(os.fsencode(os.path.join(longest, "agent.sock"))) <= MAX_SOCKET_PATH_BYTES:
        return None
    return "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else None


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP only say "still stopping" (once) inside the block, and
    are not acted on later: the block is the stopping they ask for."""
    told = False

    def note(_signum: int, _frame: FrameType | None) -> None:
        nonlocal told
        if not told:
            told = True
            sys.stderr.write("demo: still stopping the controller, agents and job\n")
            sys.stderr.flush()

    with stop_signals_handled(note):
        yield


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP unwind like Ctrl-C, so the cleanup in ``finally`` blocks
    runs. SIGINT too: a process started with SIGINT ignored (by a launcher, ``nohup``, a
    test runner's worker) inherits that, and Python then installs no Ctrl-C handler."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    with stop_signals_handled(handler):
        yield


def demo(
    scenario: Annotated[
        Scenario, typer.Option("--scenario", help="Which faults to inject, in this order.")
    ] = Scenario.ALL,
    keep_running: Annotated[
        bool, typer.Option("--keep-running", help="Stay up after the checks until Ctrl-C.")
    ] = False,
) -> None:
    """Run a controller, simulated nodes and a training job; inject faults; watch recovery."""
    try:
        with signals_interrupt():
            Demo(DrillConfig(), Console(highlight=False), scenario.faults()).run(
                keep_running=keep_running
            )
    except KeyboardInterrupt:
        # Reached after every ``with`` block above has stopped the children and removed
        # the temporary directory, so the message is true when printed.
        typer.echo(
            "demo interrupted: controller, agents and job stopped, temp files removed", err=True
        )
        raise typer.Exit(130) from None


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel="Run")(demo)


__all__ = ["Demo", "Scenario", "register", "workspace"]
