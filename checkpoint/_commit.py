"""Stage 4 of a save, *commit*: a crash at any instant leaves the last complete checkpoint.

Commit protocol (one checkpoint, ``W`` ranks)::

    every rank r:  rank-r.bin   stream + fsync, then rename from a temp name
                   rank-r.json  (sizes, SHA-256, chunk CRCs, tensor table) temp+fsync+rename
    rank 0:        wait until all W rank manifests exist and parse
                   MANIFEST.json  temp + fsync + rename + fsync(dir)   <- the commit point
                   latest         temp + fsync + rename + fsync(root)
                   retention: delete older checkpoints beyond keep_last, never the newest
                   complete one, and partial directories older than the new commit

A reader treats a directory without a parseable ``MANIFEST.json`` as absent, so a kill -9 at
any point leaves at most an orphan directory and ``latest`` pointing at a complete checkpoint.
A ``latest`` that cannot be moved (the rename fails after the commit) leaves the save
committed, with a warning: readers scan the committed steps and do not need it.

Runs and the fence. A writer that was given a ``run_id`` (one start of the job; all its
ranks share it) stamps it into its rank manifests, and rank 0 commits only parts of its own
run: a part left by an earlier run of the same step (a crash mid-save, a rollback) is not
taken for a peer's new one. A run that takes over the root writes its id to ``FENCE``
first; a writer of an older run that is still alive (the writer process outlives its
trainer on purpose, to persist what was in host memory) then stops before writing, and
never commits or moves ``latest`` again. The run id defaults to one derived from the
launcher's environment (:func:`default_run_id`), and a run claims the root by itself at
rank 0's restore or first save (:func:`join_fence`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from checkpoint._validate import parse_rank_manifest
from checkpoint._write import fsync_dir, write_atomic
from checkpoint.errors import (
    CheckpointIncompleteError,
    CheckpointSupersededError,
    CheckpointWriteError,
)
from checkpoint.manifest import (
    FENCE_NAME,
    LATEST_NAME,
    MANIFEST_NAME,
    DataFileInfo,
    Entry,
    Manifest,
    RankManifest,
    RankRecord,
    rank_data_name,
    rank_manifest_name,
    step_dir_name,
    to_json_bytes,
)

log = logging.getLogger(__name__)


def write_latest(root: Path, step: int | None) -> None:
    """Point ``latest`` at ``step`` atomically, or remove it (``None``); durable either way."""
    if step is None:
        (root / LATEST_NAME).unlink(missing_ok=True)
        fsync_dir(root)
    else:
        write_atomic(root / LATEST_NAME, (step_dir_name(step) + "\n").encode())


def read_fence(root: Path) -> str:
    """The run that owns ``root`` ("" when none has claimed it)."""
    try:
        return (root / FENCE_NAME).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return ""


def write_fence(root: Path, run_id: str) -> None:
    """Claim ``root`` for ``run_id``: writers of any other run stop committing here."""
    if not run_id or "\n" in run_id:
        raise ValueError(f"run_id must be a non-empty single line, got {run_id!r}")
    write_atomic(root / FENCE_NAME, (run_id + "\n").encode())


def check_fence(root: Path, run_id: str, what: str) -> None:
    """Raise :class:`CheckpointSupersededError` if another run has claimed ``root``.
    A writer without a run id, or a root nobody claimed, passes."""
    if not run_id:
        return
    owner = read_fence(root)
    if owner and owner != run_id:
        raise CheckpointSupersededError(
            f"{what}: run {owner!r} has taken over {root}; this writer (run {run_id!r}) "
            "belongs to an earlier run and stops"
        )


def check_fences(roots: tuple[Path, ...], run_id: str, what: str) -> None:
    """:func:`check_fence` on each of ``roots``: a mirror copy stops when another run has
    claimed either the mirror or the local root it copies from (see ``_persist``)."""
    for root in roots:
        check_fence(root, run_id, what)


#: What a run id derived from the launcher's environment is made of (:func:`default_run_id`,
#: and ``torchelastic-start<ns>-`` for the one a multi-node torchrun agrees on, ``_runid``).
_DERIVED = re.compile(r"^(?:trainguard-gen(\d+))?/?(?:torchelastic-(restart|start)(\d+)-(.*))?$")


def _count(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def multinode_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this is a torchrun rank with more than one agent (node): ``GROUP_WORLD_SIZE``
    above 1, or fewer local ranks than ``WORLD_SIZE`` / ``ROLE_WORLD_SIZE``. Each agent keeps
    its own restart count there, so no rank's count alone names the start."""
    if _count(env, "TORCHELASTIC_RESTART_COUNT") is None:
        return False
    groups, local = _count(env, "GROUP_WORLD_SIZE"), _count(env, "LOCAL_WORLD_SIZE")
    if groups is not None and groups > 1:
        return True
    wider = (_count(env, "WORLD_SIZE"), _count(env, "ROLE_WORLD_SIZE"))
    return local is not None and any(n is not None and n > local for n in wider)


