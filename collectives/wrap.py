"""Wrapping of torch.distributed's collective and point-to-point functions.

Each function is replaced in both ``torch.distributed`` and
``torch.distributed.distributed_c10d`` (code reaches them through either name, and
``batch_isend_irecv`` compares ``P2POp.op`` against the c10d global by identity). A
thread-local depth counter keeps a wrapped call made *inside* another wrapped call (e.g. a
helper that is itself built on ``all_gather``) from being counted twice.

Async calls (``async_op=True``, ``isend``/``irecv``) return a :class:`TimedWork` proxy: the
call stays in flight until ``wait()`` returns, ``is_completed()`` says so, or the future
from ``get_future()`` completes.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import finite
from .coalesce import FAST_PATH, Block
from .faults import FaultInjector
from .functional import FunctionalHooks
from .groups import GroupInfo, GroupRegistry, p2p_channel
from .recorder import Recorder, now
from .timed_work import TimedWork
from .timing import EventClock


@dataclass(frozen=True, slots=True)
class OpSpec:
    size_params: tuple[str, ...]
    """Parameters whose tensors make up ``size_bytes`` (what the call moves for this rank)."""
    input_param: str | None
    """The tensor a ``nan`` fault poisons (the data this rank contributes)."""
    peer_param: str | None = None
    """Point-to-point only: the parameter naming the other rank."""
    always_async: bool = False
    reduces: bool = False
    """A reduction: NaN/Inf in one rank's input spreads to every rank's result, so the input
    is checked before the call (``InstrumentConfig.check_nonfinite``)."""
    input_is_size: bool = field(init=False)
    """The input is the (only) sized argument, so its size is known before the check."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_is_size", self.size_params == (self.input_param,))


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec(("tensor",), "tensor", reduces=True),
    "all_gather": OpSpec(("tensor_list",), "tensor"),
    "all_gather_into_tensor": OpSpec(("output_tensor",), "input_tensor"),
    "reduce_scatter": OpSpec(("input_list",), "input_list", reduces=True),
    "reduce_scatter_tensor": OpSpec(("input",), "input", reduces=True),
    # torch 2.13's names for the two above (FSDP2 calls these), and older/coalesced forms
    "all_gather_single": OpSpec(("output_tensor",), "input_tensor"),
    "reduce_scatter_single": OpSpec(("input",), "input", reduces=True),
    "_all_gather_base": OpSpec(("output_tensor",), "input_tensor"),
    "_reduce_scatter_base": OpSpec(("input",), "input", reduces=True),
    "all_reduce_coalesced": OpSpec(("tensors",), "tensors", reduces=True),
    "all_gather_coalesced": OpSpec(("output_tensor_lists",), "input_tensor_list"),
    "broadcast": OpSpec(("tensor",), "tensor"),
    "barrier": OpSpec((), None),
    "all_to_all": OpSpec(("input_tensor_list",), "input_tensor_list"),
    "all_to_all_single": OpSpec(("input",), "input"),
    "reduce": OpSpec(("tensor",), "tensor", reduces=True),
    "gather": OpSpec(("tensor",), "tensor"),
    "scatter": OpSpec(("tensor",), "scatter_list"),
    "send": OpSpec(("tensor",), "tensor", "dst"),
    "recv": OpSpec(("tensor",), "tensor", "src"),
    "isend": OpSpec(("tensor",), "tensor", "dst", always_async=True),
    "irecv": OpSpec(("tensor",), "tensor", "src", always_async=True),
}

_tls = threading.local()
_COALESCING = "_coalescing_manager"


