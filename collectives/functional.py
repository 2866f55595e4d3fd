"""Functional collectives (``torch.distributed._functional_collectives``), seen at their operators.

DTensor redistributes, tensor-parallel layers and every collective ``torch.compile`` puts in
a graph call the ``_c10d_functional`` operators (``torch.ops._c10d_functional.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ...) rather than
``torch.distributed.all_reduce``: C++ resolves the process group by name and never comes back
through Python, so the function wrappers of :mod:`collectives.wrap` cannot see them.

Each such operator gets a Python kernel, registered with ``torch.library`` at the
``BackendSelect`` dispatch key: a key in every dispatch's default included set, below the
autograd, functionalization and Python (tensor subclass, fake tensor) keys and just above the
backend. So the kernel runs for every call that reaches a real kernel, whoever made it: eager
code, the waits an ``AsyncCollectiveTensor`` issues from its ``__torch_dispatch__``, calls
under ``torch.inference_mode()``, and the graphs ``torch.compile`` runs (measured on torch
2.13 CPU: ``aot_eager`` graphs call ``all_reduce``/``all_gather_into_tensor``, inductor's
generated code calls ``all_reduce_`` in place, then ``wait_tensor``). The kernel records the
call with its process group, then redispatches to torch's own kernel with the keys below
``BackendSelect``. A functional collective is asynchronous: it returns at once and completes
at ``wait_tensor`` (also given a kernel), so the record stays in flight until its outputs are
waited (on a device: until the mark recorded after that wait fires).

The kernels are registered in the dispatcher, never by replacing attributes of
``torch.ops._c10d_functional``: dynamo guards on those objects, and a stand-in made every
compiled function that calls a functional collective fail its own guards.

Not seen: calls traced with fake or functional tensors while compiling (not run, so rightly
not recorded), and the functional point-to-point operators (``isend``, ``irecv``,
``batch_p2p_ops``; pipelining uses the eager ones, which :mod:`collectives.wrap` sees).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import distributed_c10d as c10d

from .groups import GroupInfo
from .recorder import CallRecord, now

if TYPE_CHECKING:
    from .wrap import Instrumenter


@dataclass(frozen=True, slots=True)
class FunctionalOp:
    op: str
    """The name recorded (the eager ``torch.distributed`` name of the same collective)."""
    group_arg: int
    """Position of ``group_name`` in the operator's arguments."""
    gathers: bool = False
    """The output is ``group_size`` times the input (``all_gather_into_tensor``)."""
    reduces: bool = False


FUNCTIONAL_OPS: dict[str, FunctionalOp] = {
    "all_reduce": FunctionalOp("all_reduce", 2, reduces=True),
    "all_reduce_": FunctionalOp("all_reduce", 2, reduces=True),
    "all_reduce_coalesced": FunctionalOp("all_reduce_coalesced", 2, reduces=True),
    "all_reduce_coalesced_": FunctionalOp("all_reduce_coalesced", 2, reduces=True),
    "all_gather_into_tensor": FunctionalOp("all_gather_into_tensor", 2, gathers=True),
    "all_gather_into_tensor_out": FunctionalOp("all_gather_into_tensor", 2, gathers=True),
    "all_gather_into_tensor_coalesced": FunctionalOp(
        "all_gather_into_tensor_coalesced", 2, gathers=True
    ),
    "reduce_scatter_tensor": FunctionalOp("reduce_scatter_tensor", 3, reduces=True),
    "reduce_scatter_tensor_out": FunctionalOp("reduce_scatter_tensor", 3, reduces=True),
    "reduce_scatter_tensor_coalesced": FunctionalOp(
        "reduce_scatter_tensor_coalesced", 3, reduces=True
    ),
    "all_to_all_single": FunctionalOp("all_to_all_single", 3),
    "broadcast": FunctionalOp("broadcast", 2),
    "broadcast_": FunctionalOp("broadcast", 2),
}

_PLAIN = (torch.Tensor, torch.nn.Parameter)

_KEY = "BackendSelect"
#: The keys a kernel at ``_KEY`` hands the call on to (the backend's).
_BELOW = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _compiling() -> bool:
    """Dynamo is tracing: leave the call to the graph (its run is seen, not its trace)."""
    return bool(torch.compiler.is_compiling())


def _real(tensors: list[torch.Tensor]) -> bool:
    """Plain tensors with data (not fake/meta tensors of a compile-time trace)."""
    return bool(tensors) and all(type(t) in _PLAIN and not t.is_meta for t in tensors)