def default_run_id(env: Mapping[str, str] | None = None) -> str:
    """The run id a ``Checkpointer`` gets when the caller gives none: one string that every
    rank of this start of the job computes alike, and that changes on every restart.

    ``TRAINGUARD_GENERATION`` (set by trainguard's launchers on every rank, incremented on
    each restart) and, on a single-agent torchrun, torchrun's ``TORCHELASTIC_RUN_ID`` +
    ``TORCHELASTIC_RESTART_COUNT``. Not torchrun's count across nodes
    (:func:`multinode_torchrun`): each node's agent keeps its own, and a node that restarts
    for a membership change does not count it, so the ranks of one start could disagree and
    fence each other out; :func:`checkpoint._runid.launcher_run_id` has rank 0 name that
    start instead. "" when none applies: no fence (a single run, or a caller's own id).
    """
    env = os.environ if env is None else env
    parts = []
    generation = env.get("TRAINGUARD_GENERATION", "").strip()
    if generation.isdigit():
        parts.append(f"trainguard-gen{int(generation)}")
    restarts = _count(env, "TORCHELASTIC_RESTART_COUNT")
    if restarts is not None and not multinode_torchrun(env):
        parts.append(f"torchelastic-restart{restarts}-{elastic_run_id(env)}")
    return "/".join(parts)


def elastic_run_id(env: Mapping[str, str]) -> str:
    """torchrun's ``TORCHELASTIC_RUN_ID``, printable and at most 128 characters."""
    return "".join(c for c in env.get("TORCHELASTIC_RUN_ID", "") if c.isprintable())[:128]


def _newer(owner: str, run_id: str) -> bool:
    """Whether ``owner`` is a later start than ``run_id``, as far as derived ids say (a
    caller's own ids are not ordered: then False)."""
    a, b = _DERIVED.match(owner), _DERIVED.match(run_id)
    if a is None or b is None or not owner or not run_id:
        return False
    if a[1] is not None and b[1] is not None and a[1] != b[1]:
        return int(a[1]) > int(b[1])
    if a[3] is not None and b[3] is not None and (a[2], a[4]) == (b[2], b[4]):
        return int(a[3]) > int(b[3])  # restart counts, or the start stamps of rank 0
    return False


def join_fence(root: Path, run_id: str, *, claim: bool, timeout_s: float, what: str) -> None:
    """This run's first part: ``claim`` (rank 0, or a rank with a root of its own) writes
    ``run_id`` to the fence; any other rank waits, up to ``timeout_s``, until the fence
    names its run, so that a fence left by the previous start never stops this one's ranks
    whose first save comes before rank 0's. A fence that names a later start (derived ids
    are ordered) stops this writer at once: it is the zombie. No collective: this runs in
    the writer, off the training thread."""
    if not run_id:
        return
    deadline = time.monotonic() + timeout_s
    while (owner := read_fence(root)) and owner != run_id and not claim:
        if _newer(owner, run_id) or time.monotonic() > deadline:
            check_fence(root, run_id, what)
        time.sleep(0.05)
    if claim and owner != run_id:
        if _newer(owner, run_id):
            check_fence(root, run_id, what)
        write_fence(root, run_id)


def claim_quietly(root: Path, run_id: str, mirror: str | Path | None = None) -> None:
    """Rank 0's restore claims the root (a zombie writer stops before this run saves),
    and the ``mirror`` tier too when there is one (a zombie on another node's disk copies
    into the same mirror, and only the mirror's fence can stop it there); a claim that
    fails (a read-only root, a later start's fence) must not fail the restore: the first
    save claims again, and says why it cannot."""
    for where in (root, *([Path(mirror)] if mirror else [])):
        try:
            if where is not root:  # the engine made the root; the mirror may not exist yet
                where.mkdir(parents=True, exist_ok=True)
            join_fence(where, run_id, claim=True, timeout_s=0.0, what=f"{where}: not claimed")
        except (OSError, CheckpointSupersededError) as exc:
            log.warning("checkpoint root %s not claimed for run %r: %s", where, run_id, exc)


