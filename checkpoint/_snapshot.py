"""Turning a training state into tensors plus a pickled skeleton, and back.

``capture`` walks the state the user hands to ``save``: modules, optimizers and schedulers
(anything with ``state_dict``/``load_state_dict``), dicts, lists, tensors and plain values.
Tensors are replaced in the skeleton by :class:`TensorRef` placeholders; everything else is
pickled at once, on the training thread, because it is small and may change right after
``save`` returns (the scheduler's ``last_epoch``, the data loader position).

Parameters and optimizer state are marked *lazy*: they do not change until the optimizer
steps, so their copy can run in the background; buffers (BatchNorm statistics, which the
forward pass updates) and loose tensors are copied before ``save`` returns.

Loading treats the skeleton as untrusted input: :func:`rebuild` unpickles it with
:class:`_SkeletonUnpickler`, which resolves only the globals a training state's skeleton
holds (:data:`SAFE_GLOBALS`) plus those allowed by :func:`add_safe_globals` or by
:func:`allowing` (``load(..., allowed_globals=, trusted=)``); any other global is a
:class:`CheckpointUntrustedError` naming it, before anything of it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import pickle
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from checkpoint._skeleton import (
    PLAIN_GLOBALS,
    REF_GLOBAL,
    SkeletonRef,
    fill,
    find_ref,
    load_tree,
)
from checkpoint._validate import DTYPE_BYTES
from checkpoint.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointLayoutError,
    CheckpointUntrustedError,
)
from checkpoint.manifest import GlobalMap

RNG_KEY = "__rng__"

#: Maps (entry name, tensor) to (local tensor to store, its place in the global tensor).
#: :mod:`checkpoint.universal` provides one for DTensors and explicit sharding specs.
ShardingHook = Callable[[str, torch.Tensor], tuple[torch.Tensor, GlobalMap | None]]


@dataclass(frozen=True, slots=True)
class TensorRef(SkeletonRef):
    """Stands for the tensor stored under entry ``name`` inside the pickled skeleton.

    ``dtype`` and ``shape`` (fields of :class:`~checkpoint._skeleton.SkeletonRef`) repeat
    what the manifest entry says, inside the data file where the chunk CRCs cover them: a
    manifest edited to another dtype of the same size (float32 -> int32) or another shape
    of the same byte count, its digest re-pinned, is consistent on its own, and only this
    copy shows the tensor would load as wrong numbers (:func:`checkpoint._skeleton.find_ref`,
    which deep ``verify`` runs too). Skeletons written before these fields have neither
    (unset slots: ``getattr`` with a default), and older readers ignore them when
    unpickling. The fields live in a torch-free base so that ``verify`` can read them
    without torch; this class adds no field, and pickles under its own name
    (:data:`~checkpoint._skeleton.REF_GLOBAL`) as before, so the bytes are unchanged.
    """


@dataclass(kw_only=True, slots=True)
class CapturedTensor:
    name: str
    tensor: torch.Tensor
    lazy: bool
    global_map: GlobalMap | None = None
    #: Global ranks holding an identical copy (``ShardingSpec.replicas``); ``()``: none.
    replicas: tuple[int, ...] = ()


@dataclass(kw_only=True, slots=True)
class Captured:
    skeleton: bytes
    tensors: list[CapturedTensor] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


#: Leaf types ``walk`` returns untouched without further checks (exact types: a subclass
#: may carry state_dict and friends).
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def storage_ptr(tensor: torch.Tensor) -> int:
    """Where a tensor's bytes live; for a DTensor (FSDP2, TP) those of this rank's shard,
    since the wrapper itself has no storage."""
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if callable(to_local) else tensor
    return int(local.untyped_storage().data_ptr())


def optimizer_storages(opt: torch.optim.Optimizer) -> set[int]:
    """Storages an optimizer's ``step()`` writes: its parameters and its state tensors."""
    ptrs: set[int] = set()
    for group in opt.param_groups:
        for param in group["params"]:
            ptrs.add(storage_ptr(param))
    for per_param in opt.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                ptrs.add(storage_ptr(value))
    return ptrs


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class _Walker:
    def __init__(self, lazy_ok: bool, sharding: ShardingHook | None) -> None:
        self.lazy_ok = lazy_ok
        self.sharding = sharding
        self._names: set[str] = set()
        self.out = Captured(skeleton=b"")
        self._lazy_ptrs: set[int] = set()

    def tensor(self, name: str, value: torch.Tensor) -> TensorRef:
        if name in self._names:  # a key containing "/" can collide with a nested path
            name = f"{name}#{len(self.out.tensors)}"
        self._names.add(name)
        global_map = None
        replicas: tuple[int, ...] = ()
        if self.sharding is not None:
            find_replicas = getattr(self.sharding, "replicas", None)
            if callable(find_replicas):
                replicas = tuple(find_replicas(name, value))
            value, global_map = self.sharding(name, value)
        value = value.detach()
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            # Refused here, on the training thread: written anyway, the manifest would name a
            # dtype every reader refuses, so each save would fail late, at the commit, as
            # "corrupt" (float8_e4m3fnuz, float8_e8m0fnu, complex32, quantized types).
            raise CheckpointConfigError(
                f"save(state, step): tensor {name!r} has dtype {dtype}, which a checkpoint "
                f"cannot hold (supported: {', '.join(sorted(DTYPE_BYTES))}); convert it first"
            )
        lazy = self.lazy_ok and value.untyped_storage().data_ptr() in self._lazy_ptrs
        self.out.tensors.append(
            CapturedTensor(
                name=name, tensor=value, lazy=lazy, global_map=global_map, replicas=replicas
            )
        )
        return TensorRef(name, str(value.dtype).removeprefix("torch."), tuple(value.shape))

    def walk(self, obj: Any, name: str) -> Any:
        if type(obj) in _SCALARS:  # most leaves; Python's RNG state alone has 625 ints
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(name, obj)
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                self._lazy_ptrs.add(storage_ptr(param))
            return self.walk(dict(obj.state_dict()), name)
        if isinstance(obj, torch.optim.Optimizer):
            self.out.optimizers.append(obj)
            sd = obj.state_dict()
            for per_param in sd["state"].values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        self._lazy_ptrs.add(storage_ptr(value))
            return self.walk(sd, name)
        if _is_stateful(obj):
            return self.walk(obj.state_dict(), name)
        if isinstance(obj, Mapping):
            return {k: self.walk(v, f"{name}/{k}" if name else str(k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            if all(type(v) in _SCALARS for v in obj):
                return obj  # nothing inside to replace; pickled as it is
            items = [self.walk(v, f"{name}/{i}") for i, v in enumerate(obj)]
            return type(obj)(items) if isinstance(obj, list) or type(obj) is tuple else items
        return obj


def rng_state() -> dict[str, Any]:
    """This process's random generators: torch CPU (and CUDA), Python, and NumPy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def capture(
    state: Mapping[str, Any], *, include_rng: bool, sharding: ShardingHook | None = None
) -> Captured:
    """Split ``state`` into tensors and a pickled skeleton (see module docstring)."""
    if not isinstance(state, Mapping):
        raise CheckpointConfigError("save(state, step): state must be a mapping of name -> value")
    if RNG_KEY in state:
        raise CheckpointConfigError(f"save(state, step): the key {RNG_KEY!r} is reserved")
    has_optimizer = any(isinstance(v, torch.optim.Optimizer) for v in state.values())
    walker = _Walker(lazy_ok=has_optimizer, sharding=sharding)
    # Modules and optimizers first, so their storages are known before loose tensors.
    owners = torch.nn.Module | torch.optim.Optimizer
    order = sorted(state, key=lambda k: not isinstance(state[k], owners))
    tree = {str(key): walker.walk(state[key], str(key)) for key in order}
    if include_rng:
        walker.sharding = None  # RNG states are per rank, never part of a global tensor
        tree[RNG_KEY] = walker.walk(rng_state(), RNG_KEY)
    buf = io.BytesIO()
    pickle.dump(tree, buf, protocol=pickle.HIGHEST_PROTOCOL)
    walker.out.skeleton = buf.getvalue()
    return walker.out


#: Globals a skeleton may name without an opt-in: what ``capture`` of a training state
#: pickles (containers, scalars, TensorRef, NumPy's RNG state, torch dtypes and sizes).
SAFE_GLOBALS = frozenset(
    {
        *PLAIN_GLOBALS,
        REF_GLOBAL,
        "torch.Size",
        "torch.device",
        # NumPy arrays, dtypes and scalars (np.random.get_state(), a NumPy loss value).
        *(f"numpy.{n}" for n in ("dtype", "ndarray")),
        *(
            f"numpy.{core}.{fn}"
            for core in ("core.multiarray", "_core.multiarray")
            for fn in ("_reconstruct", "scalar")
        ),
        *(f"numpy.{core}.numeric._frombuffer" for core in ("core", "_core")),
    }
)

_EXTRA_GLOBALS: set[str] = set()
#: Per ``load`` call: extra allowed globals, or ``None`` for a trusted checkpoint.
_CALL_GLOBALS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "checkpoint_allowed_globals", default=frozenset()
)


def _global_name(item: str | type | Callable[..., Any]) -> str:
    if isinstance(item, str):
        if "." not in item.strip("."):
            raise CheckpointConfigError(f"allowed global {item!r}: expected 'module.name'")
        return item
    module, name = getattr(item, "__module__", None), getattr(item, "__qualname__", None)
    if not module or not name:
        raise CheckpointConfigError(f"allowed global {item!r}: has no module and name")
    return f"{module}.{name}"


def add_safe_globals(items: Iterable[str | type | Callable[..., Any]]) -> None:
    """Allow these classes or functions (or ``"module.name"`` strings) in every skeleton
    this process loads, as :func:`torch.serialization.add_safe_globals` does for
    ``torch.load``: your own dataclass stored in the training state, for instance."""
    _EXTRA_GLOBALS.update(_global_name(item) for item in items)


@contextlib.contextmanager
def allowing(
    items: Iterable[str | type | Callable[..., Any]] = (), *, trusted: bool = False
) -> Iterator[None]:
    """Within the block, also allow ``items``; with ``trusted``, any global (plain pickle:
    only for checkpoints you wrote yourself)."""
    allowed = None if trusted else frozenset(_global_name(item) for item in items)
    token = _CALL_GLOBALS.set(allowed)
    try:
        yield
    finally:
        _CALL_GLOBALS.reset(token)


def _torch_global(module: str, name: str) -> bool:
    """``torch.float32`` and friends (a dtype pickles as the attribute of that name)."""
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where
        self.extra = _CALL_GLOBALS.get()

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if (
            self.extra is None
            or full in SAFE_GLOBALS
            or full in _EXTRA_GLOBALS
            or full in self.extra
            or _torch_global(module, name)
        ):
            return super().find_class(module, name)
        raise CheckpointUntrustedError(
            f"{self.where}: the state skeleton names {full!r}, which a checkpoint may not "
            "load by default (untrusted input); if you trust it, allow it with "
            f"load(..., allowed_globals=[{full!r}]) or checkpoint.add_safe_globals([...])"
        )


def _tensor_spec(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """A tensor's dtype and shape as a skeleton placeholder records them."""
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def rebuild(skeleton: bytes, tensors: Mapping[str, torch.Tensor], *, where: str) -> dict[str, Any]:
    """The saved state: the skeleton unpickled (restricted, see the module docstring) with
    its tensors filled in, each held to the placeholder that names it
    (:func:`checkpoint._skeleton.find_ref`: the check deep ``verify`` runs too). A refused
    global is :class:`CheckpointUntrustedError`, not damage: an older step of the same
    job holds the same types."""
    tree = load_tree(_SkeletonUnpickler(skeleton, where), where)
    return fill(tree, lambda ref: find_ref(ref, tensors, _tensor_spec, where))  # type: ignore[no-any-return]


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _misfit(value: Any, target: Any) -> str:
    """Why ``value`` cannot load into ``target`` (a module's keys and shapes, an
    optimizer's groups), or "" if no such cheap check finds a reason."""
    if isinstance(target, torch.nn.Module) and isinstance(value, Mapping):
        have = target.state_dict()
        missing = sorted(set(have) - set(value))
        unexpected = sorted(set(value) - set(have))
        shapes = [
            f"{k} {list(value[k].shape)} vs {list(have[k].shape)}"
            for k in have
            if k in value
            and isinstance(value[k], torch.Tensor)
            and isinstance(have[k], torch.Tensor)
            and not hasattr(have[k], "to_local")  # a DTensor: global vs local shape
            and value[k].shape != have[k].shape
        ]
        parts = [
            f"{what}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
            for what, keys in (
                ("missing keys", missing),
                ("unexpected keys", unexpected),
                ("size mismatch (saved vs target)", shapes),
            )
            if keys
        ]
        return "; ".join(parts)
    if isinstance(target, torch.optim.Optimizer) and isinstance(value, Mapping):
        groups = value.get("param_groups")
        if not isinstance(groups, list):
            return "no param_groups"
        saved = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
        counts = [len(g["params"]) for g in target.param_groups]
        if saved != counts:
            return f"parameters per group: saved {saved}, target {counts}"
    return ""


def apply(
    loaded: Mapping[str, Any], targets: Mapping[str, Any], *, restore_rng: bool, where: str = ""
) -> dict[str, Any]:
    """Load ``loaded`` into the stateful objects of ``targets``; return the plain values.

    A saved state that does not fit its target (another model's shapes, a key the module
    lacks, another number of optimizer parameters) is a :class:`CheckpointLayoutError`
    naming the keys, on one line. Modules and optimizers are checked for that before any
    is loaded; a misfit only ``load_state_dict`` itself finds (a custom object's) leaves
    the objects before it in ``loaded`` restored.
    """
    for key, value in loaded.items():
        target = targets.get(key)
        if key != RNG_KEY and target is not None and _is_stateful(target):
            why = _misfit(value, target)
            if why:
                raise CheckpointLayoutError(
                    f"{where}: state {key!r} does not fit its target ({why})"
                )
    plain: dict[str, Any] = {}
    for key, value in loaded.items():
        if key == RNG_KEY:
            continue
        target = targets.get(key)
        if target is not None and _is_stateful(target):
            try:
                target.load_state_dict(value)
            except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
                raise CheckpointLayoutError(
                    f"{where}: state {key!r} does not fit its target ({type(exc).__name__}: "
                    f"{_one_line(str(exc))})"
                ) from exc
        else:
            plain[key] = value
    if restore_rng and RNG_KEY in loaded:
        try:
            set_rng_state(loaded[RNG_KEY])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise CheckpointCorruptError(
                f"{where}: RNG state does not restore ({_one_line(str(exc))})"
            ) from exc
    return plain