class FunctionalHooks:
    """The ``_c10d_functional`` kernels of one session (removed by :meth:`remove`)."""

    def __init__(self, instrumenter: Instrumenter, depth: threading.local) -> None:
        self.instrumenter = instrumenter
        self._tls = depth
        self._library: Any = None
        """The ``torch.library.Library`` holding the kernels while installed (torch leaves
        its methods unannotated, hence ``Any``)."""
        #: data_ptr of an output not yet waited -> (its call, outputs of that call still due)
        self._pending: dict[int, tuple[CallRecord, list[int]]] = {}
        self._lock = threading.Lock()
        self._groups: dict[str, GroupInfo] = {}

    def install(self) -> None:
        namespace = torch.ops._c10d_functional
        library: Any = torch.library.Library(  # type: ignore[no-untyped-call]
            "_c10d_functional", "IMPL"
        )
        try:
            for name, spec in FUNCTIONAL_OPS.items():
                packet = getattr(namespace, name, None)
                if packet is None:  # an older torch without this operator
                    continue
                library.impl(name, self._kernel(packet.default, spec), _KEY, with_keyset=True)
            wait = namespace.wait_tensor.default
            library.impl("wait_tensor", self._wait_kernel(wait), _KEY, with_keyset=True)
        except BaseException:
            library._destroy()
            raise
        self._library = library

    def remove(self) -> None:
        """Deregister the kernels (torch's own serve the operators again)."""
        library, self._library = self._library, None
        if library is not None:
            library._destroy()

    # ------------------------------------------------------------------ kernels

    def _kernel(self, overload: Any, spec: FunctionalOp) -> Callable[..., Any]:
        tls = self._tls

        def kernel(keys: Any, *args: Any, **kwargs: Any) -> Any:
            below = keys & _BELOW
            inputs = _tensors(args[0]) if args else []
            if getattr(tls, "depth", 0) or _compiling() or not _real(inputs):
                return overload.redispatch(below, *args, **kwargs)
            rec, start = self._enter(spec, args, inputs)
            tls.depth = 1
            try:
                result = overload.redispatch(below, *args, **kwargs)
            except BaseException:
                self.instrumenter.recorder.complete(rec, now(), ok=False)
                raise
            finally:
                tls.depth = 0
            outputs = _tensors(result)
            if not outputs:  # nothing to wait for: the call returned done
                self._close(rec, start)
                return result
            keys = [t.data_ptr() for t in outputs]
            with self._lock:
                for key in keys:
                    self._pending[key] = (rec, keys)
            return result

        return kernel

    def _wait_kernel(self, overload: Any) -> Callable[..., Any]:
        def kernel(dispatch_keys: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            below = dispatch_keys & _BELOW
            recorder = self.instrumenter.recorder
            hit = None
            if self._pending and type(tensor) in _PLAIN and not tensor.is_meta:
                with self._lock:
                    hit = self._pending.pop(tensor.data_ptr(), None)
            if hit is None:
                return overload.redispatch(below, tensor, *args, **kwargs)
            rec, keys = hit
            recorder.blocked()
            t0 = now()
            try:
                result = overload.redispatch(below, tensor, *args, **kwargs)
            finally:
                recorder.unblocked(t0, now(), rec)
            if tensor.data_ptr() in keys:
                keys.remove(tensor.data_ptr())
            if not keys:
                self._close(rec, rec.events[0] if rec.events is not None else None)
            return result

        return kernel

    # ------------------------------------------------------------------ records

    def _enter(
        self, spec: FunctionalOp, args: tuple[Any, ...], inputs: list[torch.Tensor]
    ) -> tuple[CallRecord, Any]:
        inst = self.instrumenter
        info = self._group(args[spec.group_arg] if len(args) > spec.group_arg else None)
        size = sum(t.nbytes for t in inputs)
        if spec.gathers:
            size *= info.size
        dtype = str(inputs[0].dtype).removeprefix("torch.")
        recorder = inst.recorder
        rec = recorder.enter(spec.op, info.id, size, dtype, True, now())
        start = None
        clock = inst.clock
        if clock is not None and (not inst._device_only or inputs[0].is_cuda):
            if spec.reduces and inst.check_nonfinite and size >= inst.nonfinite_min_bytes:
                recorder.device_nonfinite(inputs, rec)
            start = clock.start()
            rec.events = (start, None)
        return rec, start

    def _group(self, value: Any) -> GroupInfo:
        """The group a functional op names: by name (cached: resolving builds a new handle),
        or the ProcessGroup itself."""
        if not isinstance(value, str):
            return self.instrumenter.groups.resolve(value)
        info = self._groups.get(value)
        if info is None:
            group = c10d._resolve_process_group(value)  # type: ignore[attr-defined,arg-type]
            info = self._groups[value] = self.instrumenter.groups.resolve(group)
        return info

    def _close(self, rec: CallRecord, start: Any) -> None:
        recorder = self.instrumenter.recorder
        clock = self.instrumenter.clock
        if start is not None and clock is not None:
            rec.events = (start, clock.end_sync())  # after the wait: the stream is past it
            recorder.event_launched(rec, 0.0)
        else:
            recorder.complete(rec, now())


__all__ = ["FUNCTIONAL_OPS", "FunctionalHooks", "FunctionalOp"]
