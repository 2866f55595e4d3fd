"""What work this rank does, so detectors compare it only with ranks that do the same.

Ranks of one job are not all alike: the last pipeline stage computes the loss, MoE experts
move uneven all-to-all volumes, TP groups may differ in size. A detector that compares every
rank with every other raises false stragglers, so each step summary carries this rank's
*role* and its *peer group* (``StepSummary.role``, ``pp_stage``, ``dp_rank``, ``tp_rank``,
``group_ranks``).

Where the facts come from, strongest first:

1. ``collectives.instrument(..., role=...)`` / :func:`collectives.set_role`: the job says so.
2. A ``torch.distributed.pipelining`` stage built on this rank: its position in the pipeline
   group is ``pp_stage`` (with interleaved schedules a rank holds several stages, always at
   the same position of the pipeline group).
3. A ``DeviceMesh`` (``init_device_mesh(..., mesh_dim_names=("pp", "dp", "tp"))``): the
   coordinates on dims named ``pp``, ``dp*``/``fsdp``/``hsdp``/``replicate``/``shard`` and
   ``tp`` give the stage and the data/tensor-parallel ranks; the peer group is every rank of
   the mesh at the same ``pp`` coordinate (data- and tensor-parallel ranks of one stage do
   the same work). A job of several meshes over disjoint ranks (TP groups of two sizes, each
   its own mesh) gives each rank the ranks of its own mesh.
4. Neither: the sizes of the process groups this rank's collectives use (the world group
   and point-to-point channels aside), as ``role="pg_sizes=2,8"``. A rank in a TP group
   of 2 does other work per step than one in a TP group of 4, so ranks are compared only
   with ranks whose groups have the same sizes; where every rank's groups have the same
   sizes (plain DDP, FSDP, uniform TP x DP) they all stay peers, as before.

Meshes and stages built after ``instrument()`` are seen through a thin wrapper of their
constructors; a mesh built before it is found once, at ``instrument()`` time, among live
objects. ``group_ranks`` is empty when the peers are unknown (a pipeline without a mesh
across data-parallel replicas): detectors then group by ``role`` alone. The process-group
sizes are read at each step's end from the groups the wrapper met so far, so they settle
after the first step that used every group (a group first used later, say an evaluation
all-reduce on a subgroup, changes the role then, and the detector restarts that rank's
windows). ``instrument(role=...)`` / ``set_role(...)`` override all of it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import operator
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from trainguard.limits import INT32_MAX
from trainguard.wire import MAX_GROUP_RANKS

_PP_NAMES = frozenset({"pp", "pipe", "pipeline"})
_TP_NAMES = frozenset({"tp", "tensor"})
_DP_PREFIXES = ("dp", "fsdp", "hsdp", "ddp", "replicate", "shard")
MAX_ROLE_LEN = 128
#: Role prefix of ranks grouped by the sizes of the process groups they use.
PG_SIZES_PREFIX = "pg_sizes="
#: At most this many distinct group sizes go into the role (it must stay short).
MAX_PG_SIZES = 8


#: The module of the pipeline-stage class, watched once the job has imported it.
_STAGE_MODULE = "torch.distributed.pipelining.stage"


def _is_dp(name: str) -> bool:
    return name.startswith(_DP_PREFIXES) or name in ("data",)


class RoleTracker:
    """This rank's role fields, updated from meshes/stages as the job builds them.

    The training thread reads :attr:`fields` once per step (a dict swap, no lock needed);
    updates come from the constructors' wrappers or from :meth:`declare`.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        role: str | None = None,
        groups: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """``groups``: group id -> member ranks of every process group this rank's
        collectives used so far (the wrapper's map, ``Recorder.group_ranks``), read for
        the process-group sizes; ``None``: not derived from groups."""
        self.rank = rank
        self.world_size = world_size
        self._lock = threading.Lock()
        self._declared: dict[str, Any] = {}
        self._mesh: dict[str, Any] = {}
        self._stage_positions: set[int] = set()
        self._stage_peers: list[int] | None = None
        self._groups = groups
        self._groups_seen = 0
        self._pg_role: str | None = None
        self._fields: dict[str, Any] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        #: Whether the pipeline-stage constructor is wrapped (``watch``).
        self._stages_watched = True
        if role is not None:
            self.declare(role=role)
        else:
            self._rebuild()

    # ------------------------------------------------------------------ sources

    def declare(
        self,
        *,
        role: str | None = None,
        pp_stage: int | None = None,
        dp_rank: int | None = None,
        tp_rank: int | None = None,
        group_ranks: Sequence[int] | None = None,
    ) -> None:
        """The job's own word; it wins over anything derived."""
        if role is not None and (not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_LEN):
            from .errors import CollectivesConfigError

            raise CollectivesConfigError(
                f"role must be a non-empty string of at most {MAX_ROLE_LEN} characters, "
                f"got {role!r}"
            )
        given = {
            "role": role,
            "pp_stage": pp_stage,
            "dp_rank": dp_rank,
            "tp_rank": tp_rank,
            "group_ranks": None if group_ranks is None else _declared_ranks(group_ranks),
        }
        with self._lock:
            self._declared.update({k: v for k, v in given.items() if v is not None})
            self._rebuild()

    def see_mesh(self, mesh: Any, *, force: bool = False) -> None:
        """Derive from a DeviceMesh this rank belongs to (the root mesh of a slice).

        ``force``: the job named this mesh; later meshes no longer replace it."""
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        derived = mesh_fields(root)
        if derived is None:
            return
        with self._lock:
            # A mesh with more dims says more (a later 1-D helper mesh must not hide a 3-D one).
            if force:
                derived["_forced"] = True
            elif self._mesh.get("_forced") or len(derived["_dims"]) < len(
                self._mesh.get("_dims", ())
            ):
                return
            self._mesh = derived
            self._rebuild()

    def see_stage(self, stage: Any) -> None:
        """Derive from a pipelining stage built on this rank."""
        position = int(getattr(stage, "group_rank", stage.stage_index))
        group = getattr(stage, "group", None)
        peers: list[int] | None = None
        if group is None or dist.get_world_size(group) == self.world_size:
            peers = [self.rank]  # the pipeline spans the job: no replica does this stage's work
        with self._lock:
            self._stage_positions.add(position)
            if peers is not None:
                self._stage_peers = peers
            self._rebuild()

    def _see_groups(self) -> None:
        """The sizes of the process groups used so far, when a new group came up."""
        groups = self._groups
        if groups is None or len(groups) == self._groups_seen:
            return
        self._groups_seen = len(groups)
        self._pg_role = pg_sizes_role(list(groups.items()), self.world_size)
        with self._lock:
            self._rebuild()

    # ------------------------------------------------------------------ result

    @property
    def fields(self) -> dict[str, Any]:
        """This rank's role fields for the next step summary (read once per step: a length
        check, a dict lookup, then the cached dict)."""
        if not self._stages_watched and self._patched:
            self._watch_stages()
        self._see_groups()
        return self._fields

    def _rebuild(self) -> None:
        out: dict[str, Any] = {
            "role": None,
            "pp_stage": None,
            "dp_rank": None,
            "tp_rank": None,
            "group_ranks": [],
        }
        mesh = self._mesh
        for key in ("pp_stage", "dp_rank", "tp_rank", "group_ranks"):
            if mesh.get(key) is not None:
                out[key] = mesh[key]
        if self._stage_positions:
            out["pp_stage"] = min(self._stage_positions)
            if self._stage_peers is not None and not mesh.get("group_ranks"):
                out["group_ranks"] = list(self._stage_peers)
        # The declared fields first, the role last: a declared ``pp_stage`` (set_role(
        # pp_stage=3) with no role) must make the role as a derived one does, or every
        # stage would report one peer group and the stage slower by design be called
        # stragglers (found by the acceptance probe).
        for key, value in self._declared.items():
            out[key] = value
        if "role" not in self._declared:
            if out["pp_stage"] is not None:
                out["role"] = f"pp_stage={out['pp_stage']}"
            elif not out["group_ranks"] and self._pg_role is not None:
                out["role"] = self._pg_role
        self._fields = out

    # ------------------------------------------------------------------ auto-derivation

    def watch(self) -> None:
        """Wrap the DeviceMesh and pipeline-stage constructors; look at those built already.

        The stages are watched only once the job has imported ``torch.distributed.pipelining``
        (importing it costs each rank ~1.6 s of CPU: DTensor, dynamo, sympy): a job that has
        not cannot have built a stage, and :attr:`fields` looks again at every step, so a
        stage built after a later import is seen by the next step's summary all the same."""
        from torch.distributed.device_mesh import DeviceMesh

        self._wrap_init(DeviceMesh, self.see_mesh)
        self._stages_watched = False
        stage_base = self._stage_base()
        # One scan of the heap for both kinds: it is the costly part of instrument().
        for obj in _live((DeviceMesh,) if stage_base is None else (DeviceMesh, stage_base)):
            if isinstance(obj, DeviceMesh):
                self.see_mesh(obj)
            else:
                self.see_stage(obj)
        if stage_base is not None:
            self._watch_stages(scan=False)

    @staticmethod
    def _stage_base() -> Any:
        module = sys.modules.get(_STAGE_MODULE)
        return None if module is None else module._PipelineStageBase

    def _watch_stages(self, *, scan: bool = True) -> None:
        stage_base = self._stage_base()
        if stage_base is None:
            return
        self._stages_watched = True
        self._wrap_init(stage_base, self.see_stage)
        if scan:
            for obj in _live((stage_base,)):
                self.see_stage(obj)

    def unwatch(self) -> None:
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()
        self._stages_watched = True

    def _wrap_init(self, cls: Any, see: Callable[[Any], None]) -> None:
        original = cls.__init__

        @functools.wraps(original)
        def init(obj: Any, *args: Any, **kwargs: Any) -> None:
            original(obj, *args, **kwargs)
            with contextlib.suppress(Exception):  # never break the job's setup over a role
                see(obj)

        cls.__init__ = init
        self._patched.append((cls, "__init__", original))


