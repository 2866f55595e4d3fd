"""One instrumented rank: wires recorder, wrapper, watchdog, faults and agent client together.

There is at most one :class:`Session` per process (torch.distributed itself is per-process
state); the module-level functions in :mod:`collectives` act on it and are harmless no-ops
when instrumentation is off, so a training script keeps its two lines everywhere.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import operator
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from trainguard.podinfo import pod_identity
from trainguard.wire import CheckpointEvent, JobDumpTrace, LocalHello, RankEvent

from . import flight
from .client import AgentClient
from .config import InstrumentConfig, config_from_env
from .control import CheckpointCallback, Control
from .errors import CollectivesConfigError, FaultSpecError, NotInstrumentedError
from .faults import Fault, FaultInjector, injector_from_env
from .gpu_identity import gpu_index, gpu_uuid
from .outbox import Outbox
from .probe import late_results, probe_device, probe_group, run_probe
from .recorder import STEP_MAX, Recorder, StepNumbering
from .roles import RoleTracker
from .timeouts import check_timeouts
from .timing import default_clock
from .watchdog import Watchdog
from .wrap import Instrumenter, raised_in_collective

log = logging.getLogger("trainguard.collectives")

_session: Session | None = None
_session_lock = threading.Lock()

#: How long closing waits for the device marks of ended steps (their summaries then go out).
_DRAIN_S = 0.5


class Session:
    def __init__(self, cfg: InstrumentConfig, faults: Sequence[Fault] | None = None) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        local = os.environ.get("LOCAL_RANK")
        self.local_rank = int(local) if local and local.isdigit() else None
        # The NVML index this rank claims, and the UUID the agent corrects that claim from
        # (CUDA's numbering is the pod's, not the node's: see gpu_identity).
        self.gpu_index = gpu_index()
        self.gpu_uuid = gpu_uuid()
        self.outbox = Outbox(cfg.max_pending_records)
        self.recorder = Recorder(
            cfg,
            rank=self.rank,
            world_size=self.world_size,
            outbox=self.outbox,
            local_rank=self.local_rank,
            gpu_index=self.gpu_index,
        )
        self.roles = RoleTracker(
            self.rank, self.world_size, role=cfg.role, groups=self.recorder.group_ranks
        )
        self.recorder.roles = self.roles
        if faults is None:
            self.injector = injector_from_env(self.rank)
        else:
            self.injector = FaultInjector(self.rank, faults) if faults else None
        if self.injector is not None:
            self.injector.before_exit = self._dying
        self.instrumenter = Instrumenter(
            self.recorder,
            self.injector,
            clock=default_clock(cfg.device_path_on_cpu, cfg.cuda_events),
            sleep=time.sleep,
        )
        self.control = Control(cfg.job)
        self.control.on_dump_trace = self._dump_trace
        self.watchdog = Watchdog(self.recorder, self.outbox, cfg.watchdog_interval_s)
        self.watchdog.reapers.append(self.instrumenter.functional.reap)
        self.watchdog.reapers.append(self.instrumenter.functional.reap_unheld)
        self.pod, self.namespace = pod_identity(os.environ)
        hello = LocalHello(
            job=cfg.job,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            local_rank=self.local_rank,
            gpu_index=self.gpu_index,
            gpu_uuid=self.gpu_uuid,
            pod=self.pod,
            namespace=self.namespace,
        )
        self.client = AgentClient(cfg, hello, self.outbox, self.control.handle, self._tick)
        self._next_heartbeat = 0.0
        self._exit_code: int | None = None
        self._exit_error = ""
        self._exit_in_collective = False
        self._prev_excepthook = sys.excepthook
        self.closed = False
        self.probe_group: Any = None
        self.probe_device = torch.device("cpu")
        self.timeout_warnings: list[str] = []
        #: Step misuse already warned about this session (each kind is logged once).
        self._warned: set[str] = set()
        #: How steps were marked so far: "with" (``step()``), "hook" (``hook_optimizer``).
        self._step_apis: set[str] = set()
        #: The loop's step numbers -> the ones sent (they only go forward in a process).
        self.numbering = StepNumbering()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.instrumenter.patch()
        # The slow local work next (the roles' scan of live objects takes ~0.2 s, longer on a
        # loaded node), then the probes' group: creating it is collective (a store-based
        # barrier, no wrapped call), so the ranks leave instrument() together and the job's
        # next collective does not wait on a slow scan.
        self.roles.watch()
        self.timeout_warnings = check_timeouts(self.cfg.min_collective_timeout_s, os.environ)
        self.probe_group = probe_group(self.world_size)
        self.probe_device = probe_device(str(dist.get_backend()))
        self._event("started")
        self._next_heartbeat = time.monotonic() + self.cfg.heartbeat_interval_s
        self.watchdog.start()
        self.client.start()
        sys.excepthook = self._excepthook
        atexit.register(self._atexit)

    def close(self, *, exited: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.instrumenter.unpatch()
        self.roles.unwatch()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        atexit.unregister(self._atexit)
        self.watchdog.stop()
        self._drain_steps()
        if exited:
            self._event(
                "exited",
                exit_code=self._exit_code,
                error=self._exit_error,
                collective_failed=self._exit_in_collective,
            )
        self.client.stop()

    def _drain_steps(self) -> None:
        """Send the ended steps whose summaries wait on device marks (the last step, on a
        GPU) before the client's last flush: the poller that would emit them is stopped.

        Only ended steps go out. A step still open here is not summarized: under
        ``hook_optimizer`` it is the tail after the last ``optimizer.step()`` (no optimizer
        step of its own: teardown, a final save), under ``step()`` a block the job left by
        exiting (an exception aborts it). A summary of it would be a step the ranks did not
        all run alike, compared with full steps (see docs/collectives.md, "The last step")."""
        try:
            self.instrumenter.functional.reap()
            if not self.recorder.drain(_DRAIN_S):
                log.warning("trainguard: a step's device timing was not done at close: not sent")
        except Exception:  # closing must never fail the job
            log.debug("trainguard: draining step summaries at close failed", exc_info=True)

    def add_faults(self, spec: Any) -> None:
        if self.injector is None:
            self.injector = FaultInjector(self.rank)
            self.injector.before_exit = self._dying
            self.instrumenter.injector = self.injector
        self.injector.add(spec)

    def _event(self, kind: str, **extra: Any) -> None:
        self.outbox.add_event(
            RankEvent(
                job=self.cfg.job,
                rank=self.rank,
                kind=kind,
                pid=os.getpid(),
                time_unix_s=time.time(),
                local_rank=self.local_rank,
                gpu_index=self.gpu_index,
                world_size=self.world_size,
                pod=self.pod or None,
                namespace=self.namespace or None,
                **extra,
            )
        )

    def _tick(self) -> None:
        if time.monotonic() >= self._next_heartbeat:
            self._next_heartbeat = time.monotonic() + self.cfg.heartbeat_interval_s
            self._event("heartbeat")

    def _excepthook(
        self, kind: type[BaseException], value: BaseException, tb: TracebackType | None
    ) -> None:
        self._exit_code = 1
        self._exit_error = " ".join(f"{kind.__name__}: {value}".split())[:1024]
        # An exception that escaped a wrapped collective usually means a peer died or the
        # link broke: the controller treats this exit as collateral of another fault.
        self._exit_in_collective = raised_in_collective(tb)
        self._prev_excepthook(kind, value, tb)

    def _atexit(self) -> None:
        global _session
        self.close(exited=True)
        with _session_lock:
            if _session is self:
                _session = None

    def _dying(self, exit_code: int | None, sig: int | None) -> None:
        """An injected crash is about to kill the process: say so while we still can."""
        name = signal.Signals(sig).name if sig is not None else None
        self._event("exited", exit_code=exit_code if sig is None else None, signal=name)
        self.client.flush(timeout_s=1.0)

    # ------------------------------------------------------------------ steps

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("trainguard: " + message + " (logged once per session)", *args)

    def step_start(self, step: Any, *, via: str = "with", rewind: bool = False) -> object | None:
        """Open a step; returns its token, or None when no step was opened: a step number
        a summary cannot carry, or a step already in progress (steps do not nest). Never
        raises for either: training goes on, that block is just not a step of its own.

        The number sent (and the one commands, probes and faults are matched against) is
        the loop's while it increases; one that goes back carries the sequence on
        (:class:`~collectives.recorder.StepNumbering`), unless ``rewind`` says the loop
        went back on purpose."""
        self._step_apis.add(via)
        if len(self._step_apis) > 1:
            self._warn_once(
                "mixed",
                "both collectives.step() and hook_optimizer() mark steps; they end each "
                "other's steps early or are refused as nested: use one of them",
            )
        number = _step_number(step)
        if number is None:
            self._warn_once(
                "step-number",
                "step number %r is not an integer in [0, %d], so it cannot be sent; "
                "steps like it are not summarized (their collectives count outside any step)",
                step,
                STEP_MAX,
            )
            return None
        current = self.recorder.step
        if current is not None:
            self._warn_once(
                "nested",
                "step %d started while step %d is in progress; steps do not nest: the "
                "outer step goes on and counts the inner block's collectives",
                number,
                current,
            )
            return None
        sent, went_back = self.numbering.open(number, rewind=rewind)
        if sent is None:
            self._warn_once(
                "step-overflow",
                "step number %r follows step %r in this process and would be sent as a "
                "number above %d, so it cannot be sent; steps like it are not "
                "summarized (their collectives count outside any step)",
                number,
                self.numbering.last_given,
                STEP_MAX,
            )
            return None
        if went_back:
            self._warn_once(
                "went-back",
                "step %d follows step %d in this process: a step number that goes back "
                "reads as a restarted job, so it is sent as step %d and the steps after it "
                "count on from there (checkpoint and probe requests name steps in that "
                "numbering). Count steps across epochs (e.g. epoch * len(loader) + i); "
                "after reloading a checkpoint in this process, pass rewind=True to the "
                "first step() after the reload",
                number,
                self.numbering.last_given,
                sent,
            )
        for spec in self.control.faults_due():
            try:
                self.add_faults(spec)
                log.warning("trainguard: chaos drill added faults %s", spec)
            except FaultSpecError as exc:  # the controller checks kinds, the rank the rest
                log.error("trainguard: chaos faults refused: %s", exc)
        step = sent
        now_probes, late = self.control.probes_due(step)
        for cmd in late:
            for result in late_results(cmd, self.rank, step):
                self.outbox.add_probe(result)
        for cmd in now_probes:
            self._run_probe(cmd, step)
        token = self.recorder.step_start(step)
        if self.injector is not None:
            self.injector.on_step_start(step)
        return token

    def step_end(self, token: object | None = None) -> None:
        """End the step in progress (only the one ``token`` opened, when one is given).

        Checkpoint callbacks get the loop's own number of the step (what it saves under);
        the request's ``at_step`` is matched against the number sent."""
        if token is not None and not self.recorder.is_open(token):
            return
        step = self.recorder.step
        given = self.numbering.given
        if step is not None and self.injector is not None:
            self.injector.stretch_compute(step, self.recorder.compute_segment_s())
        self.recorder.step_end(token)
        self.numbering.close()
        if step is not None and self.control.callbacks and self.control.checkpoint_due(step):
            for callback in list(self.control.callbacks):
                callback(step if given is None else given)

    def step_abort(self, token: object | None = None) -> None:
        """The step in progress raised: no summary, and its number may be used again."""
        if token is not None and not self.recorder.is_open(token):
            return
        self.recorder.step_abort(token)
        self.numbering.drop()

    def _dump_trace(self, cmd: JobDumpTrace) -> None:
        """Answer a ``JobDumpTrace`` with this rank's Flight Recorder buffer (shipping thread)."""
        record = flight.dump_record(
            job=self.cfg.job,
            rank=self.rank,
            command_id=cmd.id,
            groups=self.recorder.group_names,
            group_ranks=self.recorder.group_ranks,
            max_entries=self.cfg.trace_max_entries,
            dump_dir=self.cfg.trace_dump_dir,
        )
        self.outbox.add_trace(record)
        log.warning(
            "trainguard: Flight Recorder dump for %s: %d entries%s",
            cmd.id,
            len(record.entries),
            f" ({record.error})" if record.error else "",
        )
        self.client.wake()

    def _run_probe(self, cmd: Any, step: int) -> None:
        injector = self.injector
        originals = self.instrumenter.originals

        def link_delay(pair: tuple[int, int]) -> float:
            return 0.0 if injector is None else injector.link_delay_s(step, pair)

        for result in run_probe(
            cmd,
            rank=self.rank,
            world_size=self.world_size,
            isend=originals["isend"],
            irecv=originals["irecv"],
            link_delay_s=link_delay,
            group=self.probe_group,
            device=self.probe_device,
        ):
            self.outbox.add_probe(result)