def write_rank_manifest(step_dir: Path, manifest: RankManifest) -> None:
    write_atomic(step_dir / rank_manifest_name(manifest.rank), to_json_bytes(manifest))


def new_rank_manifest(
    *,
    step: int,
    rank: int,
    world_size: int,
    layout: dict[str, int],
    data_file: DataFileInfo,
    entries: list[Entry],
    run_id: str = "",
) -> RankManifest:
    return RankManifest(
        run_id=run_id,
        step=step,
        rank=rank,
        world_size=world_size,
        layout=dict(layout),
        data_file=data_file,
        entries=entries,
        created_unix_s=time.time(),
    )


def commit(
    root: Path,
    step: int,
    *,
    world_size: int,
    layout: dict[str, int],
    timeout_s: float,
    poll_s: float = 0.05,
    run_id: str = "",
    fenced_by: tuple[Path, ...] = (),
) -> Manifest:
    """Rank 0: wait for every rank's part, then write ``MANIFEST.json`` and move ``latest``.

    Waits on files rather than a collective because it runs off the training thread, where
    a collective would race the trainer's own calls on the same process group. With a
    ``run_id``, a part written by another run counts as not there yet (this run's part will
    replace it), and a fence naming another run stops the commit (module docstring), in
    ``root`` or in one of ``fenced_by`` (the mirror's commit: the local root too).
    """
    fences = (root, *fenced_by)
    step_dir = root / step_dir_name(step)
    deadline = time.monotonic() + timeout_s
    records: dict[int, RankRecord] = {}
    while len(records) < world_size:
        for rank in range(world_size):
            if rank in records:
                continue
            path = step_dir / rank_manifest_name(rank)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            part = parse_rank_manifest(path, data)
            if run_id and part.run_id != run_id:
                continue  # an earlier run's part of this step: wait for this run's
            records[rank] = rank_record(path, data, part, rank, step=step, world_size=world_size)
        if len(records) < world_size:
            # A newer run that claimed the root will never supply this run's missing
            # parts: stop now, not at the timeout (a surviving writer would otherwise hold
            # its host buffer, and its process, for the whole commit_timeout_s).
            check_fences(fences, run_id, f"{step_dir}: not committed")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(records))
                raise CheckpointIncompleteError(
                    f"{step_dir}: ranks {missing} did not finish within {timeout_s:g} s; "
                    "checkpoint left uncommitted"
                )
            time.sleep(poll_s)
    manifest = build_manifest(step, world_size, layout, records)
    check_fences(fences, run_id, f"{step_dir}: not committed")
    write_atomic(step_dir / MANIFEST_NAME, to_json_bytes(manifest))
    check_fences(fences, run_id, f"{step_dir}: committed, latest not moved")
    try:
        write_latest(root, step)
    except OSError as exc:
        # ``MANIFEST.json`` is the commit point and ``latest`` only a hint that readers
        # check against a scan of committed steps (``CheckpointStore.resolve``): the step
        # is committed and loads, so reporting the save failed would make a caller retry or
        # alarm over a checkpoint that exists. Say it once, on one line, and go on.
        why = " ".join(str(exc).split())
        log.warning(
            "%s: committed, latest not moved (%s); loaders find this step by scanning the "
            "committed steps, and the next commit moves latest",
            step_dir,
            why,
        )
    return manifest


def rank_record(
    where: Path | str, data: bytes, part: RankManifest, rank: int, *, step: int, world_size: int
) -> RankRecord:
    """``MANIFEST.json``'s entry for one rank's part (``data``: its manifest's bytes,
    ``part``: parsed); a part of another step or world size is refused."""
    if part.step != step or part.world_size != world_size:
        raise CheckpointWriteError(
            f"{where}: belongs to step {part.step} world {part.world_size}, "
            f"expected step {step} world {world_size}"
        )
    return RankRecord(
        rank=rank,
        manifest=rank_manifest_name(rank),
        manifest_sha256=hashlib.sha256(data).hexdigest(),
        data_file=part.data_file.name,
        size_bytes=part.data_file.size_bytes,
        sha256=part.data_file.sha256,
    )


def build_manifest(
    step: int, world_size: int, layout: dict[str, int], records: dict[int, RankRecord]
) -> Manifest:
    """The commit record of ``step`` from every rank's :func:`rank_record`; shared by the
    local commit and the object store's commit of node-local roots (``checkpoint._tier``)."""
    return Manifest(
        step=step,
        world_size=world_size,
        layout=dict(layout),
        ranks=[records[r] for r in range(world_size)],
        total_bytes=sum(r.size_bytes for r in records.values()),
        created_unix_s=time.time(),
    )


