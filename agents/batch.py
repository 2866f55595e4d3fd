"""What the next report will carry, journaled so a killed agent loses none of it.

Samples, job records and command acks accumulate here between reports. Each item is also
appended as one JSON line to ``journal/pending-<seq>.jsonl`` (``seq`` = the report it will
go into) and flushed to the kernel, so ``kill -9`` loses nothing; there is no fsync per
line (a power cut may lose up to one report interval, in exchange for no disk flush per
sample). When report ``seq`` is durably spooled the journal file is deleted; at start any
journal whose seq is already spooled is deleted and the rest is replayed, so an item lands
in exactly one report. A torn last line (the process died mid-write) is skipped. A journal
entry that cannot be read at all (a directory or a FIFO in its place, EIO, no permission) is
moved to the spool's ``quarantine/``, as torn reports and state files are, and the start goes
on: a damaged journal must not put the agent in a crash loop (or block it on a FIFO). Where
the journal cannot be written, items are kept in memory only (a crash would lose them), with
an error in the log.

Job records are bounded by item counts (half the wire's ``max_length``) and by serialized
bytes (:data:`MAX_RECORD_BYTES`, 3/4 of ``wire.MAX_REPORT_BYTES``), so a report always
validates and fits; past :data:`FLUSH_HINT_BYTES` the batch asks the daemon to report early.

XID events in the samples have a budget of their own (an XID storm on a 64-GPU node is
thousands of events a second): :meth:`Batch.xid_limit` tells the sampler how many events
per GPU the next sample may list so that the report's XIDs stay near
:data:`XID_BUDGET_BYTES`, and past :data:`MAX_XID_BYTES` a sample keeps only the newest
event of each code per GPU (the one whose ``detail`` carries the count), then none (logged
and counted in ``dropped_xids_total``).

Hardware events (link flaps, PCIe, NIC and bond events) have one as well,
:data:`MAX_EVENT_BYTES`: past it a storm is folded to each subject's newest event, with a
count, losses of a GPU or NIC always kept (:func:`fold_events`). Every byte budget follows the
report's cap (a spool smaller than the wire's 4 MiB scales them all down).

Samples have a byte budget too: a 64-GPU node's sample is about 64 KB (a 256-port NIC
sample adds up to 256 KB), so 300 of them (``report_interval_s=300``, ``sample_interval_s=1``)
would be 19 MB, far past the wire's cap, and the controller would refuse the report whole.
Everything the batch holds (samples with their XIDs, job records, acks) is measured as the
report serializes it and kept within :data:`REPORT_BUDGET_FRACTION` of the report's cap
(the rest is for the node's identity). Past :data:`SAMPLE_FLUSH_FRACTION` of the cap in
samples, :meth:`Batch.add_sample` asks for an early report; when the report still cannot go
(the spool failing, the journal replayed after a long outage) older samples are *thinned
evenly* (every second one, then every fourth, ...), never the oldest nor the newest, their
XID and hardware events carried into the next sample kept; counted in
``thinned_samples_total``, logged once. The wire's item cap (:data:`MAX_SAMPLES`) thins the
same way.

The per-part budgets add up to more than the contents' budget (records 3/4, XIDs 1/8, events
1/16, acks 1/16, and the newest sample), so they share it: after every add
(:meth:`Batch._fit`) the contents are brought within ``budget_bytes`` by giving up, in this
order, what the controller needs least to act: (1) older samples, thinned evenly as above;
(2) job records, the kinds of :data:`_BUDGET_ORDER` from its end (Flight Recorder dumps,
inflight collectives, probes, steps, then peer groups, checkpoints, rank events), the newest
of a kind first; (3) only then, in the one sample left, hardware events other than losses
(:data:`KEEP_EVENT_KINDS`), then XIDs but the newest of each code per GPU, then its XIDs.
Never given up: that sample's gauges and losses, and the command acks (bounded by
:data:`ACK_BUDGET_FRACTION`). Each is counted where it always was (records, thinned samples,
XIDs, hardware events). So the contents exceed ``budget_bytes`` only if one sample with its
losses and the acks do alone, which :func:`min_report_cap_bytes` (the agent's start check)
rules out: the report fits its cap in the worst case, every part full at once. Before, each
part was held to its own budget only: a 64-GPU, 256-port node in a storm (records, XIDs and
events each at their budget) made a report of 4.28 MB (6.5 MB with 2,048 acks of a long
reason), past the 4 MiB cap, refused whole by the controller; now 3.9 MB.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from annotated_types import MaxLen
from pydantic import BaseModel, ValidationError

from agents.atomic import write_atomic
from trainguard import wire
from trainguard.wire import (
    CommandAck,
    GpuSample,
    HardwareEvent,
    JobRecords,
    NodeSample,
    Report,
    XidEvent,
)

log = logging.getLogger(__name__)


def wire_cap(model: type[BaseModel], name: str) -> int:
    """The wire's ``max_length`` of ``model.name``: the one place every cap comes from."""
    caps = [m.max_length for m in model.model_fields[name].metadata if isinstance(m, MaxLen)]
    if not caps:
        raise TypeError(f"{model.__name__}.{name} has no max_length on the wire")
    return min(caps)


