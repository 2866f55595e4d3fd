"""Deterministic fault injection for tests, the demo and chaos drills.

Faults are keyed by rank and step so a scenario replays exactly: the same spec, the same
ranks, the same steps, the same (seeded) delays. They are configured by
``TRAINGUARD_FAULTS`` (JSON text, or the path of a JSON file) when ``instrument()`` runs,
and at run time through :meth:`FaultInjector.add` (the hook a chaos command will call).

Spec (a list, or ``{"faults": [...]}``), every field checked strictly::

    {"kind": "delay",     "rank": 1, "from_step": 5, "to_step": 9, "delay_s": 0.05,
                          "jitter_s": 0.02, "seed": 7}
    {"kind": "slowdown",  "rank": [2, 3], "from_step": 0, "factor": 1.5}
    {"kind": "hang",      "rank": 3, "at_step": 7, "op": "all_reduce", "call": 1,
                          "where": "before" | "inside", "duration_s": null}
    {"kind": "crash",     "rank": 1, "at_step": 9, "exit_code": 3}        # or "signal": "SIGKILL"
    {"kind": "slow_link", "ranks": [0, 1], "from_step": 0, "delay_s": 0.02}
    {"kind": "nan",       "rank": 0, "at_step": 4, "op": "all_reduce", "call": 1}

Steps: ``at_step`` (one step) or ``from_step``/``to_step`` (inclusive; defaults 0 and
forever). Faults act only inside ``collectives.step(...)``. Any fault may also name a
``generation``: it is then armed only in the run whose ``TRAINGUARD_GENERATION`` (set by
the controller's actuator on every restart; 0 when unset) matches, so a scenario can break
the first run and watch the restarted one recover from it. Where each acts:

* ``delay``: sleeps ``delay_s + U(0, jitter_s)`` at step start (compute time). The random
  part comes from ``Random(f"{seed}:{rank}:{step}")``, so it replays.
* ``slowdown``: before every collective and at step end, sleeps ``(factor - 1)`` times the
  compute segment just measured: compute stretched by ``factor``.
* ``hang``: blocks before (never entering) or inside (after entering) the ``call``-th
  matching collective of the step; forever unless ``duration_s``. ``op`` omitted: any op.
* ``crash``: before the ``call``-th matching collective, or at step start without ``op``:
  exit with ``exit_code`` (``os._exit``) or send the rank ``signal`` to itself.
* ``slow_link``: inside every collective whose group holds both ranks, and every
  send/recv/probe between them, both ranks sleep ``delay_s``: collective time grows
  job-wide with no late arriver.
* ``nan``: fills the first tensor of the ``call``-th matching call with NaN before it runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal as signal_module
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.textfile import Unparsable, load_json

from .errors import FaultSpecError

#: Every op name the wrapper knows, so a typo in ``op`` is refused instead of never firing.
KNOWN_OPS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "barrier",
        "all_to_all",
        "all_to_all_single",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
    }
)
KINDS = ("delay", "slowdown", "hang", "crash", "slow_link", "nan")
_COMMON = {"kind", "rank", "at_step", "from_step", "to_step", "generation"}
_FIELDS: dict[str, set[str]] = {
    "delay": _COMMON | {"delay_s", "jitter_s", "seed"},
    "slowdown": _COMMON | {"factor"},
    "hang": _COMMON | {"op", "call", "where", "duration_s"},
    "crash": _COMMON | {"op", "call", "exit_code", "signal"},
    "slow_link": (_COMMON - {"rank"}) | {"ranks", "delay_s"},
    "nan": _COMMON | {"op", "call"},
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Fault:
    """One parsed fault; fields not used by its ``kind`` keep their defaults."""

    kind: str
    ranks: frozenset[int]
    from_step: int = 0
    to_step: int | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    seed: int = 0
    factor: float = 1.0
    op: str | None = None
    call: int = 1
    where: str = "before"
    duration_s: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    #: Armed only in this generation of the job (None: in every one).
    generation: int | None = None

    def active(self, step: int) -> bool:
        return step >= self.from_step and (self.to_step is None or step <= self.to_step)

    def step_delay_s(self, rank: int, step: int) -> float:
        if not self.jitter_s:
            return self.delay_s
        return self.delay_s + random.Random(f"{self.seed}:{rank}:{step}").uniform(
            0.0, self.jitter_s
        )


def parse_faults(spec: Any, source: str = "fault spec") -> list[Fault]:
    """Parse a decoded JSON spec (a list or ``{"faults": [...]}``) strictly."""
    if isinstance(spec, Mapping):
        if set(spec) != {"faults"}:
            raise FaultSpecError(f"{source}: top-level object must have only 'faults'")
        spec = spec["faults"]
    if not isinstance(spec, list):
        raise FaultSpecError(f"{source}: expected a list of faults or {{'faults': [...]}}")
    return [_parse_one(item, f"{source}: fault #{i + 1}") for i, item in enumerate(spec)]


def load_faults(value: str, source: str = "TRAINGUARD_FAULTS") -> list[Fault]:
    """Parse JSON text, or the JSON file a non-JSON value names."""
    text = value.strip()
    if not text:
        return []
    if text[0] not in "[{":
        path = Path(text)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise FaultSpecError(
                f"{source}: cannot read fault file {path}: {exc.strerror or type(exc).__name__}"
            ) from None
        except UnicodeDecodeError:
            raise FaultSpecError(
                f"{source}: cannot read fault file {path}: not UTF-8 text"
            ) from None
        source = f"{source} ({path})"
    try:
        decoded = load_json(text)  # as every operator file: a key given twice is refused
    except Unparsable as exc:
        raise FaultSpecError(f"{source}: invalid JSON: {exc.reason}") from None
    return parse_faults(decoded, source)


def _int(where: str, name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FaultSpecError(f"{where}: '{name}' must be an integer >= {minimum}, got {value!r}")
    return value


#: The largest number a fault takes (seconds, or a slowdown factor): a day. ``time.sleep``
#: refuses infinity and anything past C's time limits with OverflowError, which would
#: crash the rank at run time instead of delaying it: refuse such a spec when it is read.
MAX_NUMBER = 86_400.0


def _float(where: str, name: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        raise FaultSpecError(f"{where}: '{name}' must be a number >= {minimum}, got {value!r}")
    if not value <= MAX_NUMBER:  # infinity (NaN failed above)
        raise FaultSpecError(
            f"{where}: '{name}' must be at most {MAX_NUMBER:g} (a day), got {value!r}"
        )
    return float(value)


def _parse_one(item: Any, where: str) -> Fault:
    if not isinstance(item, Mapping):
        raise FaultSpecError(f"{where}: expected an object, got {type(item).__name__}")
    kind = item.get("kind")
    if kind not in _FIELDS:
        raise FaultSpecError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    where = f"{where} ({kind})"
    unknown = sorted(set(item) - _FIELDS[kind])
    if unknown:
        allowed = ", ".join(sorted(_FIELDS[kind]))
        raise FaultSpecError(f"{where}: unknown field '{unknown[0]}' (allowed: {allowed})")
    args: dict[str, Any] = {"kind": kind, "ranks": _ranks(item, kind, where)}
    if item.get("generation") is not None:
        args["generation"] = _int(where, "generation", item["generation"])
    if "at_step" in item:
        if "from_step" in item or "to_step" in item:
            raise FaultSpecError(f"{where}: give 'at_step' or 'from_step'/'to_step', not both")
        args["from_step"] = args["to_step"] = _int(where, "at_step", item["at_step"])
    else:
        args["from_step"] = _int(where, "from_step", item.get("from_step", 0))
        if item.get("to_step") is not None:
            args["to_step"] = _int(where, "to_step", item["to_step"], args["from_step"])
    if kind in ("delay", "slow_link"):
        if "delay_s" not in item:
            raise FaultSpecError(f"{where}: 'delay_s' is required")
        args["delay_s"] = _float(where, "delay_s", item["delay_s"])
    if kind == "delay":
        args["jitter_s"] = _float(where, "jitter_s", item.get("jitter_s", 0.0))
        args["seed"] = _int(where, "seed", item.get("seed", 0))
    if kind == "slowdown":
        if "factor" not in item:
            raise FaultSpecError(f"{where}: 'factor' is required (compute time multiplier)")
        args["factor"] = _float(where, "factor", item["factor"], 1.0)
    if kind in ("hang", "crash", "nan"):
        op = item.get("op", "all_reduce" if kind == "nan" else None)
        if op is not None and op not in KNOWN_OPS:
            raise FaultSpecError(
                f"{where}: unknown op {op!r} (one of {', '.join(sorted(KNOWN_OPS))})"
            )
        args["op"] = op
        args["call"] = _int(where, "call", item.get("call", 1), 1)
    if kind == "hang":
        args["where"] = item.get("where", "before")
        if args["where"] not in ("before", "inside"):
            raise FaultSpecError(f"{where}: 'where' must be 'before' or 'inside'")
        if item.get("duration_s") is not None:
            args["duration_s"] = _float(where, "duration_s", item["duration_s"])
    if kind == "crash":
        _parse_crash(item, where, args)
    return Fault(**args)


def _ranks(item: Mapping[str, Any], kind: str, where: str) -> frozenset[int]:
    if kind == "slow_link":
        pair = item.get("ranks")
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise FaultSpecError(f"{where}: 'ranks' must be two different ranks, e.g. [0, 1]")
        return frozenset(_int(where, "ranks", r) for r in pair)
    if "rank" not in item:
        raise FaultSpecError(f"{where}: 'rank' is required (an integer or a list)")
    raw = item["rank"]
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise FaultSpecError(f"{where}: 'rank' must not be empty")
    return frozenset(_int(where, "rank", r) for r in values)


def _parse_crash(item: Mapping[str, Any], where: str, args: dict[str, Any]) -> None:
    if ("exit_code" in item) == ("signal" in item):
        raise FaultSpecError(f"{where}: give exactly one of 'exit_code' or 'signal'")
    if "exit_code" in item:
        args["exit_code"] = _int(where, "exit_code", item["exit_code"])
        if args["exit_code"] > 255:
            raise FaultSpecError(f"{where}: 'exit_code' must be 0..255")
        return
    raw = item["signal"]
    if isinstance(raw, str):
        name = raw.upper() if raw.upper().startswith("SIG") else "SIG" + raw.upper()
        sig = getattr(signal_module, name, None)
        if not isinstance(sig, signal_module.Signals):
            raise FaultSpecError(f"{where}: unknown signal {raw!r}")
        args["signal"] = int(sig)
    else:
        number = _int(where, "signal", raw, 1)
        if number not in signal_module.valid_signals():
            # os.kill would raise ValueError/OSError at the crash point instead of dying.
            raise FaultSpecError(f"{where}: 'signal' {number} is not a signal of this system")
        args["signal"] = number


class FaultInjector:
    """Applies the faults that match this rank; called by the wrapper at fixed points.

    The fault list is replaced, never mutated, so the hot path reads it without a lock.
    """

    def __init__(self, rank: int, faults: Sequence[Fault] = ()) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._faults: tuple[Fault, ...] = ()
        self._calls: dict[tuple[int, str], int] = {}
        self._calls_step = -1
        #: Called before the process dies on purpose (the runtime flushes records there).
        self.before_exit: Callable[[int | None, int | None], None] | None = None
        self.sleep: Callable[[float], None] = time.sleep
        self.add(faults)

    @property
    def faults(self) -> tuple[Fault, ...]:
        return self._faults

    def add(self, faults: Sequence[Fault] | Any) -> None:
        """Add faults at run time: parsed :class:`Fault` objects or a raw JSON-like spec."""
        parsed = list(faults) if all(isinstance(f, Fault) for f in faults) else parse_faults(faults)
        with self._lock:
            self._faults = self._faults + tuple(parsed)

    def clear(self) -> None:
        with self._lock:
            self._faults = ()

    def _mine(self, step: int, kind: str) -> list[Fault]:
        return [
            f for f in self._faults if f.kind == kind and self.rank in f.ranks and f.active(step)
        ]

    # ------------------------------------------------------------ hooks called by the wrapper

    def on_step_start(self, step: int) -> None:
        for fault in self._mine(step, "crash"):
            if fault.op is None:
                self._crash(fault)
        total = sum(f.step_delay_s(self.rank, step) for f in self._mine(step, "delay"))
        if total > 0:
            self.sleep(total)

    def stretch_compute(self, step: int, compute_segment_s: float) -> None:
        """Sleep so the compute segment just measured lasts ``factor`` times longer."""
        extra = sum((f.factor - 1.0) * compute_segment_s for f in self._mine(step, "slowdown"))
        if extra > 0:
            self.sleep(extra)

    def before_call(self, step: int, op: str, tensor: Any) -> Fault | None:
        """Runs before the call is entered; returns a ``hang(where=inside)`` to apply later."""
        if self._calls_step != step:
            self._calls_step, self._calls = step, {}
        inside: Fault | None = None
        for fault in self._faults:
            if fault.kind not in ("hang", "crash", "nan") or self.rank not in fault.ranks:
                continue
            if not fault.active(step) or (fault.op is not None and fault.op != op):
                continue
            if fault.kind == "crash" and fault.op is None:
                continue  # fired at step start (on_step_start)
            key = (id(fault), op if fault.op else "*")
            n = self._calls.get(key, 0) + 1
            self._calls[key] = n
            if n != fault.call:
                continue
            if fault.kind == "crash":
                self._crash(fault)
            elif fault.kind == "nan":
                _poison(tensor)
            elif fault.where == "before":
                self.block(fault)
            else:
                inside = fault
        return inside

    def link_delay_s(self, step: int | None, ranks: frozenset[int] | Sequence[int]) -> float:
        """Extra seconds a call among ``ranks`` (a group, or a pair) spends on slow links."""
        if step is None or self.rank not in ranks:
            return 0.0
        return sum(
            f.delay_s
            for f in self._faults
            if f.kind == "slow_link"
            and f.active(step)
            and self.rank in f.ranks
            and f.ranks <= frozenset(ranks)
        )

    def block(self, fault: Fault) -> None:
        """Hang the calling thread (background threads keep reporting meanwhile)."""
        if fault.duration_s is not None:
            self.sleep(fault.duration_s)
            return
        while True:  # pragma: no branch - a hang is forever by definition
            time.sleep(3600)

    def _crash(self, fault: Fault) -> None:
        if self.before_exit is not None:
            with contextlib.suppress(Exception):  # dying anyway; the fault must still fire
                self.before_exit(fault.exit_code, fault.signal)
        if fault.signal is not None:
            os.kill(os.getpid(), fault.signal)
            time.sleep(5)  # a handled signal: still die
        os._exit(fault.exit_code if fault.exit_code is not None else 1)


def _poison(tensor: Any) -> None:
    target = tensor[0] if isinstance(tensor, list | tuple) and tensor else tensor
    if target is not None and getattr(target, "is_floating_point", lambda: False)():
        target.fill_(float("nan"))


def injector_from_env(rank: int, env: Mapping[str, str] | None = None) -> FaultInjector | None:
    env = os.environ if env is None else env
    value = env.get("TRAINGUARD_FAULTS", "")
    faults = load_faults(value) if value.strip() else []
    raw = env.get("TRAINGUARD_GENERATION", "").strip()
    generation = int(raw) if raw.isdigit() else 0
    faults = [f for f in faults if f.generation is None or f.generation == generation]
    return FaultInjector(rank, faults) if faults else None


__all__ = [
    "KINDS",
    "KNOWN_OPS",
    "Fault",
    "FaultInjector",
    "injector_from_env",
    "load_faults",
    "parse_faults",
]
