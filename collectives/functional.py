"""Functional collectives (``torch.distributed._functional_collectives``), seen at their operators.

DTensor redistributes, tensor-parallel layers and every collective ``torch.compile`` puts in
a graph call the ``_c10d_functional`` operators (``torch.ops._c10d_functional.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ...) rather than
``torch.distributed.all_reduce``: C++ resolves the process group by name and never comes back
through Python, so the function wrappers of :mod:`collectives.wrap` cannot see them.

Each such operator gets a Python kernel at the ``Autograd`` dispatch key, which every
tensor's dispatch passes through before the real kernel, eager or compiled (inductor calls
the same operators). The kernel records the call with its process group, then redispatches
below autograd to torch's own kernel. A functional collective is asynchronous: it returns
at once and completes at ``wait_tensor`` (also given a kernel), so the record stays in flight
until its outputs are waited (on a device: until the mark recorded after that wait fires).

Not seen: calls made under ``torch.inference_mode()`` (its tensors skip the autograd keys),
and calls traced with fake tensors while compiling (not run, so rightly not recorded).
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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _compiling() -> bool:
    """Dynamo is tracing: leave the call to the graph (its run is seen, not its trace)."""
    return bool(torch.compiler.is_compiling())


class _Packet:
    """Stands in for ``torch.ops._c10d_functional.<op>`` (an ``OpOverloadPacket``): calls
    through it are recorded; every other attribute, ``.default`` included, is the packet's
    own (torch registers autograd formulas and inductor lowerings keyed by that overload)."""

    __slots__ = ("_call", "_packet")

    def __init__(self, packet: Any, call: Callable[..., Any]) -> None:
        self._packet = packet
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def _real(tensors: list[torch.Tensor]) -> bool:
    """Plain tensors with data (not fake/meta tensors of a compile-time trace)."""
    return bool(tensors) and all(type(t) in _PLAIN and not t.is_meta for t in tensors)


class FunctionalHooks:
    """The ``_c10d_functional`` kernels of one session (removed by :meth:`remove`)."""

    def __init__(self, instrumenter: Instrumenter, depth: threading.local) -> None:
        self.instrumenter = instrumenter
        self._tls = depth
        self._swapped: list[tuple[Any, str, Any]] = []
        #: data_ptr of an output not yet waited -> (its call, outputs of that call still due)
        self._pending: dict[int, tuple[CallRecord, list[int]]] = {}
        self._lock = threading.Lock()
        self._groups: dict[str, GroupInfo] = {}

    def install(self) -> None:
        namespace = torch.ops._c10d_functional
        for name, spec in FUNCTIONAL_OPS.items():
            packet = getattr(namespace, name, None)
            if packet is None:  # an older torch without this operator
                continue
            self._swap(namespace, name, packet, self._kernel(packet, spec))
        wait = namespace.wait_tensor
        self._swap(namespace, "wait_tensor", wait, self._wait_kernel(wait))

    def _swap(self, namespace: Any, name: str, packet: Any, call: Callable[..., Any]) -> None:
        setattr(namespace, name, _Packet(packet, call))
        self._swapped.append((namespace, name, packet))

    def remove(self) -> None:
        for namespace, name, packet in reversed(self._swapped):
            setattr(namespace, name, packet)
        self._swapped.clear()

    # ------------------------------------------------------------------ kernels

    def _kernel(self, overload: Any, spec: FunctionalOp) -> Callable[..., Any]:
        tls = self._tls

        def kernel(*args: Any, **kwargs: Any) -> Any:
            inputs = _tensors(args[0]) if args else []
            if getattr(tls, "depth", 0) or _compiling() or not _real(inputs):
                return overload(*args, **kwargs)
            rec, start = self._enter(spec, args, inputs)
            tls.depth = 1
            try:
                result = overload(*args, **kwargs)
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
        def kernel(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            recorder = self.instrumenter.recorder
            hit = None
            if self._pending and isinstance(tensor, torch.Tensor):
                with self._lock:
                    hit = self._pending.pop(tensor.data_ptr(), None)
            if hit is None:
                return overload(tensor, *args, **kwargs)
            rec, keys = hit
            recorder.blocked()
            t0 = now()
            try:
                result = overload(tensor, *args, **kwargs)
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