class StepContext:
    """``with collectives.step(i):`` brackets one training step (a no-op when not instrumented)."""

    __slots__ = ("_rewind", "_session", "_step", "_token")

    def __init__(self, step: int, *, rewind: bool = False) -> None:
        self._step = step
        self._rewind = rewind
        self._session = _session
        self._token: object | None = None

    def __enter__(self) -> StepContext:
        if self._session is not None and not self._session.closed:
            self._token = self._session.step_start(self._step, rewind=self._rewind)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, token = self._session, self._token
        self._token = None
        if session is None or session.closed or token is None:
            return  # not opened (refused: see Session.step_start): nothing of ours to end
        if kind is None:
            session.step_end(token)
        else:
            session.step_abort(token)


# ---------------------------------------------------------------------- public functions


def instrument(
    job: str | None = None,
    *,
    config: InstrumentConfig | None = None,
    faults: Sequence[Fault] | None = None,
    mesh: Any = None,
    **overrides: Any,
) -> Session:
    """Start instrumenting this rank (call once, after ``init_process_group``).

    ``role="..."`` declares what this rank does (else derived from the DeviceMesh and
    pipeline stages the job builds); ``mesh`` names the job's DeviceMesh when it is not
    the one with the most dimensions this process holds.
    """
    global _session
    if not dist.is_available() or not dist.is_initialized():
        raise CollectivesConfigError(
            "collectives.instrument() needs torch.distributed initialized: "
            "call init_process_group() first"
        )
    cfg = config if config is not None else config_from_env(job, **overrides)
    with _session_lock:
        if _session is not None and not _session.closed:
            if _session.cfg.job != cfg.job:
                raise CollectivesConfigError(
                    f"already instrumented for job {_session.cfg.job!r}; call uninstrument() first"
                )
            return _session
        session = Session(cfg, faults)
        session.start()
        if mesh is not None:
            session.roles.see_mesh(mesh, force=True)
        _session = session
    return session