def committed_steps(root: Path) -> list[int]:
    """Steps whose ``MANIFEST.json`` exists (cheap; verification is the reader's job). A
    step directory that is a symbolic link is not one: readers refuse it, and retention
    must not count it among the ``keep_last`` it keeps."""
    out = []
    for step, path in step_dirs(root):
        if not path.is_symlink() and (path / MANIFEST_NAME).is_file():
            out.append(step)
    return out


def parse_step_name(name: str) -> int | None:
    """The step a directory or pointer named ``name`` holds, or ``None`` when ``name`` is
    not a checkpoint step's: the one truth for "is this a step", used wherever a step name
    is read. Only the canonical :func:`~checkpoint.manifest.step_dir_name` form counts,
    ASCII digits only: ``str.isdigit`` also takes ``'\u00b2'`` or Arabic-Indic digits (which
    ``int`` then rejects or reads as a duplicate step), and a hand-made ``step-3`` beside
    ``step-000000000002`` is a directory :meth:`CheckpointStore.open` would never find
    (it opens ``step-000000000003``)."""
    if not name.startswith("step-"):
        return None
    digits = name[5:]
    if not (digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if step_dir_name(step) == name else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step directory in ``root`` (its canonical name, see :func:`parse_step_name`),
    oldest first. A step directory that is a symbolic link is listed (readers refuse it,
    naming it); retention never goes through one. Another ``step-*`` directory is not a
    checkpoint: it is ignored, with a warning."""
    out: list[tuple[int, Path]] = []
    if not root.is_dir():
        return out
    for path in root.iterdir():
        name = path.name
        if not name.startswith("step-") or not path.is_dir():
            continue
        step = parse_step_name(name)
        if step is None:
            log.warning(
                "%s: ignored, not a checkpoint step directory (the name must be step-<12 digits>)",
                path,
            )
            continue
        out.append((step, path))
    return sorted(out)


def _linked(path: Path) -> bool:
    """A step entry that is a symbolic link: retention leaves it and its target alone (the
    target may be another job's checkpoint) and says so."""
    if path.is_symlink():
        log.warning("%s: a symbolic link, not removed by retention (its target is not ours)", path)
        return True
    return False


def apply_retention(root: Path, *, keep_last: int, newest_committed: int) -> list[int]:
    """Delete all but the ``keep_last`` newest committed checkpoints, plus partial ones
    older than ``newest_committed``. Returns the deleted steps.

    Only ever called right after a commit, so the checkpoint just committed is among those
    kept and the previous complete one is never removed before a newer one exists.
    """
    keep_last = max(1, keep_last)
    committed = [s for s in committed_steps(root) if s <= newest_committed]
    keep = set(committed[-keep_last:]) | {newest_committed}
    deleted = []
    for step, path in step_dirs(root):
        if step in keep or step > newest_committed:
            continue  # newer directories belong to saves still in flight
        if _linked(path):
            continue
        # Remove the manifest first so a crash mid-delete leaves a partial, not a "complete"
        # checkpoint with missing shards.
        with contextlib.suppress(FileNotFoundError):
            (path / MANIFEST_NAME).unlink()
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(step)
    if deleted:
        fsync_dir(root)
    return deleted


def apply_part_retention(root: Path, rank: int, *, keep_last: int, newest: int) -> list[int]:
    """Node-local roots (no local commit): delete ``rank``'s own files of the steps older
    than its ``keep_last`` newest durable parts (``newest`` among them). Only its own
    files: the other ranks of the node may still be writing their parts of an older step
    into the same directory. A directory left empty is removed; one restored whole from
    the object store loses its ``MANIFEST.json`` first (it is no longer complete).
    Returns the steps whose files were deleted."""
    keep_last = max(1, keep_last)
    mine = rank_manifest_name(rank)
    dirs = step_dirs(root)
    durable = [
        s for s, path in dirs if s <= newest and not path.is_symlink() and (path / mine).is_file()
    ]
    keep = set(durable[-keep_last:]) | {newest}
    deleted = []
    for step, path in dirs:
        if step in keep or step > newest or _linked(path):
            continue
        own = [path / mine, path / rank_data_name(rank)]
        if not any(p.exists() for p in own):
            continue
        with contextlib.suppress(FileNotFoundError):
            (path / MANIFEST_NAME).unlink()
        for p in own:
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other ranks' files still there: keep it
            path.rmdir()
        deleted.append(step)
    if deleted:
        fsync_dir(root)
    return deleted
