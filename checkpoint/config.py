"""The engine's configuration (one ``@dataclass``; every field says its unit and why)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from checkpoint.errors import CheckpointConfigError
from checkpoint.manifest import DEFAULT_CHUNK_BYTES


@dataclass(kw_only=True, slots=True)
class ObjectStoreConfig:
    """The object-storage tier: an S3-compatible bucket that committed checkpoints are
    uploaded to in the background (see docs/checkpoint.md, "Tiered storage").

    Credentials are never configured here: boto3's default chain finds them (the
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` environment,
    ``AWS_PROFILE`` or ``profile``, ``~/.aws/credentials``, web identity / IRSA, instance
    metadata), so no secret sits in a config file or a log line."""

    bucket: str
    """Bucket name; it must exist (creating buckets is an operator's decision)."""

    prefix: str = ""
    """Key prefix under which ``step-*/`` objects go, e.g. ``jobs/llama-7b``."""

    endpoint_url: str | None = None
    """A non-AWS S3-compatible endpoint (MinIO, Ceph RGW, a local test server); None: AWS."""

    region: str | None = None
    """Region; None: the default chain's (``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / profile)."""

    profile: str | None = None
    """A named profile of ``~/.aws/config``; None: the default chain picks."""

    part_bytes: int = 64 << 20
    """Multipart part size in bytes. Files larger than this upload as parts, in parallel and
    resumable part by part. AWS S3 refuses parts under 5 MiB except the last."""

    max_concurrency: int = 4
    """Parts uploaded (and downloaded) at once."""

    keep_last: int = 3
    """Complete checkpoints kept in the bucket (the local tier has its own ``keep_last``)."""

    peer_timeout_s: float = 300.0
    """Every rank uploads its own files; rank 0 uploads ``MANIFEST.json`` and the remote
    commit record only once every other rank's files are in the bucket, waiting up to this
    long (off the training thread) before it gives the step up as failed."""

    def validate(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise CheckpointConfigError(f"object_store.bucket: bad bucket name {self.bucket!r}")
        if self.part_bytes < 4096:
            raise CheckpointConfigError("object_store.part_bytes must be >= 4096")
        if self.max_concurrency < 1:
            raise CheckpointConfigError("object_store.max_concurrency must be >= 1")
        if self.keep_last < 1:
            raise CheckpointConfigError(
                f"object_store.keep_last must be >= 1, got {self.keep_last}"
            )
        if not self.peer_timeout_s > 0:
            raise CheckpointConfigError("object_store.peer_timeout_s must be > 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    root: str | Path
    """Directory holding ``step-*`` checkpoints and the ``latest`` pointer; shared by all
    ranks (every rank writes its own files, rank 0 commits), unless ``shared_root`` is
    False (each node's own disk)."""

    shared_root: bool = True
    """Whether every rank sees the same ``root`` (one node, or a shared file system): then
    rank 0 commits the step there. ``False``: node-local roots (each node's own disk, one
    root per node or per rank); no rank sees all parts, so there is no local commit. Each
    rank's part is durable on its node, every rank uploads its own files, and the commit
    point is the object store's (rank 0 builds ``MANIFEST.json`` from the ranks' manifests
    in the bucket, then ``TIER.json``; its ``committed`` event says ``tier=object_store``).
    Needs ``object_store``. Local retention keeps each rank's own files of its
    ``keep_last`` newest durable steps; a restore fetches what the node lacks."""

    mirror_root: str | Path | None = None
    """Optional second tier (a persistent/shared path): after each local commit, every rank
    copies its files there and rank 0 commits there too, with the same retention. ``root``
    can then be fast local storage."""

    object_store: ObjectStoreConfig | None = None
    """Third tier: after rank 0 commits locally, the checkpoint is uploaded to this bucket
    by a background thread (never in the training thread's way); restores fall back to it
    when no good local copy exists. Needs the ``s3`` extra (boto3)."""

    keep_last: int = 3
    """Complete checkpoints kept. At least 1; the newest complete one is never deleted
    before a newer one has committed."""

    writer: Literal["process", "thread"] = "process"
    """Where bytes are written. ``process`` (default, chosen by measurement on a 2-core
    host: durable as fast or faster than ``thread``, equal blocking, every-step overhead
    within the noise) keeps checksumming and syscalls off the trainer's GIL and still
    persists a snapshot already in host memory if the trainer is killed; ``thread`` avoids
    the extra process (see docs/checkpoint.md for the numbers)."""

    num_buffers: int = 1
    """Host buffers (each as large as one rank's state). With 1, a save waits for the
    previous one to be written; 2 lets a save overlap the previous write at 2x host memory."""

    when_busy: Literal["skip", "coalesce", "wait"] = "skip"
    """What a save does when the previous one is still being staged or written, so that
    training never waits on storage. ``skip`` (default): the new save is not taken
    (``save`` returns False, :attr:`Checkpointer.saves_skipped` counts it); the one in
    flight still completes, so at most one interval of progress is at risk. ``coalesce``:
    the new save is staged into a second host buffer and held back until the one in flight
    is written; a newer save replaces a held one (:attr:`Checkpointer.saves_coalesced`),
    so the newest state is what gets written next. Needs ``num_buffers >= 2``. ``wait``:
    every save is taken and queued, and ``save`` blocks for a free host buffer (the
    behaviour before this option). ``save(..., required=True)`` always waits."""

    dedup_replicas: bool = True
    """Write each tensor that data-parallel replicas share once, by one of them (balanced by
    bytes), instead of once per replica: bytes per save fall by the DP size. Needs a
    ``sharding`` that says who holds copies (``ShardingSpec.replicas``: DTensor placements,
    or the ``ParallelLayout``'s DP peers); the manifests still let every rank load."""

    sha256: bool = False
    """Also record a SHA-256 per data file. CRC-32 per 4 MiB chunk is always kept and catches
    media and transfer damage; SHA-256 costs ~0.6 s of CPU per GB on the writer (measured
    1.7 GB/s here vs 5 GB/s for CRC-32), so it is opt-in for those who want a digest."""

    include_rng: bool = True
    """Save and restore torch/CUDA/Python/NumPy RNG states so continuation is bit-exact."""

    commit_timeout_s: float = 600.0
    """How long rank 0 waits for the other ranks' parts before leaving the step uncommitted."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """CRC granularity in bytes; also the read granularity of resharding loads."""

    copy_slice_bytes: int = 8 << 20
    """Copier progress granularity in bytes: the writer may start on a tensor once this much
    more has been copied."""

    hash_threads: int = 2
    """Threads computing the per-chunk CRC-32s beside the writes. The system zlib hashes
    ~1 GB/s per core, slower than a fast disk, so one thread would cap throughput."""

    direct_io: bool = True
    """Write the data file with ``O_DIRECT`` from the host buffer (no copy into the page
    cache: less CPU per byte, no cache pollution); file systems that refuse it (tmpfs) get
    ordinary writes automatically."""

    writer_nice: int = 0
    """Nice increment for the writer (its process, or its threads), so that the training
    threads preempt its checksumming and syscalls. Off by default: on the 2-core test host
    10 and 19 made no difference beyond the noise to the every-step overhead."""

    writer_cpus: tuple[int, ...] = ()
    """CPUs (Linux ``sched_setaffinity``) for everything a save runs beside training: the
    copier thread, the writer process (all its threads) or writer thread, and the thread
    that reads the writer's replies. Set it to the host cores training does not use (on a
    GPU node, those the data loader and launcher leave free) so that the save's CPU work
    never preempts a training thread. Empty (default): no pinning, the scheduler decides.
    The training threads are the caller's to pin."""

    def validate(self) -> None:
        if self.writer_cpus:
            # Against the machine's CPUs, not the calling thread's mask: the caller may
            # already have pinned its training thread elsewhere.
            count = os.cpu_count() or 1
            bad = [c for c in self.writer_cpus if type(c) is not int or not 0 <= c < count]
            if bad:
                raise CheckpointConfigError(
                    f"writer_cpus {bad} not CPUs of this host (0..{count - 1})"
                )
        if self.keep_last < 1:
            raise CheckpointConfigError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.writer not in ("process", "thread"):
            raise CheckpointConfigError(
                f"writer must be 'process' or 'thread', got {self.writer!r}"
            )
        if self.num_buffers < 1:
            raise CheckpointConfigError(f"num_buffers must be >= 1, got {self.num_buffers}")
        if self.when_busy not in ("skip", "coalesce", "wait"):
            raise CheckpointConfigError(
                f"when_busy must be 'skip', 'coalesce' or 'wait', got {self.when_busy!r}"
            )
        if self.when_busy == "coalesce" and self.num_buffers < 2:
            raise CheckpointConfigError(
                "when_busy='coalesce' needs num_buffers >= 2 (one buffer being written, one "
                "holding the newest save)"
            )
        if self.commit_timeout_s <= 0:
            raise CheckpointConfigError("commit_timeout_s must be > 0")
        if not 0 <= self.writer_nice <= 19:
            raise CheckpointConfigError(f"writer_nice must be 0..19, got {self.writer_nice}")
        if self.hash_threads < 1:
            raise CheckpointConfigError(f"hash_threads must be >= 1, got {self.hash_threads}")
        if self.chunk_bytes < 4096:
            raise CheckpointConfigError("chunk_bytes must be >= 4096")
        if self.object_store is not None:
            self.object_store.validate()
        elif not self.shared_root:
            raise CheckpointConfigError(
                "shared_root=False (node-local roots) needs object_store: the bucket is "
                "where the ranks' parts meet and the step is committed"
            )