def set_role(
    role: str | None = None,
    *,
    pp_stage: int | None = None,
    dp_rank: int | None = None,
    tp_rank: int | None = None,
    group_ranks: Sequence[int] | None = None,
) -> None:
    """Declare (part of) this rank's role after ``instrument()``; it wins over derivation."""
    session = _session
    if session is None:
        raise NotInstrumentedError("call collectives.instrument() before set_role()")
    session.roles.declare(
        role=role, pp_stage=pp_stage, dp_rank=dp_rank, tp_rank=tp_rank, group_ranks=group_ranks
    )


def uninstrument() -> None:
    """Restore the original torch.distributed functions and stop the background threads."""
    global _session
    with _session_lock:
        session, _session = _session, None
    if session is not None:
        session.close()


def current() -> Session | None:
    return _session


def step(i: int, *, rewind: bool = False) -> StepContext:
    """Bracket training step ``i`` (``with collectives.step(i): ...``).

    Step numbers go forward within a process: one at or below the last step's is sent as
    the next number after it (an epoch loop's count that starts again at 0 goes on being
    counted), with one warning. ``rewind=True`` on the first step after reloading a
    checkpoint in this process sends ``i`` as it is: the steps from there are run again,
    as after a restart (every rank passes it at the same step)."""
    return StepContext(i, rewind=rewind)


