"""Reading checkpoints back: finding the newest complete one, verifying, reading bytes.

Every byte handed to a caller has been checked against a CRC-32 of the 4 MiB chunk it came
from, so a flipped bit surfaces as :class:`CheckpointCorruptError` naming the file and the
offset instead of as a silently wrong weight. ``verify(deep=True)`` also re-hashes whole
files against the SHA-256 recorded at commit, and holds each rank's state skeleton to its
manifest as ``load`` does (:mod:`checkpoint._skeleton`).

The one write here, :meth:`CheckpointStore.set_aside_after`, belongs to resuming: a job that
resumes from an older checkpoint moves the newer step directories out of its way first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from checkpoint._commit import (
    committed_steps,
    parse_step_name,
    step_dirs,
    write_fence,
    write_latest,
)
from checkpoint._skeleton import check_skeleton
from checkpoint._validate import parse_manifest, parse_rank_manifest
from checkpoint._write import fsync_dir
from checkpoint.crc import crc32
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
)
from checkpoint.manifest import (
    ABANDONED_NAME,
    LATEST_NAME,
    MANIFEST_NAME,
    Entry,
    Manifest,
    RankManifest,
    step_dir_name,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool
    problem: str = ""


@dataclass(kw_only=True, slots=True)
class PassedOver:
    """What :meth:`CheckpointStore.open_latest` passed over on its way to the step it opened.

    Given to it by a caller that reports these itself (``checkpoint convert`` prints them on
    its output line, ``checkpoint verify`` as errors, :func:`verify_checkpoint` logs them
    and hands them back), so the store's one "newest complete step" loop serves them all
    instead of a copy of that loop each; nothing is logged by the loop then.
    """

    #: Committed steps that did not open (or, ``deep``, verify), newest first: step -> why.
    steps: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Why ``latest`` was not followed ("" when it named the newest committed step).
    latest_note: str = ""
    #: ``latest`` itself is damaged (unreadable, or garbage: the writer replaces it
    #: atomically), not merely behind or ahead of the commits; from the same one read.
    latest_damaged: bool = False

    def lines(self) -> list[str]:
        """``step N: why`` for each step passed over, newest first."""
        return [f"step {step}: {why}" for step, why in self.steps.items()]


def _check_part(path: Path, part: RankManifest, manifest: Manifest, rank: int) -> None:
    """A rank manifest must describe the part ``MANIFEST.json`` committed for ``rank``."""
    record = manifest.ranks[rank]
    for field, got, want in (
        ("step", part.step, manifest.step),
        ("rank", part.rank, rank),
        ("world_size", part.world_size, manifest.world_size),
        ("layout", part.layout, manifest.layout),
        ("data_file.size_bytes", part.data_file.size_bytes, record.size_bytes),
        ("data_file.sha256", part.data_file.sha256, record.sha256),
    ):
        if got != want:
            raise CheckpointCorruptError(
                f"{path}: field {field}: {got!r:.80}, but MANIFEST.json says {want!r:.80}"
            )


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_nofollow(path: Path, *, dir_fd: int | None = None, directory: bool = False) -> int:
    """Open ``path`` for reading without following a symbolic link in its last component,
    and only if it is a regular file (a directory with ``directory``).

    With ``dir_fd`` (an open step directory) only ``path.name`` is opened, relative to it,
    so nothing between the check and the read can swap a component for a link: a step
    directory or a file in one that is a symbolic link is a
    :class:`CheckpointCorruptError` naming it. The writer never makes links, and a link
    would let a read leave the checkpoint (``rank-00000.bin -> /etc/passwd``, a step
    directory pointing at another tree). Hard links (the object-store tier's restore
    links a node-local root's own parts) are ordinary files and open as before. The root
    itself may be a link (a mount point named by a link): only what is under it is
    checked. ``O_NONBLOCK`` keeps a FIFO planted in the directory from hanging the open.
    """
    name: str | Path = path.name if dir_fd is not None else path
    flags = _OPEN_FLAGS | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
                    target = os.readlink(name, dir_fd=dir_fd)
                    raise CheckpointCorruptError(
                        f"{path}: a symbolic link (to {target!r:.200}); checkpoint files are "
                        "read only from inside their step directory, links are refused"
                    ) from exc
        raise
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
        os.close(fd)
        what = "directory" if directory else "regular file"
        raise CheckpointCorruptError(f"{path}: not a {what}")
    return fd


def _read_all(dir_fd: int, path: Path, limit: int = 1 << 30) -> bytes:
    """The whole of ``path`` (a file of the step directory ``dir_fd``), opened by
    :func:`open_nofollow`."""
    fd = open_nofollow(path, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointCorruptError(f"{path}: {size} bytes, more than a manifest can be")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _pread(fd: int, nbytes: int, offset: int, path: Path) -> bytes:
    """``os.pread``, an I/O error (EIO from a bad sector) being damage like a CRC mismatch:
    a bare ``OSError`` was neither skipped by ``load()`` nor one line from ``checkpoint
    verify`` (a traceback); found by ``tests/checkpoint/test_damage_sweep.py``."""
    try:
        return os.pread(fd, nbytes, offset)
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{path}: unreadable at bytes {offset}..{offset + nbytes} ({exc})"
        ) from exc


class CheckpointReader:
    """One complete checkpoint, opened; rank manifests are parsed and checked on demand.

    The step directory is held open (``dir_fd``) and every file is opened relative to it
    with :func:`open_nofollow`.
    """

    def __init__(self, path: Path, manifest: Manifest, *, dir_fd: int) -> None:
        self.path = path
        self.manifest = manifest
        self._dir_fd = dir_fd
        self._ranks: dict[int, RankManifest] = {}
        self._fds: dict[int, int] = {}

    @property
    def step(self) -> int:
        return self.manifest.step

    def rank_manifest(self, rank: int) -> RankManifest:
        if rank in self._ranks:
            return self._ranks[rank]
        if not 0 <= rank < self.manifest.world_size:
            raise CheckpointNotFoundError(
                f"{self.path}: no rank {rank} (saved with world size {self.manifest.world_size})"
            )
        record = self.manifest.ranks[rank]
        path = self.path / record.manifest
        try:
            data = _read_all(self._dir_fd, path)
        except FileNotFoundError as exc:
            raise CheckpointIncompleteError(f"{path}: rank manifest missing") from exc
        except OSError as exc:
            raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
        if hashlib.sha256(data).hexdigest() != record.manifest_sha256:
            raise CheckpointCorruptError(f"{path}: SHA-256 differs from MANIFEST.json")
        part = parse_rank_manifest(path, data)
        _check_part(path, part, self.manifest, rank)
        self._ranks[rank] = part
        return part

    def entries(self, rank: int) -> list[Entry]:
        return self.rank_manifest(rank).entries

    def _fd(self, rank: int) -> int:
        if rank not in self._fds:
            part = self.rank_manifest(rank)
            path = self.path / part.data_file.name
            try:
                fd = open_nofollow(path, dir_fd=self._dir_fd)
            except FileNotFoundError as exc:
                raise CheckpointIncompleteError(f"{path}: data file missing") from exc
            except OSError as exc:
                raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
            size = os.fstat(fd).st_size
            if size != part.data_file.size_bytes:
                os.close(fd)
                raise CheckpointCorruptError(
                    f"{path}: {size} bytes on disk, manifest says {part.data_file.size_bytes}"
                )
            self._fds[rank] = fd
        return self._fds[rank]

    def read(self, rank: int, offset: int, nbytes: int, *, what: str = "") -> bytes:
        """Bytes ``[offset, offset+nbytes)`` of ``rank``'s data file, CRC-checked per chunk.

        Reads whole chunks around the range: the cost of verifying a partial read.
        """
        part = self.rank_manifest(rank)
        info = part.data_file
        if offset < 0 or offset + nbytes > info.size_bytes:
            raise CheckpointCorruptError(
                f"{self.path / info.name}: range {offset}+{nbytes} past end ({info.size_bytes})"
            )
        if nbytes == 0:
            return b""
        cb = info.chunk_bytes
        first, last = offset // cb, (offset + nbytes - 1) // cb
        start = first * cb
        end = min((last + 1) * cb, info.size_bytes)
        data = _pread(self._fd(rank), end - start, start, self.path / info.name)
        if len(data) != end - start:
            raise CheckpointCorruptError(f"{self.path / info.name}: short read at {start}")
        view = memoryview(data)
        for chunk in range(first, last + 1):
            lo = chunk * cb - start
            piece = view[lo : lo + cb]
            if crc32(piece) != info.chunk_crc32[chunk]:
                where = f" (tensor {what})" if what else ""
                raise CheckpointCorruptError(
                    f"{self.path / info.name}: CRC mismatch in bytes "
                    f"{chunk * cb}..{chunk * cb + len(piece)}{where}"
                )
        lo = offset - start
        return bytes(view[lo : lo + nbytes]) if (lo or nbytes != len(data)) else data

    def read_entry(self, rank: int, entry: Entry) -> bytes:
        return self.read(rank, entry.offset, entry.nbytes, what=entry.name)

    def verify(self, *, deep: bool = True) -> None:
        """Raise the first problem found; ``deep`` re-reads and hashes every byte, and
        holds the skeleton's tensor placeholders to the manifest as ``load`` does
        (:func:`checkpoint._skeleton.check_skeleton`, no torch), so that a step verifies
        only if ``load`` would not pass over it as damaged."""
        for rank in range(self.manifest.world_size):
            part = self.rank_manifest(rank)
            fd = self._fd(rank)
            record = self.manifest.ranks[rank]
            if record.size_bytes != part.data_file.size_bytes:
                raise CheckpointCorruptError(
                    f"{self.path / record.data_file}: size differs between manifests"
                )
            if not deep:
                continue
            info = part.data_file
            sha = hashlib.sha256()
            for chunk, expected in enumerate(info.chunk_crc32):
                data = _pread(fd, info.chunk_bytes, chunk * info.chunk_bytes, self.path / info.name)
                if crc32(data) != expected:
                    raise CheckpointCorruptError(
                        f"{self.path / info.name}: CRC mismatch in bytes "
                        f"{chunk * info.chunk_bytes}..{chunk * info.chunk_bytes + len(data)}"
                    )
                sha.update(data)
            if info.sha256 and sha.hexdigest() != info.sha256:
                raise CheckpointCorruptError(f"{self.path / info.name}: SHA-256 mismatch")
            check_skeleton(self, rank)  # what load() holds the manifest to, checked alike

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointStore:
    """A directory of checkpoints, as a reader sees it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def latest_pointer(self) -> int | None:
        """The step ``latest`` names (a hint: :meth:`resolve`); ``None`` if absent."""
        path = self.root / LATEST_NAME
        try:  # not followed if a link, and never read past 64 bytes (a FIFO, /dev/zero)
            fd = open_nofollow(path)
            try:
                raw = os.read(fd, 64)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
        name = raw.decode("ascii", "replace").strip()
        step = parse_step_name(name)
        if step is None:
            raise CheckpointCorruptError(f"{path}: bad content {name!r:.40}")
        return step

    @property
    def abandoned_root(self) -> Path:
        """Where :meth:`set_aside_after` keeps the step directories it moves."""
        return self.root / ABANDONED_NAME

    def abandoned(self) -> list[int]:
        """Steps set aside under :attr:`abandoned_root`, oldest first (never loaded)."""
        return [step for step, _ in step_dirs(self.abandoned_root)]

    def set_aside_after(self, step: int, *, run_id: str = "") -> list[int]:
        """Move every step directory newer than ``step``, complete or partial, into
        ``abandoned/``; return the moved steps, oldest first.

        Why: a job resumed from ``step`` (a rollback, a fallback past a damaged checkpoint, a
        restart after a crash mid-save) saves those step numbers again. Rank 0's commit takes
        any parseable ``rank-<r>.json`` of the step as that rank's new part, so a manifest
        left by the abandoned timeline could be committed beside the new ones; and
        ``latest`` / :meth:`candidates` would offer the abandoned (say NaN) state on the
        next restart. Moved, not deleted, to keep them for forensics; a step already under
        ``abandoned/`` is replaced by the newer copy.

        Call it before anything saves into this root (the demo job: rank 0, once the ranks
        agree on the resume step, then a barrier). ``latest`` is repointed first, to the
        newest committed step <= ``step`` (removed if there is none), so a crash part-way
        leaves a pointer that names no abandoned step; calling again finishes the move.

        ``run_id`` (the resuming run's, as given to its ``Checkpointer``) is written to the
        root's fence before anything moves: a writer of an earlier run that is still
        persisting (the writer process outlives its trainer) then stops instead of
        committing into the root or moving ``latest`` behind this run's back.
        """
        if run_id:
            self.root.mkdir(parents=True, exist_ok=True)  # a fresh start claims it too
            write_fence(self.root, run_id)
        pointer = None
        with contextlib.suppress(CheckpointCorruptError):  # not ours to repair
            pointer = self.latest_pointer()
        if pointer is not None and pointer > step:
            kept = [s for s in committed_steps(self.root) if s <= step]
            write_latest(self.root, kept[-1] if kept else None)
        newer = [(s, path) for s, path in step_dirs(self.root) if s > step]
        if not newer:
            return []
        dest = self.abandoned_root
        dest.mkdir(exist_ok=True)
        for _, path in newer:
            target = dest / path.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
            path.rename(target)
        fsync_dir(dest)
        fsync_dir(self.root)
        return [s for s, _ in newer]

    def list(self) -> list[CheckpointInfo]:
        out = []
        for step, path in step_dirs(self.root):
            problem = ""
            if not (path / MANIFEST_NAME).is_file():
                problem = "no MANIFEST.json (uncommitted)"
            out.append(CheckpointInfo(step=step, path=path, complete=not problem, problem=problem))
        return out

    def open(self, step: int) -> CheckpointReader:
        """Open checkpoint ``step``; raises if it is not committed or its manifests are bad."""
        path = self.root / step_dir_name(step)
        try:
            dir_fd = open_nofollow(path, directory=True)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint") from exc
        except OSError as exc:
            raise CheckpointCorruptError(f"{path}: unreadable ({exc})") from exc
        mpath = path / MANIFEST_NAME
        try:
            try:
                data = _read_all(dir_fd, mpath)
            except FileNotFoundError as exc:
                raise CheckpointIncompleteError(
                    f"{mpath}: missing, checkpoint was never committed"
                ) from exc
            except OSError as exc:
                raise CheckpointCorruptError(f"{mpath}: unreadable ({exc})") from exc
            manifest = parse_manifest(mpath, data)
            if manifest.step != step:
                raise CheckpointCorruptError(f"{mpath}: says step {manifest.step}")
        except BaseException:
            os.close(dir_fd)
            raise
        reader = CheckpointReader(path, manifest, dir_fd=dir_fd)
        try:
            reader.verify(deep=False)
        except CheckpointError:
            reader.close()
            raise
        return reader

    def candidates(self) -> Iterator[int]:
        """Committed steps to try, newest first (see :meth:`resolve`)."""
        yield from self.resolve()[0]

    def resolve(self) -> tuple[Sequence[int], str]:
        """Committed steps to try for "the newest checkpoint", newest first, and a note
        saying why ``latest`` was not followed ("" when it names the newest one).

        ``latest`` is a hint, not the truth: ``MANIFEST.json`` is the commit point, so a
        step committed after the pointer last moved (a crash between the two) is newer
        than the pointer; a pointer naming a missing or uncommitted step, or holding
        garbage, is reported and ignored. Whether a step *loads* is the loader's question:
        it tries these in order.
        """
        committed, note = self.resolve_quietly()
        if note:
            log.warning("%s", note)
        return committed, note

    def resolve_quietly(self) -> tuple[Sequence[int], str]:
        """:meth:`resolve` without the warning (for callers that print the note)."""
        committed, note, _ = self._resolve()
        return committed, note

    def _resolve(self) -> tuple[Sequence[int], str, bool]:
        """:meth:`resolve_quietly`, and whether ``latest`` itself is damaged (so that a
        caller classifying the note need not read the pointer again)."""
        committed = [info.step for info in reversed(self.list()) if info.complete]
        damaged = False
        try:
            pointer = self.latest_pointer()
        except CheckpointCorruptError as exc:
            note, damaged = f"{exc}; ignored", True
        else:
            if pointer is None:
                note = f"{self.root / LATEST_NAME}: missing" if committed else ""
            elif pointer not in committed:
                state = "missing" if pointer not in {i.step for i in self.list()} else "incomplete"
                note = f"{self.root / LATEST_NAME}: names step {pointer}, which is {state}"
            elif committed and pointer != committed[0]:
                note = (
                    f"{self.root / LATEST_NAME}: names step {pointer}, but step "
                    f"{committed[0]} is committed and newer"
                )
            else:
                note = ""
        return committed, note, damaged

    def open_latest(
        self, *, deep: bool = False, passed: PassedOver | None = None
    ) -> CheckpointReader:
        """The newest checkpoint that opens cleanly, skipping broken ones with a warning.

        ``deep`` also re-reads every byte against its checksums before a step is taken,
        passing over one that fails as ``load()`` does when its read hits a bad chunk (what
        :func:`verify_latest` needs). With ``passed`` the steps skipped and the note on
        ``latest`` are recorded there instead of logged, for a caller that says them itself.
        """
        steps, note, damaged = self._resolve()
        if passed is not None:
            passed.latest_note, passed.latest_damaged = note, damaged
        elif note:
            log.warning("%s", note)
        problems = []
        for step in steps:
            try:
                reader = self.open(step)
                if deep:
                    try:
                        reader.verify(deep=True)
                    except BaseException:
                        reader.close()
                        raise
                return reader
            except CheckpointError as exc:
                if passed is not None:
                    passed.steps[step] = str(exc)
                else:
                    log.warning("skipping checkpoint step %d: %s", step, exc)
                problems.append(str(exc))
        detail = "; ".join(problems) if problems else "none found"
        raise CheckpointNotFoundError(f"{self.root}: no complete checkpoint ({detail})")


def open_candidate(
    store: CheckpointStore, step: int, *, explicit: bool, skipped: list[str]
) -> CheckpointReader | None:
    """Open ``step`` for a loader choosing the newest checkpoint that loads: a step that
    fails to open for any reason (damage, never committed, gone since it was listed: say
    another process's retention removed it) is logged, appended to ``skipped`` and
    ``None`` returned, as :meth:`CheckpointStore.open_latest` passes it over. With
    ``explicit`` (the caller asked for that step) the error is raised."""
    try:
        return store.open(step)
    except CheckpointError as exc:
        if explicit:
            raise
        log.warning("skipping checkpoint step %d: %s", step, exc)
        skipped.append(str(exc))
        return None


def verify_latest(store: CheckpointStore, *, deep: bool, passed: PassedOver) -> Manifest:
    """Verify the checkpoint ``load()`` resumes from, found as it finds it: the committed
    steps newest first (``latest`` only a hint), each damaged one passed over, until one
    verifies; return its manifest. What was passed over goes into ``passed``.

    Why not :meth:`CheckpointStore.open_latest` and then a check: the question before a
    restart is "will it resume, and from where", and a newest step with a bad byte is one
    ``load()`` skips, not the answer. Raises :class:`CheckpointNotFoundError` when nothing is
    committed, :class:`CheckpointCorruptError` naming every step when none verifies.
    """
    try:
        with store.open_latest(deep=deep, passed=passed) as reader:
            return reader.manifest
    except CheckpointNotFoundError:
        if not passed.steps:
            raise CheckpointNotFoundError(f"{store.root}: no committed checkpoint") from None
        problems = "; ".join(passed.lines())
        raise CheckpointCorruptError(f"{store.root}: no checkpoint verifies ({problems})") from None


def verify_checkpoint(
    root: Path, *, step: int | None = None, deep: bool = True, skipped: list[str] | None = None
) -> int:
    """:func:`checkpoint.verify`: check ``step``, or without it what ``load()`` resumes
    from (:func:`verify_latest`, as ``checkpoint verify`` does), and return its step. The
    steps passed over are logged and appended to ``skipped`` (``step N: why``)."""
    store = CheckpointStore(root)
    if step is not None:
        with store.open(step) as reader:
            reader.verify(deep=deep)
            return reader.step
    passed = PassedOver()
    try:
        return verify_latest(store, deep=deep, passed=passed).step
    finally:  # said even when none verifies (the error names them too)
        if passed.latest_note:
            log.warning("%s", passed.latest_note)
        for line in passed.lines():
            log.warning("skipping checkpoint %s", line)
        if skipped is not None:
            skipped.extend(passed.lines())