def mesh_fields(mesh: Any) -> dict[str, Any] | None:
    """This rank's role fields on ``mesh`` (None when the rank is not in it)."""
    ranks = mesh.mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    names = tuple(mesh.mesh_dim_names or ())
    out: dict[str, Any] = {"_dims": names or tuple(range(ranks.ndim))}
    dp_dims: list[int] = []
    pp_dim: int | None = None
    for i, name in enumerate(names):
        low = name.lower()
        if low in _PP_NAMES:
            pp_dim = i
            out["pp_stage"] = int(coord[i])
        elif low in _TP_NAMES:
            out["tp_rank"] = int(coord[i])
        elif _is_dp(low):
            dp_dims.append(i)
    if dp_dims:
        index = 0
        for i in dp_dims:  # row-major over the data-parallel dims (replicate, shard)
            index = index * int(ranks.shape[i]) + int(coord[i])
        out["dp_rank"] = index
    peers = ranks if pp_dim is None else ranks.select(pp_dim, int(coord[pp_dim]))
    out["group_ranks"] = sorted(int(r) for r in peers.flatten().tolist())
    return out


def pg_sizes_role(groups: Any, world_size: int) -> str | None:
    """``pg_sizes=<sizes>`` from (group id, member ranks) pairs: the distinct sizes of the
    groups smaller than the world, point-to-point channels (``p2p-*``) aside; None when
    there are none (every rank then is in the world group only: plain data parallel)."""
    sizes = sorted(
        {len(members) for gid, members in groups if not gid.startswith("p2p-")} - {world_size}
    )
    if not sizes:
        return None
    return PG_SIZES_PREFIX + ",".join(map(str, sizes[:MAX_PG_SIZES]))