def _step_number(value: Any) -> int | None:
    """``value`` as a step number a summary can carry (0 to ``STEP_MAX``, 10**12), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if 0 <= number <= STEP_MAX else None


def _sent(session: Session, step: int) -> int:
    """The loop's step number ``step`` in the numbering sent (commands' ``at_step``); a
    value that is no step number is passed on as it is."""
    number = _step_number(step)
    return step if number is None else session.numbering.sent(number)


def hook_optimizer(optimizer: torch.optim.Optimizer, start_step: int = 0) -> Callable[[], None]:
    """Mark steps at each ``optimizer.step()`` instead of ``with step(i)``.

    Step ``k`` runs from the end of one ``optimizer.step()`` to the end of the next, so the
    first step starts at the first call. Returns a function that removes the hook.
    """
    state: dict[str, Any] = {"next": start_step, "token": None}

    def post_hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        session = _session
        if session is None or session.closed:
            return
        if state["token"] is not None:
            session.step_end(state["token"])
        state["token"] = session.step_start(state["next"], via="hook")
        # -1, 0, 1, ...: valid from 0; not a number at all: every step is refused (warned once)
        with contextlib.suppress(TypeError):
            state["next"] = operator.index(state["next"]) + 1

    handle = optimizer.register_step_post_hook(post_hook)
    return handle.remove


def should_checkpoint(step: int) -> bool:
    """True once for each checkpoint request that applies after ``step`` (the loop's number
    of the step just ended: a request's ``at_step`` is in the numbering sent, see
    :func:`step`)."""
    session = _session
    return session is not None and session.control.checkpoint_due(_sent(session, step))


def checkpoint_vote(step: int) -> int:
    """This rank's say in a checkpoint after ``step``: 0 for none, else the newest request
    number due. A loop that agrees across ranks takes the maximum over ranks (an
    all-reduce with ``MAX``), checkpoints when it is above 0 and passes it to
    :func:`checkpoint_agreed`: one checkpoint per request, however many steps apart its
    copies reach the nodes."""
    session = _session
    return 0 if session is None else session.control.checkpoint_vote(_sent(session, step))


def checkpoint_agreed(vote: int) -> None:
    """Every rank, with the job's agreed (maximum) :func:`checkpoint_vote`: the requests it
    answers are dropped here and ignored when their copies still arrive."""
    session = _session
    if session is not None and vote > 0:
        session.control.checkpoint_agreed(vote)


def should_stop() -> bool:
    """True once the controller has asked this job to stop."""
    session = _session
    return session is not None and session.control.stop_requested()


def on_checkpoint(callback: CheckpointCallback) -> None:
    """Call ``callback(step)`` after the step at which a checkpoint request applies (``step``:
    the loop's own number of it, as given to :func:`step`)."""
    session = _session
    if session is None:
        raise NotInstrumentedError("call collectives.instrument() before on_checkpoint()")
    session.control.callbacks.append(callback)


def report_checkpoint(event: CheckpointEvent) -> None:
    """Deliver a checkpoint event to the node agent (and on to the controller).

    Pass it as the checkpoint engine's sink:
    ``checkpoint.Checkpointer(config, ..., event_sink=collectives.report_checkpoint)``.
    Without ``instrument()`` it does nothing, like the rest of the job-side face.
    """
    session = _session
    if session is not None:
        session.outbox.add_checkpoint(event)


def add_faults(spec: Any) -> None:
    """Add faults at run time (parsed like ``TRAINGUARD_FAULTS``)."""
    session = _session
    if session is None:
        raise NotInstrumentedError("call collectives.instrument() before add_faults()")
    session.add_faults(spec)


__all__ = [
    "Session",
    "StepContext",
    "add_faults",
    "checkpoint_agreed",
    "checkpoint_vote",
    "current",
    "hook_optimizer",
    "instrument",
    "on_checkpoint",
    "report_checkpoint",
    "set_role",
    "should_checkpoint",
    "should_stop",
    "step",
    "uninstrument",
]
