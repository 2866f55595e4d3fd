"""The state skeleton's tensor placeholders checked against the manifest: the one check that
``load`` and deep ``verify`` share, and a torch-free way for ``verify`` to read them.

A rank's data file holds a pickled skeleton of the training state
(:mod:`checkpoint._snapshot`) in which every tensor is a placeholder naming a manifest
entry and repeating its dtype and shape. That copy lies inside the data file, under the
chunk CRCs, while the manifest is separate JSON: a manifest edited to another dtype of the
same size or a shape of the same byte count and re-checksummed is consistent on its own,
and only the skeleton shows the tensor would load as wrong numbers. ``load`` refuses such a
step and falls back to the previous one; deep ``verify`` (and so ``trainguard checkpoint
verify`` and ``convert``, which find "the step load() resumes from" through it) must say
the same, or "is step N good" and "where will a restart resume" get answers ``load``
contradicts. So both go through :func:`find_ref` (the check and its messages),
:func:`fill` (which placeholders are reached) and :func:`load_tree` (what counts as a
skeleton at all), here and nowhere else.

Why ``verify`` reads the skeleton with :class:`_RefUnpickler` rather than the loader's
``_SkeletonUnpickler``: ``checkpoint.verify`` and ``trainguard checkpoint verify`` import no
torch today (torch is the optional ``train`` extra: an operator's host or the controller's
image may lack it, and the CLI starts fast), and the check needs none: a placeholder holds
its dtype as a string and its shape as a tuple. :class:`_RefUnpickler` resolves the
placeholder (to :class:`SkeletonRef`, defined here without torch) and the plain containers
and scalars the loader also allows (:data:`PLAIN_GLOBALS`); every other global the file
names (a torch dtype, a NumPy array, a user's type, or ``posix.system`` in a crafted file)
becomes an :class:`_Inert` that records and runs nothing. The skeleton is untrusted input,
and this way verify executes nothing the file chooses, needs no ``allowed_globals`` opt-in
and never raises :class:`~checkpoint.errors.CheckpointUntrustedError`: a global ``load``
refuses is a question of trust, not damage (``load`` raises instead of falling back), so
verify leaves it to ``load`` as before. The price: a placeholder kept inside an object of
such a type is not reached; ``load`` reaches only those in dicts, lists and tuples too
(:func:`fill`), except inside an allowed dict or list subclass, which ``capture`` never
writes (it stores mappings as plain dicts).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from checkpoint.errors import CheckpointCorruptError, CheckpointUntrustedError
from checkpoint.manifest import SKELETON_ENTRY, Entry, Manifest, RankManifest

_T = TypeVar("_T")

#: The name every skeleton's placeholders are pickled under (``_snapshot.TensorRef``).
REF_GLOBAL = "checkpoint._snapshot.TensorRef"

#: Plain-Python globals a skeleton may name, resolved for real by both unpicklers:
#: constructors of containers and scalars, which run no code of the file's choosing.
PLAIN_GLOBALS = frozenset(
    {
        *(f"builtins.{n}" for n in ("dict", "list", "tuple", "set", "frozenset", "int")),
        *(f"builtins.{n}" for n in ("float", "bool", "str", "bytes", "bytearray", "complex")),
        "builtins.slice",
        "builtins.range",
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.deque",
    }
)


@dataclass(frozen=True, slots=True)
class SkeletonRef:
    """The fields of a tensor placeholder (``_snapshot.TensorRef`` adds torch's side).

    Defined here, without torch, so that ``verify`` reads placeholders as the same fields
    ``load`` does, unpickled by the same dataclass state: a skeleton written before
    ``dtype`` and ``shape`` existed sets ``name`` alone and leaves the other slots unset,
    hence ``getattr`` with a default wherever they are read (:func:`find_ref`).
    """

    name: str
    dtype: str = ""
    shape: tuple[int, ...] | None = None


def _shape_text(shape: object) -> str:
    return str(list(shape)) if isinstance(shape, tuple | list) else f"{shape!r:.60}"


def find_ref(
    ref: SkeletonRef,
    items: Mapping[str, _T],
    spec: Callable[[_T], tuple[str, tuple[int, ...]]],
    where: str,
) -> _T:
    """The item (a tensor for ``load``, an entry for ``verify``) that placeholder ``ref``
    names, once its dtype and shape (``spec``) are the ones the skeleton recorded.

    A name the manifest lacks, or a dtype or shape (where the placeholder has them) the
    manifest contradicts, is a :class:`CheckpointCorruptError` naming ``where`` (the
    rank's data file, in its step directory) and the tensor: damage that ``load`` falls
    back past and ``verify`` reports. Fields of the wrong type (only a crafted file has
    them) are the same error, not a ``TypeError`` escaping the loader.
    """
    name = getattr(ref, "name", None)
    if not isinstance(name, str):
        raise CheckpointCorruptError(f"{where}: the state skeleton holds a tensor without a name")
    found = items.get(name)
    if found is None:
        raise CheckpointCorruptError(
            f"{where}: the skeleton names tensor {name!r:.200}, which the manifest does not list"
        )
    got_dtype, got_shape = spec(found)
    dtype, shape = getattr(ref, "dtype", ""), getattr(ref, "shape", None)
    same_shape = shape is None or (isinstance(shape, tuple | list) and tuple(shape) == got_shape)
    if (dtype and dtype != got_dtype) or not same_shape:
        raise CheckpointCorruptError(
            f"{where}: tensor {name!r:.200} is {got_dtype} {list(got_shape)} in the manifest, "
            f"but the state skeleton saved it as {dtype or got_dtype!s:.40} "
            f"{_shape_text(shape) if shape is not None else list(got_shape)}"
        )
    return found


def fill(obj: Any, resolve: Callable[[SkeletonRef], Any]) -> Any:
    """``obj`` with every placeholder inside its dicts, lists and tuples replaced by
    ``resolve(placeholder)``: which placeholders ``load`` fills and ``verify`` checks."""
    if isinstance(obj, SkeletonRef):
        return resolve(obj)
    if isinstance(obj, dict):
        return {k: fill(v, resolve) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill(v, resolve) for v in obj]
    if type(obj) is tuple:
        return tuple(fill(v, resolve) for v in obj)
    return obj


def load_tree(unpickler: pickle.Unpickler, where: str) -> dict[str, Any]:
    """The skeleton ``unpickler`` reads, which must be a dict; anything else, or bytes
    that do not unpickle, is :class:`CheckpointCorruptError`. A refused global
    (:class:`CheckpointUntrustedError`, ``load`` only) is passed on: not damage."""
    try:
        tree = unpickler.load()
    except CheckpointUntrustedError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"{where}: state skeleton does not unpickle ({exc})") from exc
    if not isinstance(tree, dict):
        raise CheckpointCorruptError(f"{where}: state skeleton is not a dict")
    return tree


class _Inert:
    """Stands for any global but the placeholder and :data:`PLAIN_GLOBALS` when ``verify``
    reads a skeleton: calling, building, filling it does nothing (see the module
    docstring). Iterating it gives nothing, so a plain container built from one is empty."""

    __slots__ = ()

    def __new__(cls, *args: object, **kwargs: object) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return _Inert()

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def append(self, item: object) -> None:
        pass

    def extend(self, items: object) -> None:
        pass


class _RefUnpickler(pickle.Unpickler):
    """Reads a skeleton for ``verify``, without torch and without running its globals."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full == REF_GLOBAL:
            return SkeletonRef
        if full in PLAIN_GLOBALS:
            return super().find_class(module, name)
        return _Inert


class _Reads(Protocol):
    """What reading an entry needs of :class:`checkpoint._store.CheckpointReader` (named
    structurally: ``_store`` imports this module)."""

    path: Path
    manifest: Manifest

    def rank_manifest(self, rank: int) -> RankManifest: ...

    def read_entry(self, rank: int, entry: Entry) -> bytes: ...


def read_entry(reader: _Reads, rank: int, entry: Entry) -> bytes:
    """The bytes of ``entry`` of ``rank``: from its own data file, or, for a replica written
    once by another rank (``stored_by``), from that rank's entry of the same name."""
    if entry.stored_by is None:
        return reader.read_entry(rank, entry)
    holder = reader.rank_manifest(entry.stored_by)
    try:
        stored = holder.entry(entry.name)
    except KeyError:
        stored = None
    if (
        stored is None
        or stored.stored_by is not None
        or ((stored.dtype, stored.shape, stored.nbytes) != (entry.dtype, entry.shape, entry.nbytes))
    ):
        raise CheckpointCorruptError(
            f"{reader.path / reader.manifest.ranks[rank].manifest}: entry {entry.name!r} is "
            f"stored by rank {entry.stored_by}, whose manifest has no matching entry"
        )
    return reader.read_entry(entry.stored_by, stored)


def _entry_spec(entry: Entry) -> tuple[str, tuple[int, ...]]:
    return entry.dtype, tuple(entry.shape)


def check_skeleton(reader: _Reads, rank: int) -> None:
    """Deep ``verify``'s skeleton check of ``rank``: read its skeleton as ``load`` reads it
    and hold every placeholder to the manifest entry it names (:func:`find_ref`), so a
    step ``load`` would refuse for it does not verify.

    A part with no skeleton entry at all is not checked: a part written by
    :func:`checkpoint._persist.persist_part` directly holds tensors only, and ``reshard``
    reads it; ``load`` needs a skeleton, the bytes are whole all the same. Entries no
    placeholder names are not damage either (``load`` ignores them too).
    """
    part = reader.rank_manifest(rank)
    skeletons = [e for e in part.entries if e.name == SKELETON_ENTRY]
    if not skeletons:
        return
    where = str(reader.path / part.data_file.name)
    data = read_entry(reader, rank, skeletons[-1])
    if not data:
        raise CheckpointCorruptError(f"{where}: no state skeleton")
    entries = {e.name: e for e in part.entries if e.name != SKELETON_ENTRY}
    tree = load_tree(_RefUnpickler(io.BytesIO(data)), where)
    fill(tree, lambda ref: find_ref(ref, entries, _entry_spec, where))