def _declared_ranks(ranks: Sequence[int]) -> list[int]:
    """A declared peer group as the wire carries it: distinct ranks, sorted.

    Checked here, at the job's ``set_role`` call, with a message about it: the step summary
    that carries the list is built on the training thread, where the wire's refusal of a
    negative rank or one listed twice would raise out of ``step()`` instead. A rank given
    twice is the same rank (a set was meant)."""
    from .errors import CollectivesConfigError

    out: set[int] = set()
    for given in ranks:
        try:  # numpy and 0-d tensor integers too, as int() took them before
            rank = None if isinstance(given, bool) else operator.index(given)
        except TypeError:
            rank = None
        if rank is None or not 0 <= rank <= INT32_MAX:
            raise CollectivesConfigError(
                f"group_ranks must be ranks (integers from 0 to {INT32_MAX}), got {given!r}"
            )
        out.add(rank)
    if len(out) > MAX_GROUP_RANKS:
        raise CollectivesConfigError(
            f"group_ranks lists {len(out)} ranks; at most {MAX_GROUP_RANKS}"
        )
    return sorted(out)


def _live(classes: tuple[type, ...]) -> list[Any]:
    """Instances of ``classes`` (or their subclasses) alive now: one scan of the heap.

    Matched by exact type against every subclass known now, not by ``isinstance``: torch's
    DeviceMesh has a metaclass whose ``__instancecheck__`` runs Python code, which made the
    scan of a process with 170k objects 77 ms instead of 23 ms (measured here), and a rank
    holding a large model has many more. An instance can only be of a class that exists.
    The scan is ``gc.get_referrers`` of those classes (an instance of a Python class refers
    to its class), which walks the heap in C instead of building a list of every object
    and testing each in Python: half the time again (measured here), and only the
    referrers (the instances, the classes' own dicts and subclasses) reach Python.
    """
    exact: set[type] = set()
    todo = list(classes)
    while todo:
        cls = todo.pop()
        if cls not in exact:
            exact.add(cls)
            todo.extend(cls.__subclasses__())
    return [obj for obj in gc.get_referrers(*exact) if type(obj) in exact]


__all__ = ["MAX_ROLE_LEN", "PG_SIZES_PREFIX", "RoleTracker", "mesh_fields", "pg_sizes_role"]