class _Params:
    """Positional-or-keyword lookup without ``inspect.Signature.bind`` (too slow per call)."""

    __slots__ = ("index",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.index = {name: i for i, name in enumerate(inspect.signature(fn).parameters)}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if kwargs and name in kwargs:
            return kwargs[name]
        i = self.index.get(name, 1 << 30)
        return args[i] if i < len(args) else None


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _nbytes(value: Any) -> tuple[int, str]:
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:  # sparse (gloo all-reduces COO): no ``nbytes``
            return _sparse_nbytes(value), _dtype_name(value.dtype)
        return value.nbytes, _dtype_name(value.dtype)
    if isinstance(value, list | tuple) and value:
        total, dtype = 0, ""
        for item in value:
            n, d = _nbytes(item)
            total += n
            dtype = dtype or d
        return total, dtype
    return 0, ""


def _sparse_nbytes(value: torch.Tensor) -> int:
    """What a sparse COO tensor moves: its indices and values (other layouts: 0)."""
    if value.layout is torch.sparse_coo:
        return int(value._indices().nbytes + value._values().nbytes)
    return 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _nonfinite(value: Any, min_bytes: int = 0) -> bool:
    """Whether a CPU floating-point tensor (or a list of them) of at least ``min_bytes``
    holds NaN or Inf.

    One fused ``sum`` (NaN and Inf survive it) instead of ``isfinite().all()``, which
    allocates a bool per element and measured 3-45x slower. Half types sum in float32. A
    sum of large finite values can still overflow (float32 near 3e38, bfloat16 likewise),
    so a non-finite sum is confirmed element by element before it counts: the slow check
    runs only when the fast one alarms. CUDA tensors are skipped: reading the result would
    synchronize the stream.
    """
    if isinstance(value, torch.Tensor):
        if value.layout is not torch.strided:  # sparse: its values are what could be NaN
            if value.layout is not torch.sparse_coo:
                return False
            value = value._values()
        if value.nbytes < max(min_bytes, 1) or value.is_cuda or not value.is_floating_point():
            return False
        wide = torch.float32 if value.element_size() < 4 else None
        if math.isfinite(float(value.sum(dtype=wide))):
            return False
        return not bool(torch.isfinite(value).all())  # an overflowing sum is no NaN/Inf
    if isinstance(value, list | tuple):
        return any(_nonfinite(item, min_bytes) for item in value)
    return False


def _on_gpu(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` is timed with CUDA events (a seam for GPU-less tests)."""
    return bool(tensor.is_cuda)


class Instrumenter:
    """Owns the patched functions and turns every call into a :class:`CallRecord`."""

    def __init__(
        self,
        recorder: Recorder,
        injector: FaultInjector | None,
        *,
        clock: EventClock | None,
        sleep: Callable[[float], None],
    ) -> None:
        self.recorder = recorder
        self.injector = injector
        self.groups = GroupRegistry(on_new=self._new_group)
        self.rank = recorder.rank
        self.originals: dict[str, Callable[..., Any]] = {}
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self.clock = clock
        #: Which tensors are timed with the clock's marks: CUDA ones, or all (CPU clock).
        self._device_only = clock is not None and clock.name == "cuda"
        recorder.clock = clock
        self.functional = FunctionalHooks(self, _tls)
        self._rebound: list[tuple[Any, str, Any]] = []
        self._sleep = sleep
        self.check_nonfinite = recorder.cfg.check_nonfinite
        #: Devices whose NaN/Inf check already ran once (:func:`.finite.warm_up`).
        self._warm: set[torch.device] = set()
        self.nonfinite_min_bytes = recorder.cfg.nonfinite_check_min_bytes

    def _new_group(self, info: GroupInfo) -> None:
        self.recorder.group_ranks[info.id] = sorted(info.ranks)
        if info.name:
            self.recorder.group_names[info.id] = info.name

    # ------------------------------------------------------------------ patching

    def patch(self) -> None:
        self.groups.world()
        self.functional.install()
        for name, spec in OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                # An op this torch release does not have (``all_gather_single`` and
                # ``reduce_scatter_single`` are newer than 2.11, which the declared range
                # covers): a job cannot call it, so there is nothing to wrap.
                continue
            self.originals[name] = original
            wrapper = self._make_wrapper(name, spec, original)
            self._wrappers[name] = wrapper
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        coalescing = getattr(c10d, _COALESCING, None)
        if coalescing is not None:
            self.originals[_COALESCING] = coalescing
            wrapper = self._wrap_coalescing(coalescing)
            self._wrappers[_COALESCING] = wrapper
            setattr(c10d, _COALESCING, wrapper)
            if hasattr(dist, _COALESCING):
                setattr(dist, _COALESCING, wrapper)
        self._rebind_imported()

    def _rebind_imported(self) -> None:
        """torch's own modules imported before ``instrument()`` that hold an original by
        name (``from torch.distributed.distributed_c10d import scatter``: DTensor's
        ``mesh_scatter``, among ~10 modules) get the wrapper too, as the job's own later
        imports do; restored by :meth:`unpatch`."""
        wrappers = {id(self.originals[n]): w for n, w in self._wrappers.items()}
        for module, attr, value in _torch_bindings():
            # a module imported while an earlier session was on holds that one's wrapper
            original = getattr(value, "__trainguard_original__", value)
            wrapper = wrappers.get(id(original))
            if wrapper is not None:
                setattr(module, attr, wrapper)
                self._rebound.append((module, attr, original))

    def unpatch(self) -> None:
        self.functional.remove()
        for module, attr, original in reversed(self._rebound):
            setattr(module, attr, original)
        self._rebound.clear()
        # ...and modules imported while this session was on took its wrappers: give them back
        mine = {id(w): self.originals[n] for n, w in self._wrappers.items()}
        for module, attr, value in _torch_bindings():
            original = mine.get(id(value))
            if original is not None:
                setattr(module, attr, original)
        for name, original in self.originals.items():
            for module in (c10d, dist):
                if getattr(module, name, None) is self._wrappers[name]:
                    setattr(module, name, original)
        self.originals.clear()
        self._wrappers.clear()

    def _make_wrapper(
        self, op: str, spec: OpSpec, original: Callable[..., Any]
    ) -> Callable[..., Any]:
        params = _Params(original)
        call = self.call

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(_tls, "depth", 0):
                return original(*args, **kwargs)
            return call(op, spec, params, original, args, kwargs)

        wrapper.__trainguard_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_coalescing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``_coalescing_manager`` whose block is recorded and timed as one collective
        (:mod:`collectives.coalesce`)."""
        params = _Params(original)

        @functools.wraps(original)
        def coalescing_manager(*args: Any, **kwargs: Any) -> Any:
            inner = original(*args, **kwargs)
            if getattr(_tls, "depth", 0) or getattr(_tls, "block", None) is not None:
                return inner  # nested, or issued by a call already recorded
            group = params.get(args, kwargs, "group")
            if group is not None and c10d._rank_not_in_group(group):
                return inner  # not a member: torch's calls in the block do nothing
            return Block(
                self,
                _tls,
                inner,
                self.groups.resolve(group).id,
                device=params.get(args, kwargs, "device") is not None,
                async_ops=bool(params.get(args, kwargs, "async_ops")),
            )

        coalescing_manager.__trainguard_original__ = original  # type: ignore[attr-defined]
        return coalescing_manager

    # ------------------------------------------------------------------ one call

    def call(
        self,
        op: str,
        spec: OpSpec,
        params: _Params,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        recorder = self.recorder
        group = params.get(args, kwargs, "group")
        # Transparency first: torch judges the arguments. Should reading them fail here (a
        # group that is no process group, a peer that is no rank), torch runs the call and
        # raises its own error, of its own type, unrecorded; the wrapper never raises one.
        try:
            # torch warns and does nothing for a group this rank is not in: nothing to record
            member = group is None or not c10d._rank_not_in_group(group)
            if member:
                if spec.peer_param is None:
                    info = self.groups.resolve(group)
                    gid, members = info.id, info.ranks
                else:
                    peer = self._peer(params, args, kwargs, spec.peer_param, group)
                    gid = p2p_channel(self.rank, peer)
                    members = frozenset((self.rank,) if peer is None else (self.rank, peer))
                # Every lookup below runs on each call of the training thread: each argument
                # is fetched once, and the NaN/Inf check is skipped before a call when the
                # size already says the input is under its threshold.
                size, dtype, first = 0, "", None
                if spec.size_params:
                    first = params.get(args, kwargs, spec.size_params[0])
                    size, dtype = _nbytes(first)
                    for name in spec.size_params[1:]:
                        n, d = _nbytes(params.get(args, kwargs, name))
                        size += n
                        dtype = dtype or d
                async_op = spec.always_async or bool(params.get(args, kwargs, "async_op"))
        except Exception:
            member = False
        if not member:
            return original(*args, **kwargs)
        if spec.peer_param is not None and gid not in recorder.group_ranks:
            recorder.group_ranks[gid] = sorted(members)
        block: Block | None = getattr(_tls, "block", None)
        if block is not None:
            if gid == block.gid and op in FAST_PATH:
                return self._coalesced(block, op, spec, params, args, kwargs, first, size, dtype)
            if not block.device_mode or (
                gid != block.gid and self.groups.resolve(group).id != block.gid
            ):
                block = None  # a call of its own, outside the block's Work
        injector = self.injector
        inside = None
        step = recorder.step
        source = None
        if spec.input_param is not None:
            source = first if spec.input_is_size else params.get(args, kwargs, spec.input_param)
        if injector is not None and step is not None:
            injector.stretch_compute(step, recorder.compute_segment_s())
            inside = injector.before_call(step, op, source)
        clock = self.clock
        timed = False
        if clock is not None and first is not None:
            tensor = _first_tensor(first)
            timed = tensor is not None and (not self._device_only or _on_gpu(tensor))
            if (
                timed
                and tensor is not None
                and self.check_nonfinite
                and tensor.device not in self._warm
            ):
                self._warm.add(tensor.device)  # once per device: never inside a later step
                finite.warm_up(tensor, clock)
        # After the injector (a ``nan`` fault poisons the input there), before the call.
        check = (
            spec.reduces
            and step is not None
            and self.check_nonfinite
            and (size >= self.nonfinite_min_bytes or not spec.input_is_size)
        )
        bad = check and not timed and _nonfinite(source, self.nonfinite_min_bytes)
        t0 = now()
        rec = recorder.enter(op, gid, size, dtype, async_op, t0)
        if bad:
            recorder.nonfinite_input(rec)
        start = None
        if timed:
            if check:  # queued on the stream ahead of the reduction that would spread it
                recorder.device_nonfinite(source, rec)
            # queued in a device-mode block: the block's marks bracket the call
            shared = block.start if block is not None else None
            start = shared if shared is not None else clock.start()  # type: ignore[union-attr]
            rec.events = (start, None)
        _tls.depth = 1
        try:
            if injector is not None and step is not None:
                if inside is not None:
                    injector.block(inside)
                extra = injector.link_delay_s(step, members)
                if extra > 0:
                    self._sleep(extra)
            result = original(*args, **kwargs)
        except BaseException:
            _tls.depth = 0
            recorder.unblocked(t0, now(), rec)
            recorder.complete(rec, now(), ok=False)
            raise
        _tls.depth = 0
        t1 = now()
        if start is None:
            if not async_op:
                recorder.finish(rec, t0, t1)
                return result
            recorder.unblocked(t0, t1, rec)
            if result is not None:
                return TimedWork(result, rec, recorder)
            recorder.complete(rec, t1)
            return result
        recorder.unblocked(t0, t1, rec)
        if block is not None:  # queued in the block's NCCL group: timed by the block's marks
            block.defer(rec, t1 - t0)
            return result
        if async_op and result is not None:
            rec.events = (start, clock.end_async(result))  # type: ignore[union-attr]
            recorder.event_launched(rec, t1 - t0)
            return TimedWork(result, rec, recorder)
        rec.events = (start, clock.end_sync())  # type: ignore[union-attr]
        recorder.event_launched(rec, t1 - t0)
        return result

    def _coalesced(
        self,
        block: Block,
        op: str,
        spec: OpSpec,
        params: _Params,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        first: Any,
        size: int,
        dtype: str,
    ) -> Any:
        """A fast-path call inside a coalescing block: torch lists it; the block's one
        record takes its size and its NaN/Inf check."""
        tensor = _first_tensor(first) if first is not None else None
        timed = (
            self.clock is not None
            and tensor is not None
            and (not self._device_only or _on_gpu(tensor))
        )
        source = None
        if spec.input_param is not None:
            source = first if spec.input_is_size else params.get(args, kwargs, spec.input_param)
        check = (
            spec.reduces
            and self.recorder.step is not None
            and self.check_nonfinite
            and (size >= self.nonfinite_min_bytes or not spec.input_is_size)
        )
        bad = check and not timed and _nonfinite(source, self.nonfinite_min_bytes)
        return block.add(
            op,
            size,
            dtype,
            bad=bad,
            device_check=source if check and timed else None,
            timed=timed,
            original=self.originals[op],
            args=args,
            kwargs=kwargs,
        )

    def _peer(
        self,
        params: _Params,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        group: Any,
    ) -> int | None:
        peer = params.get(args, kwargs, name)
        if peer is not None:
            return int(peer)
        group_peer = params.get(args, kwargs, "group_" + name)
        if group_peer is None:
            return None
        return (
            int(dist.get_global_rank(group, int(group_peer)))
            if group is not None
            else int(group_peer)
        )


def _torch_bindings() -> list[tuple[Any, str, Any]]:
    """(module, name, function) of every function bound by name in a ``torch.distributed.*``
    module other than the two the wrapper replaces in."""
    out = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("torch.distributed.") or module in (c10d, dist):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if callable(value) and not isinstance(value, type):
                out.append((module, attr, value))
    return out


__all__ = ["OPS", "Instrumenter", "OpSpec", "TimedWork"]


def raised_in_collective(tb: TracebackType | None) -> bool:
    """Whether a traceback passes through one of this module's collective wrappers."""
    return any(frame.f_code.co_filename == __file__ for frame, _ in traceback.walk_tb(tb))