#: Item caps per report: half of the wire limits, so a report always validates (derived from
#: the wire models: a hand-copied number once let 2,048 traces into a report whose wire limit
#: is 1,024, and the controller rejected the whole report, samples and all).
_RECORD_CAPS = {name: wire_cap(JobRecords, name) // 2 for name in JobRecords.model_fields}
MAX_STEPS = _RECORD_CAPS["steps"]
MAX_SAMPLES = wire_cap(Report, "samples")
MAX_ACKS = wire_cap(Report, "command_acks") // 2
_MAX_XIDS_PER_GPU = wire_cap(GpuSample, "xid_events")
_MAX_EVENTS = wire_cap(NodeSample, "events")
#: Serialized job-record bytes past which the daemon is asked to report at once.
FLUSH_HINT_BYTES = wire.MAX_REPORT_BYTES // 4
#: Job-record bytes (as the report serializes them) one report carries at most: three
#: quarters of the controller's body limit (10,000 step summaries fit), the rest left for the
#: samples, acks and node info. Records past it are dropped and counted, so job records can
#: never make the controller refuse a report and lose the node's samples with it.
MAX_RECORD_BYTES = wire.MAX_REPORT_BYTES * 3 // 4
#: Largest single Flight Recorder dump the endpoint takes (``ok=false`` past it).
MAX_TRACE_BYTES = wire.MAX_REPORT_BYTES // 4
#: XID event bytes a report aims at: the watcher's drains are sized to what is left of it.
XID_BUDGET_BYTES = wire.MAX_REPORT_BYTES // 16
#: XID event bytes a report never passes (records 3/4, XIDs 1/8: the rest of the samples,
#: the acks and the node's identity keep the other 1/8).
MAX_XID_BYTES = wire.MAX_REPORT_BYTES // 8
#: Bytes of one XID event in a report, about (with a count in its detail), to size drains.
XID_EVENT_BYTES = 160
#: Events per GPU a sample may always list, budget or not: room for the codes of a storm.
MIN_XIDS_PER_GPU = 8
#: Share of the report cap that the batch's contents (samples, XIDs, records, acks) may use:
#: the other 1/8 (512 KiB) is the node's identity (64 GPUs, 256 NICs with their GPU
#: affinity: about 240 KB) and the report's envelope.
REPORT_BUDGET_FRACTION = 7 / 8
#: Share of the report cap that command acks may use (256 KiB at the wire's cap: 2,000 acks
#: of a short reason). Past it an ack waits for no report: it is dropped, logged, and the
#: controller sends the command again until an ack comes. Without it 2,048 acks of a long
#: reason (2.4 MB) fit no report whatever else gave way.
ACK_BUDGET_FRACTION = 1 / 16
#: Sample bytes (share of the cap) past which the batch asks for a report at once: a 64-GPU
#: node then reports every ~16 samples, whatever report_interval_s says.
SAMPLE_FLUSH_FRACTION = 1 / 4
#: Hardware-event bytes (link flaps, PCIe, NIC and bond events) one report carries at most,
#: at the wire's cap: 256 KiB, about 2,000 events. A storm past it is folded (see
#: :func:`fold_events`), so neither a flapping link nor 256 ports of rising counters can
#: push the report past the cap or a GPU's loss out of it.
MAX_EVENT_BYTES = wire.MAX_REPORT_BYTES // 16
#: Event kinds kept whatever the budget (after folding, at most one per GPU or NIC each):
#: the hardware is gone, not flapping, and the controller acts on it.
KEEP_EVENT_KINDS = frozenset({"gpu_unreachable", "gpu_unknown", "nic_gone", "nic_back"})


def _event_key(event: HardwareEvent) -> tuple[object, ...]:
    """What an event is about: a bond event names its member in ``detail`` only."""
    member = event.detail if event.kind.startswith("bond_") else ""
    return (event.kind, event.gpu_index, event.device, event.port, event.counter, member)


def _newest_of_each_code(events: list[XidEvent]) -> list[XidEvent]:
    """One GPU's XIDs cut to the newest of each code, in their order: the one whose
    ``detail`` carries its code's count, and every code seen still named."""
    newest = {e.code: e for e in events}  # the last of each code wins
    return [e for e in events if newest[e.code] is e]


def _no_xids(events: list[XidEvent]) -> list[XidEvent]:
    return []


def fold_events(
    events: list[HardwareEvent], *, max_count: int, max_bytes: int | None = None
) -> list[HardwareEvent]:
    """``events`` within ``max_count`` events and ``max_bytes`` report bytes, in their order.

    As they are when they fit. Else each subject's (kind, GPU, device, port, counter) newest
    event stands for all of its kind, its ``detail`` saying how many it stands for (a link
    that flapped 500 times is one ``nvlink_down`` and one ``nvlink_up``); then the kinds in
    :data:`KEEP_EVENT_KINDS` are kept, and of the rest the newest while they fit. Cutting the
    list's tail instead (as before) let a storm listed after a GPU's loss push the loss out.
    """
    return _fold(events, max_count, max_bytes)[0]


def _fold(
    events: list[HardwareEvent], max_count: int, max_bytes: int | None
) -> tuple[list[HardwareEvent], int]:
    """:func:`fold_events`, and the report bytes of what it kept (0 where ``max_bytes`` is
    None and nothing was folded: not measured). Each event is serialized once here, and the
    budget's caller reads the total instead of serializing them all again."""
    if max_bytes is None:
        if len(events) <= max_count:
            return events, 0
    else:
        total = sum(report_size(e) + 1 for e in events)
        if len(events) <= max_count and total <= max_bytes:
            return events, total
    counts: dict[tuple[object, ...], int] = {}
    newest: dict[tuple[object, ...], int] = {}
    for i, event in enumerate(events):
        key = _event_key(event)
        counts[key] = counts.get(key, 0) + 1
        newest[key] = i
    folded: list[tuple[int, HardwareEvent]] = []
    for key, i in sorted(newest.items(), key=lambda kv: kv[1]):
        event, n = events[i], counts[key]
        if n > 1:
            note = f" (x{n}: {n - 1} earlier like it not listed)"
            event = event.model_copy(update={"detail": event.detail[: 512 - len(note)] + note})
        folded.append((i, event))
    keep = [(i, e, report_size(e) + 1) for i, e in folded if e.kind in KEEP_EVENT_KINDS]
    room = (max_bytes if max_bytes is not None else 1 << 62) - sum(n for _, _, n in keep)
    for i, event in reversed([(i, e) for i, e in folded if e.kind not in KEEP_EVENT_KINDS]):
        size = report_size(event) + 1
        if len(keep) >= max_count or size > room:
            break
        keep.append((i, event, size))
        room -= size
    kept = sorted(keep, key=lambda ien: ien[0])[:max_count]
    return [e for _, e, _ in kept], sum(n for _, _, n in kept)


#: Bytes of one GPU's part of a sample at most, about (64 KB for a 64-GPU node, measured),
#: and of one RDMA port's (256 ports add 60-260 KB): to size one report before any sample.
SAMPLE_BYTES_PER_GPU = 1_024
SAMPLE_BYTES_PER_PORT = 1_024
#: A report's envelope and a sample's own fields, about.
_ENVELOPE_BYTES = 1_024


def min_report_cap_bytes(identity_bytes: int, *, gpus: int, ports: int) -> int:
    """The smallest report cap (``spool_max_bytes``) under which this node's reports fit:
    the identity within the cap's last 1/8 and one whole sample, with the acks' share
    beside it, within the batch's 7/8 (thinning never goes below one sample, and neither its
    gauges nor the acks are given up for the shared budget). Below it every report would be
    set aside as larger than the spool: all data lost, only a counter saying so."""
    sample = _ENVELOPE_BYTES + gpus * SAMPLE_BYTES_PER_GPU + ports * SAMPLE_BYTES_PER_PORT
    need_identity = int((identity_bytes + _ENVELOPE_BYTES) / (1 - REPORT_BUDGET_FRACTION))
    share = REPORT_BUDGET_FRACTION - ACK_BUDGET_FRACTION
    return max(need_identity, int(sample / share) + 1)


#: Kinds kept first when the byte budget runs short: small, and what the controller acts on.
_LAST = ("steps", "probes", "inflight", "traces")
_BUDGET_ORDER = [n for n in JobRecords.model_fields if n not in _LAST] + [
    n for n in _LAST if n in JobRecords.model_fields
]


def report_size(model: BaseModel) -> int:
    """Bytes ``model`` takes in a report (agents.spool serializes with ``exclude_none``)."""
    return len(model.model_dump_json(exclude_none=True))


#: The brackets and field names of an empty JobRecords: one per report, not per frame.
_EMPTY_RECORDS_BYTES = report_size(JobRecords())


def _not_a_file(path: Path) -> bool:
    """Something is at ``path`` and it is not a regular file (links followed)."""
    try:
        return (path.exists() or path.is_symlink()) and not path.is_file()
    except OSError:
        return True


@dataclass(slots=True)
class BatchContents:
    samples: list[NodeSample] = field(default_factory=list)
    records: JobRecords = field(default_factory=JobRecords)
    acks: list[CommandAck] = field(default_factory=list)


class Batch:
    """Thread-safe accumulator for the next report, backed by an append-only journal."""

    def __init__(
        self,
        journal_dir: Path,
        *,
        next_seq: int,
        quarantine_dir: Path | None = None,
        max_report_bytes: int = wire.MAX_REPORT_BYTES,
    ) -> None:
        self._dir = journal_dir
        #: Bytes the contents may take in a report (samples, records, acks): below the cap
        #: (the wire's, or a smaller spool's) by the identity's share.
        self.budget_bytes = int(max_report_bytes * REPORT_BUDGET_FRACTION)
        #: Sample bytes past which :meth:`add_sample` asks for an early report.
        self.sample_flush_bytes = int(max_report_bytes * SAMPLE_FLUSH_FRACTION)
        # The per-part budgets follow the same cap: fixed at the wire's 4 MiB, 3 MiB of job
        # records (or 512 KiB of XIDs) went into a report for a 64 KiB spool, which set the
        # report aside as too large, and the node's samples with it.
        scale = max_report_bytes / wire.MAX_REPORT_BYTES
        #: Job-record bytes one report carries at most (:data:`MAX_RECORD_BYTES` scaled).
        self.record_budget_bytes = int(MAX_RECORD_BYTES * scale)
        self._flush_hint_bytes = int(FLUSH_HINT_BYTES * scale)
        #: XID bytes one report never passes (:data:`MAX_XID_BYTES` scaled).
        self.max_xid_bytes = int(MAX_XID_BYTES * scale)
        self._xid_budget_bytes = int(XID_BUDGET_BYTES * scale)
        #: Hardware-event bytes one report carries at most (:data:`MAX_EVENT_BYTES` scaled).
        self.event_budget_bytes = int(MAX_EVENT_BYTES * scale)
        self._event_bytes = 0  # hardware events in the samples, as the report serializes them
        #: Hardware events left out of reports (folded or past the budget); the agent's
        #: ``trainguard_node_hardware_events_total`` counts every one.
        self.dropped_events_total = 0
        self._events_logged = False
        #: Where unreadable journal entries go (the spool's ``quarantine/``); by default a
        #: ``quarantine`` directory beside the journal.
        self._quarantine_dir = quarantine_dir or journal_dir.parent / "quarantine"
        self._seq = next_seq
        self._lock = threading.RLock()
        self._contents = BatchContents()
        self._record_bytes = 0  # as the report serializes them (the byte budget)
        self._hint_bytes = 0  # as the clients framed them
        self._file: IO[str] | None = None
        self.dropped_records_total = 0
        self._xid_bytes = 0  # XID events in the samples, as the report serializes them
        self.dropped_xids_total = 0
        # Per sample, parallel to ``contents.samples``: its report bytes and its ordinal (the
        # how-manyth sample of this batch), which thinning keeps multiples of ``_stride`` of.
        self._sample_sizes: list[int] = []
        self._ordinals: list[int] = []
        self._next_ordinal = 0
        self._stride = 1
        self._sample_bytes = 0
        self._ack_bytes = 0
        #: Command-ack bytes one report carries at most (:data:`ACK_BUDGET_FRACTION`).
        self.ack_budget_bytes = int(max_report_bytes * ACK_BUDGET_FRACTION)
        #: Command acks dropped past their item cap or byte budget (the controller sends the
        #: command again); on the agent's /metrics.
        self.dropped_acks_total = 0
        self._shed_logged = False
        self.thinned_samples_total = 0
        self._thinning_logged = False
        self._replay(next_seq)
        self._open(next_seq)

    # ------------------------------------------------------------------ journal

    def _path(self, seq: int) -> Path:
        return self._dir / f"pending-{seq:012d}.jsonl"

    def _open(self, seq: int) -> None:
        self._seq = seq
        path = self._path(seq)
        if _not_a_file(path):  # a directory, a FIFO (opening it would block), a dangling link
            self._quarantine(path, "not a regular file")
        try:
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            self._file = None
            log.error(
                "journal %s cannot be written (%s); items are kept in memory only until the "
                "next report",
                path,
                exc.strerror or exc,
            )

    def _quarantine(self, path: Path, why: str) -> None:
        """Move an unreadable journal entry out of the way (deleted if it cannot be moved)."""
        target = self._quarantine_dir / f"{path.name}.{uuid.uuid4().hex[:8]}"
        log.warning("journal: quarantined %s: %s (moved to %s)", path.name, why, target)
        try:
            self._quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        except OSError as exc:
            log.error("journal: cannot move %s aside (%s); it is ignored", path, exc)

    def _discard(self, path: Path) -> None:
        """Delete a journal file that is no longer needed; one that cannot be is set aside."""
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._quarantine(path, f"cannot be deleted ({exc.strerror or exc})")

    def _read_journal(self, path: Path) -> str | None:
        if _not_a_file(path):  # reading a FIFO would block the start for good
            self._quarantine(path, "not a regular file")
            return None
        try:
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            self._quarantine(path, f"unreadable ({exc.strerror or exc})")
            return None

    def _replay(self, next_seq: int) -> None:
        for path in sorted(self._dir.glob("pending-*.jsonl")):
            try:
                seq = int(path.stem.removeprefix("pending-"))
            except ValueError:
                self._discard(path)
                continue
            if seq < next_seq:
                self._discard(path)  # its report was spooled before the crash
                continue
            text = self._read_journal(path)
            if text is None:
                continue
            replayed = 0
            for line in text.splitlines():
                try:
                    self._apply(json.loads(line))
                    replayed += 1
                except (ValueError, KeyError, TypeError, RecursionError, ValidationError):
                    # A torn tail, or any line that is not one of ours (valid JSON but not an
                    # object, nested past the parser's depth): skipped, never fatal at start.
                    log.warning("journal %s: skipped a torn line", path.name)
            if replayed:
                log.info("journal: recovered %d item(s) from %s", replayed, path.name)
        # Re-journal what was recovered, whole lines only, under the seq it will go into
        # (a torn tail must not swallow the next line appended after it).
        c = self._contents
        lines = [("sample", s.model_dump(mode="json")) for s in c.samples]
        if not c.records.is_empty():
            lines.append(("records", c.records.model_dump(mode="json", exclude_defaults=True)))
        lines += [("ack", a.model_dump(mode="json")) for a in c.acks]
        text = "".join(json.dumps({"t": k, "v": v}, separators=(",", ":")) + "\n" for k, v in lines)
        if text:
            try:
                write_atomic(self._path(next_seq), text.encode())
            except OSError as exc:
                # Still in memory: they go into the next report. The old journals stay on
                # disk (replayed again at the next start) until a rewrite holds them.
                log.error("journal: cannot re-journal recovered items (%s)", exc)
                return
        for path in self._dir.glob("pending-*.jsonl"):
            if path != self._path(next_seq) or not text:
                self._discard(path)

    def _apply(self, entry: Any) -> None:
        if not isinstance(entry, dict):
            raise ValueError(f"not an object: {type(entry).__name__}")
        kind, value = entry["t"], entry["v"]
        # Replay honours the same caps as live adds, so a recovered report always validates.
        if kind == "sample":
            self._append_sample(NodeSample.model_validate(value))
        elif kind == "records":
            self._merge(JobRecords.model_validate(value), len(json.dumps(value)))
            self._fit()
        elif kind == "ack":
            self._append_ack(CommandAck.model_validate(value))
        else:
            raise KeyError(kind)

    def _write(self, kind: str, value: Any) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"t": kind, "v": value}, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:
            log.error("journal write failed (%s); item kept in memory only", exc)

    # ------------------------------------------------------------------ adding

    def xid_limit(self, gpus: int) -> int:
        """XID events per GPU the next sample may list, so that the report's stay near
        :data:`XID_BUDGET_BYTES` (at least :data:`MIN_XIDS_PER_GPU`)."""
        room = max(0, self._xid_budget_bytes - self._xid_bytes) // (max(1, gpus) * XID_EVENT_BYTES)
        return max(MIN_XIDS_PER_GPU, room)

    def _fit_xids(self, sample: NodeSample) -> NodeSample:
        """``sample`` with its XID events within :data:`MAX_XID_BYTES` for the report: as is,
        or the newest event of each code per GPU, or none (counted, logged)."""
        if not any(g.xid_events for g in sample.gpus):
            return sample
        size = sum(report_size(e) + 1 for g in sample.gpus for e in g.xid_events)
        if self._xid_bytes + size <= self.max_xid_bytes:
            self._xid_bytes += size
            return sample
        before = sum(len(g.xid_events) for g in sample.gpus)
        gpus = []
        for gpu in sample.gpus:
            keep = _newest_of_each_code(gpu.xid_events)
            size = sum(report_size(e) + 1 for e in keep)
            if self._xid_bytes + size > self.max_xid_bytes:
                keep = []
            self._xid_bytes += size if keep else 0
            gpus.append(gpu.model_copy(update={"xid_events": keep}))
        dropped = before - sum(len(g.xid_events) for g in gpus)
        self.dropped_xids_total += dropped
        log.warning(
            "report XID budget (%d bytes) spent: %d XID event(s) of this sample left out, "
            "the newest of each code kept where it fits (the agent's metrics count them all)",
            self.max_xid_bytes,
            dropped,
        )
        return sample.model_copy(update={"gpus": gpus})

    def _fit_events(self, sample: NodeSample) -> NodeSample:
        """``sample`` with its hardware events within what is left of the report's event
        budget (:func:`fold_events`); what is left out is counted and logged once."""
        if not sample.events:
            return sample
        room = max(0, self.event_budget_bytes - self._event_bytes)
        kept, size = _fold(sample.events, _MAX_EVENTS, room)
        self._event_bytes += size
        if kept is sample.events:
            return sample
        dropped = len(sample.events) - len(kept)
        self.dropped_events_total += dropped
        if not self._events_logged:
            self._events_logged = True
            log.warning(
                "report hardware-event budget (%d bytes) spent: %d event(s) of this sample "
                "folded into the newest of their kind per link or port, or left out (GPU and "
                "NIC losses always kept; the agent's metrics count them all); not logged "
                "again for this report",
                self.event_budget_bytes,
                dropped,
            )
        return sample.model_copy(update={"events": kept})

    def add_sample(self, sample: NodeSample) -> bool:
        """Add a sample; returns True when the samples are big enough to report now."""
        with self._lock:
            sample = self._append_sample(sample)
            self._write("sample", sample.model_dump(mode="json"))
            return self._sample_bytes >= self.sample_flush_bytes

    def _append_sample(self, sample: NodeSample) -> NodeSample:
        """Append within the caps (live and on replay alike): the item cap drops the oldest,
        the byte budget thins the older ones (:meth:`_thin`). Returns the sample as kept."""
        sample = self._fit_events(self._fit_xids(sample))
        samples = self._contents.samples
        samples.append(sample)
        self._sample_sizes.append(report_size(sample) + 1)
        self._sample_bytes += self._sample_sizes[-1]
        self._ordinals.append(self._next_ordinal)
        self._next_ordinal += 1
        if len(samples) > 1 and self._ordinals[-2] % self._stride:
            # Thinning is on: the sample before this one was kept only as the newest.
            self._drop_sample(len(samples) - 2)
            self.thinned_samples_total += 1
        self._fit()  # the item cap thins too: the oldest sample (an incident's start) stays
        return sample

    def _used_bytes(self) -> int:
        return self._sample_bytes + self._record_bytes + self._ack_bytes

    def _over(self) -> bool:
        return self._used_bytes() > self.budget_bytes

    def _fit(self) -> None:
        """The contents within ``budget_bytes``, giving up what the controller needs least
        first: older samples, then job records, then the last sample's storm (see the
        module's docstring). Each part's own budget alone let a storm that filled them all
        pass the report's cap."""
        self._thin()
        if self._over():
            self._shed_records()
        if self._over():
            self._shed_storm()

    def _shed_records(self) -> None:
        """Records out while over budget: the kinds of :data:`_BUDGET_ORDER` from its end,
        the newest of a kind first (as if they had come when the report was full)."""
        into = self._contents.records
        for name in reversed(_BUDGET_ORDER):
            items: list[Any] = getattr(into, name)
            before = len(items)
            while items and self._over():
                item = items.pop()
                # A comma goes with each item but a kind's last one (see _merge).
                self._record_bytes -= report_size(item) + (1 if items else 0)
            if before > len(items):
                self._log_shed()
                self._drop(name, before - len(items), "report budget")
            if not self._over():
                return

    def _shed_storm(self) -> None:
        """Last resort, one sample left and no records: its hardware events but the losses,
        then its XIDs but the newest of each code per GPU, then its XIDs. Its gauges, its
        losses and the acks stay (the start check makes them fit)."""
        samples = self._contents.samples
        if not samples:
            return
        last = samples[-1]
        events = [e for e in last.events if e.kind in KEEP_EVENT_KINDS]
        if len(events) < len(last.events):
            self.dropped_events_total += len(last.events) - len(events)
            last = self._set_last(last.model_copy(update={"events": events}))
        for cut in (_newest_of_each_code, _no_xids):
            if not self._over():
                return
            gpus = [g.model_copy(update={"xid_events": cut(g.xid_events)}) for g in last.gpus]
            dropped = sum(len(g.xid_events) for g in last.gpus) - sum(
                len(g.xid_events) for g in gpus
            )
            if dropped:
                self.dropped_xids_total += dropped
                last = self._set_last(last.model_copy(update={"gpus": gpus}))
        self._log_shed()
        if self._over():
            log.error(
                "report budget (%d bytes) passed by one sample and the command acks alone "
                "(%d bytes): the report may pass its cap; raise spool_max_bytes",
                self.budget_bytes,
                self._used_bytes(),
            )

    def _set_last(self, sample: NodeSample) -> NodeSample:
        """Replace the newest sample with ``sample``, measured once."""
        size = report_size(sample) + 1
        self._contents.samples[-1] = sample
        self._sample_bytes += size - self._sample_sizes[-1]
        self._sample_sizes[-1] = size
        return sample

    def _log_shed(self) -> None:
        if not self._shed_logged:
            self._shed_logged = True
            log.warning(
                "report budget (%d bytes) shared by every part and full with one sample "
                "left: job records given up (dumps, inflight, probes, steps first), then "
                "the sample's hardware events but losses, then its XIDs but the newest of "
                "each code; counted in the agent's dropped metrics, not logged again for "
                "this report",
                self.budget_bytes,
            )

    def _thin(self) -> None:
        """Over the byte budget or the wire's item cap (:data:`MAX_SAMPLES`): keep every
        second older sample (then every fourth, ...), so the older samples stay evenly spaced,
        the oldest and the newest are kept and no event is lost with a gauge reading. (The
        item cap once dropped the oldest sample instead, and its XIDs and events with it:
        the start of an incident went first.)"""
        samples = self._contents.samples
        before = len(samples)
        while len(samples) > 1 and (
            self._used_bytes() > self.budget_bytes or len(samples) > MAX_SAMPLES
        ):
            self._stride *= 2
            dropped = False
            for i in range(len(samples) - 2, -1, -1):  # newest first: i + 1 is kept
                if self._ordinals[i] % self._stride:
                    self._drop_sample(i)
                    dropped = True
            if not dropped:  # only multiples of the stride are left: the oldest goes
                self._drop_sample(0)
        thinned = before - len(samples)
        if thinned <= 0:
            return
        self.thinned_samples_total += thinned
        if not self._thinning_logged:
            self._thinning_logged = True
            log.warning(
                "report budget (%d bytes, %d samples) reached before the report could go: "
                "older samples thinned evenly (%d left out, one kept in %d; their XID and "
                "hardware events kept), the oldest and newest kept; counted in "
                "trainguard_agent_samples_thinned, not logged again",
                self.budget_bytes,
                MAX_SAMPLES,
                thinned,
                self._stride,
            )

    def _drop_sample(self, i: int) -> None:
        """Leave sample ``i`` out; its XID and hardware events go into sample ``i + 1``."""
        samples = self._contents.samples
        gone = samples[i]
        self._sample_bytes -= self._sample_sizes[i]
        del samples[i], self._sample_sizes[i], self._ordinals[i]
        if not gone.events and not any(g.xid_events for g in gone.gpus):
            return
        into = samples[i]
        xids = {g.index: g.xid_events for g in gone.gpus if g.xid_events}
        gpus = []
        for gpu in into.gpus:
            carried = xids.pop(gpu.index, [])
            if carried:
                listed = [*carried, *gpu.xid_events]
                self.dropped_xids_total += max(0, len(listed) - _MAX_XIDS_PER_GPU)
                gpu = gpu.model_copy(update={"xid_events": listed[-_MAX_XIDS_PER_GPU:]})
            gpus.append(gpu)
        self.dropped_xids_total += sum(len(e) for e in xids.values())  # a GPU gone since
        both = [*gone.events, *into.events]
        events = fold_events(both, max_count=_MAX_EVENTS)  # a loss is never cut off the list
        self.dropped_events_total += len(both) - len(events)
        merged = into.model_copy(update={"gpus": gpus, "events": events})
        samples[i] = merged
        size = report_size(merged) + 1
        self._sample_bytes += size - self._sample_sizes[i]
        self._sample_sizes[i] = size

    def _append_ack(self, ack: CommandAck) -> bool:
        """Append within the acks' item cap and byte budget (live and on replay alike)."""
        size = report_size(ack) + 1
        if len(self._contents.acks) >= MAX_ACKS or self._ack_bytes + size > self.ack_budget_bytes:
            self.dropped_acks_total += 1
            log.error(
                "too many command acks pending (%d, %d bytes); dropped ack for %s (the "
                "controller sends the command again)",
                len(self._contents.acks),
                self._ack_bytes,
                ack.command_id,
            )
            return False
        self._contents.acks.append(ack)
        self._ack_bytes += size
        self._fit()
        return True

    def add_ack(self, ack: CommandAck) -> None:
        with self._lock:
            if self._append_ack(ack):
                self._write("ack", ack.model_dump(mode="json"))

    def add_records(self, records: JobRecords, size_bytes: int) -> bool:
        """Add job records; returns True when the batch is big enough to report now."""
        with self._lock:
            kept = self._merge(records, size_bytes)
            self._fit()  # records come before older samples: those make room first
            if not kept.is_empty():
                self._write("records", kept.model_dump(mode="json", exclude_defaults=True))
            return max(self._hint_bytes, self._record_bytes) >= self._flush_hint_bytes

    def _merge(self, records: JobRecords, size_bytes: int) -> JobRecords:
        """Append within the caps (items, then bytes); what does not fit is dropped and counted.

        ``size_bytes`` (the frame's size) only feeds the early-report hint: the byte budget
        measures the records as the report will serialize them (a client's frame may leave
        out defaults that the report spells out).
        """
        into = self._contents.records
        # Every record kind of the wire format, so a kind added there is never dropped here
        # (Flight Recorder dumps once were: the list named five kinds by hand).
        counted = JobRecords()
        for name in JobRecords.model_fields:
            items: list[Any] = getattr(records, name)
            room = max(0, _RECORD_CAPS[name] - len(getattr(into, name)))
            getattr(counted, name).extend(items[:room])
            self._drop(name, len(items) - room, "items")
        # Fits whole: one measurement. Past the byte budget each item is measured and kept
        # while it fits, the kinds the controller acts on first (_BUDGET_ORDER).
        size = 0 if counted.is_empty() else report_size(counted) - _EMPTY_RECORDS_BYTES
        # Appended to a kind already held, a block costs one comma more than alone: exact
        # bytes, which the shared budget (and giving records up item by item) relies on.
        size += sum(
            1 for name in JobRecords.model_fields if getattr(counted, name) and getattr(into, name)
        )
        if self._record_bytes + size <= self.record_budget_bytes:
            kept = counted
            self._record_bytes += size
        else:
            kept = JobRecords()
            for name in _BUDGET_ORDER:
                items = getattr(counted, name)
                take = self._within_budget(items)
                getattr(kept, name).extend(take)
                self._drop(name, len(items) - len(take), "bytes")
        for name in JobRecords.model_fields:
            getattr(into, name).extend(getattr(kept, name))
        self._hint_bytes += size_bytes
        return kept

    def _drop(self, name: str, n: int, why: str) -> None:
        if n > 0:
            self.dropped_records_total += n
            log.warning("batch full (%s): dropped %d %s record(s)", why, n, name)

    def _within_budget(self, items: list[Any]) -> list[Any]:
        take = []
        for item in items:
            if self.record_budget_bytes - self._record_bytes < 64:
                break  # full: no need to measure the rest
            size = report_size(item) + 1
            if self._record_bytes + size <= self.record_budget_bytes:
                take.append(item)
                self._record_bytes += size
        return take

    # ------------------------------------------------------------------ taking

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def peek(self) -> BatchContents:
        """The current contents (call under :attr:`lock` and then :meth:`reset`)."""
        return self._contents

    def reset(self, next_seq: int) -> None:
        """The contents are in a spooled report now: start an empty journal for ``next_seq``."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._discard(self._path(self._seq))
            self._contents = BatchContents()
            self._record_bytes = 0
            self._hint_bytes = 0
            self._xid_bytes = self._event_bytes = 0
            self._events_logged = self._shed_logged = False
            self._sample_sizes, self._ordinals = [], []
            self._next_ordinal, self._stride = 0, 1
            self._sample_bytes = self._ack_bytes = 0
            self._open(next_seq)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = [
    "ACK_BUDGET_FRACTION",
    "KEEP_EVENT_KINDS",
    "MAX_EVENT_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_TRACE_BYTES",
    "MAX_XID_BYTES",
    "REPORT_BUDGET_FRACTION",
    "SAMPLE_BYTES_PER_GPU",
    "SAMPLE_BYTES_PER_PORT",
    "SAMPLE_FLUSH_FRACTION",
    "XID_BUDGET_BYTES",
    "Batch",
    "BatchContents",
    "fold_events",
    "min_report_cap_bytes",
    "report_size",
    "wire_cap",
]
