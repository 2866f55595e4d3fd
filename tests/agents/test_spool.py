"""Spool: atomic files, ordering, byte bound, quarantine, seq persistence; batch journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.batch import Batch
from agents.spool import Spool
from trainguard.wire import (
    CheckpointEvent,
    CommandAck,
    CommandStatus,
    FlightRecorderDump,
    InflightCollective,
    JobRecords,
    NodeIdentity,
    NodeSample,
    PeerGroup,
    ProbeResult,
    RankEvent,
    Report,
    StepSummary,
)


def builder(spool: Spool, samples: int = 1, pad: int = 0):  # type: ignore[no-untyped-def]
    def build(seq: int, dropped: int) -> Report:
        return Report(
            # Padding in label values of at most 250 characters (labels are names, capped).
            node=NodeIdentity(
                name="n1", labels={f"pad{i}": "x" * 250 for i in range(-(-pad // 250))}
            ),
            agent_instance=spool.agent_instance,
            seq=seq,
            sent_unix_s=1.0,
            samples=[NodeSample(time_unix_s=float(seq * 10 + i)) for i in range(samples)],
            spool_dropped_total=dropped,
        )

    return build


def test_reports_are_whole_files_in_seq_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    seqs = [spool.append(builder(spool)) for _ in range(5)]
    assert seqs == [0, 1, 2, 3, 4] == spool.pending()
    names = sorted(p.name for p in spool.reports_dir.iterdir())
    assert names == [f"{s:012d}.json" for s in seqs]  # no tmp files left behind
    seq, body = spool.oldest()  # type: ignore[misc]
    assert seq == 0 and Report.model_validate_json(body).seq == 0
    spool.acknowledge(0)
    assert spool.oldest()[0] == 1  # type: ignore[index]
    assert not (spool.reports_dir / f"{0:012d}.json").exists()


def test_seq_and_instance_survive_a_restart_even_without_the_state_update(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    for _ in range(3):
        spool.append(builder(spool))
    instance = spool.agent_instance
    assert Spool(tmp_path, max_bytes=10_000_000).next_seq == 3
    # A crash between writing report 3 and updating state.json: state still says 3.
    state = json.loads((tmp_path / "state.json").read_text())
    spool.append(builder(spool))
    (tmp_path / "state.json").write_text(json.dumps(state))
    reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.agent_instance == instance
    assert reopened.next_seq == 4 and reopened.pending() == [0, 1, 2, 3]


def test_bound_drops_the_oldest_and_counts_it_persistently(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=64 * 1024)
    for _ in range(40):
        spool.append(builder(spool, pad=4000))
    _, size = spool.stats()
    assert size <= 64 * 1024
    pending = spool.pending()
    assert pending[-1] == 39 and pending == list(range(pending[0], 40))
    assert spool.state.dropped_total == pending[0] > 0
    newest = Report.model_validate_json(spool.path_for(39).read_bytes())
    assert newest.spool_dropped_total == spool.state.dropped_total
    assert Spool(tmp_path, max_bytes=64 * 1024).state.dropped_total == pending[0]


def test_a_report_larger_than_the_whole_spool_is_set_aside_alone(tmp_path: Path) -> None:
    """Emptying the spool for it would lose every older report and still break the bound:
    it goes to rejected/ with its reason, uses up its seq and counts as dropped."""
    spool = Spool(tmp_path, max_bytes=16 * 1024)
    for _ in range(3):
        spool.append(builder(spool, pad=1000))
    assert spool.append(builder(spool, pad=20_000)) == 3
    assert spool.pending() == [0, 1, 2] and spool.stats()[1] <= 16 * 1024
    assert spool.state.dropped_total == 1 and spool.next_seq == 4
    assert not spool.path_for(3).exists()
    reason = (spool.rejected_dir / "000000000003.json.reason.txt").read_text()
    assert "larger than the whole spool (16384 bytes max)" in reason
    assert Report.model_validate_json((spool.rejected_dir / "000000000003.json").read_bytes())
    spool.append(builder(spool))  # the next one tells the controller, under the next seq
    newest = Report.model_validate_json(spool.path_for(4).read_bytes())
    assert newest.spool_dropped_total == 1
    reopened = Spool(tmp_path, max_bytes=16 * 1024)
    assert reopened.pending() == [0, 1, 2, 4] and reopened.state.dropped_total == 1


def test_torn_and_stray_files_are_quarantined_not_fatal(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    for _ in range(3):
        spool.append(builder(spool))
    path = spool.path_for(1)
    path.write_bytes(path.read_bytes()[:50])  # torn
    (spool.reports_dir / "000000000002.json").write_text(
        spool.path_for(0).read_text()
    )  # wrong seq inside
    (spool.reports_dir / ".000000000003.json.tmp").write_text("{half")  # unfinished write
    (spool.reports_dir / "notes.txt").write_text("?")
    reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.pending() == [0]
    assert reopened.state.quarantined_total == 3
    assert len(list(reopened.quarantine_dir.iterdir())) == 3
    assert not (reopened.reports_dir / ".000000000003.json.tmp").exists()
    assert reopened.next_seq == 3  # seqs are never reused


def test_corrupt_state_file_gives_a_fresh_instance(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    old = spool.agent_instance
    (tmp_path / "state.json").write_text("{not json")
    reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.agent_instance != old and reopened.state.quarantined_total == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"dropped_total": -5},
        {"quarantined_total": -1},
        {"rejected_total": "3"},
        {"dropped_total": 2**63},
        {"next_seq": 1.5},
        {"next_seq": True},
        {"next_seq": -1},
        {"agent_instance": ""},
        {"agent_instance": 7},
        {"agent_instance": "x" * 65},
    ],
)
def test_a_state_file_with_a_wrong_type_or_range_gives_a_fresh_instance(
    tmp_path: Path, bad: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    """A state that reads but is wrong would fail every report forever (a negative total)
    or reuse seqs (``1.5`` read as 1): it is set aside like a garbage one, with one line."""
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool.append(builder(spool))
    spool.acknowledge(0)
    state = json.loads((tmp_path / "state.json").read_text()) | {"next_seq": 3} | bad
    (tmp_path / "state.json").write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="agents.spool"):
        reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.agent_instance != spool.agent_instance
    assert (reopened.next_seq, reopened.state.dropped_total) == (0, 0)
    assert reopened.state.quarantined_total == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("spool: quarantined state.json: unreadable state file (")
    reopened.append(builder(reopened))  # reports build again
    assert reopened.pending() == [0]


def test_reject_moves_the_report_aside_with_its_reason(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool.append(builder(spool))
    spool.reject(0, "HTTP 422: body.samples: bad")
    assert spool.pending() == []
    assert (spool.rejected_dir / "000000000000.json").exists()
    assert "422" in (spool.rejected_dir / "000000000000.json.reason.txt").read_text()
    assert Spool(tmp_path, max_bytes=10_000_000).state.rejected_total == 1


def step(n: int) -> StepSummary:
    return StepSummary(
        job="j", rank=0, world_size=1, step=n, step_time_s=1, compute_time_s=1, collective_wait_s=0
    )


def test_journal_replays_what_a_killed_agent_had_not_reported(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    batch = Batch(spool.journal_dir, next_seq=spool.next_seq)
    batch.add_sample(NodeSample(time_unix_s=1.0))
    batch.add_records(JobRecords(steps=[step(1), step(2)]), 100)
    batch.add_ack(CommandAck(command_id="c1", status=CommandStatus.SUCCEEDED))
    batch.add_sample(NodeSample(time_unix_s=2.0))
    # kill -9 here: nothing closed, nothing flushed into a report. Add a torn tail too.
    with (spool.journal_dir / f"pending-{spool.next_seq:012d}.jsonl").open("a") as f:
        f.write('{"t":"sample","v":{"time_un')
    again = Batch(spool.journal_dir, next_seq=Spool(tmp_path, max_bytes=10_000_000).next_seq)
    contents = again.peek()
    assert [s.time_unix_s for s in contents.samples] == [1.0, 2.0]
    assert [s.step for s in contents.records.steps] == [1, 2]
    assert [a.command_id for a in contents.acks] == ["c1"]
    # A line appended after recovery is not glued onto the torn tail.
    again.add_sample(NodeSample(time_unix_s=3.0))
    third = Batch(spool.journal_dir, next_seq=spool.next_seq)
    assert [s.time_unix_s for s in third.peek().samples] == [1.0, 2.0, 3.0]


def test_journal_lines_that_are_json_but_not_objects_are_skipped_like_torn_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = json.dumps({"t": "sample", "v": NodeSample(time_unix_s=1.0).model_dump(mode="json")})
    bad = ["[1]", "5", '"x"', "null", '{"t":"sample","v":5}', "[" * 100_000 + "]" * 100_000]
    (tmp_path / "pending-000000000003.jsonl").write_text("\n".join([*bad, good]) + "\n")
    with caplog.at_level("WARNING", logger="agents.batch"):
        batch = Batch(tmp_path, next_seq=3)
    assert [s.time_unix_s for s in batch.peek().samples] == [1.0]
    skipped = [r.getMessage() for r in caplog.records]
    assert skipped == ["journal pending-000000000003.jsonl: skipped a torn line"] * len(bad)


def test_journal_of_an_already_spooled_report_is_not_replayed(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    batch = Batch(spool.journal_dir, next_seq=spool.next_seq)
    batch.add_sample(NodeSample(time_unix_s=1.0))
    with batch.lock:
        spool.append(builder(spool))
        # kill -9 before batch.reset(): the journal for seq 0 is still on disk.
    again = Batch(spool.journal_dir, next_seq=Spool(tmp_path, max_bytes=10_000_000).next_seq)
    assert again.peek().samples == []
    assert list(spool.journal_dir.glob("pending-000000000000.jsonl")) == []


def test_batch_caps_records_and_asks_for_an_early_report(tmp_path: Path) -> None:
    batch = Batch(tmp_path, next_seq=0)
    assert batch.add_records(JobRecords(steps=[step(i) for i in range(10)]), 2_000_000) is True
    batch.add_records(JobRecords(steps=[step(i) for i in range(10_000)]), 10)
    assert len(batch.peek().records.steps) == 10_000
    assert batch.dropped_records_total == 10


def test_a_crash_before_the_rename_leaves_no_partial_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool.append(builder(spool))

    def die(*_: object) -> None:
        raise OSError("simulated crash between fsync and rename")

    monkeypatch.setattr("agents.atomic.os.replace", die)
    with pytest.raises(OSError):
        spool.append(builder(spool))
    monkeypatch.undo()
    # The failed write removed its own tmp file; a kill -9 at that point would not have,
    # so leave one behind as the crash would.
    assert [p.name for p in spool.reports_dir.iterdir() if p.name.startswith(".")] == []
    (spool.reports_dir / ".000000000001.json.tmp").write_bytes(b'{"schema_version":1,"no')
    reopened = Spool(tmp_path, max_bytes=10_000_000)
    assert reopened.pending() == [0]  # the half-done report never became visible
    assert [p.name for p in reopened.reports_dir.iterdir()] == ["000000000000.json"]
    assert reopened.next_seq == 1 and reopened.state.quarantined_total == 0
    assert reopened.append(builder(reopened)) == 1


def test_replay_keeps_the_sample_cap(tmp_path: Path) -> None:
    import agents.batch

    batch = Batch(tmp_path, next_seq=0)
    for i in range(agents.batch.MAX_SAMPLES + 5):
        batch.add_sample(NodeSample(time_unix_s=float(i)))
    # Past the item cap older samples are thinned evenly, as past the byte budget: the
    # oldest (an incident's start) stays, and so does the newest.
    samples = batch.peek().samples
    assert len(samples) <= agents.batch.MAX_SAMPLES and samples[0].time_unix_s == 0.0
    assert samples[-1].time_unix_s == float(agents.batch.MAX_SAMPLES + 4)
    replayed = Batch(tmp_path, next_seq=0).peek().samples
    assert len(replayed) <= agents.batch.MAX_SAMPLES and replayed[0].time_unix_s == 0.0


def test_leaving_nulls_out_of_spooled_reports_loses_nothing() -> None:
    """The spool writes reports with ``exclude_none``: lossless only while every nullable
    wire field defaults to ``None``, which this pins for every model of the contract."""
    import inspect
    import typing

    from pydantic import BaseModel

    from agents.spool import _encode
    from trainguard import wire

    for name, model in vars(wire).items():
        if inspect.isclass(model) and issubclass(model, BaseModel):
            for field_name, info in model.model_fields.items():
                if type(None) in typing.get_args(info.annotation):
                    assert info.default is None, f"{name}.{field_name}"
    report = wire.Report(
        node=wire.NodeIdentity(name="n"),
        agent_instance="a",
        seq=3,
        sent_unix_s=1.0,
        samples=[wire.NodeSample(time_unix_s=1.0, gpus=[wire.GpuSample(index=0, power_w=None)])],
    )
    data = _encode(report)
    assert b"null" not in data and wire.Report.model_validate_json(data) == report


def test_every_record_kind_survives_the_batch_and_its_journal(tmp_path: Path) -> None:
    """A kind the wire format carries must reach the report: Flight Recorder dumps were once
    dropped here because the batch named its record kinds by hand."""
    records = JobRecords(
        steps=[step(1)],
        inflight=[
            InflightCollective(job="j", rank=0, group="0", op="allreduce", seq=3, elapsed_s=1)
        ],
        rank_events=[RankEvent(job="j", rank=0, kind="started", time_unix_s=1.0)],
        checkpoints=[CheckpointEvent(job="j", rank=0, step=1, kind="started", time_unix_s=1.0)],
        probes=[
            ProbeResult(job="j", probe_id="p", src_rank=0, dst_rank=1, size_bytes=1, duration_s=0.1)
        ],
        traces=[FlightRecorderDump(job="j", rank=0, enabled=True, entries=[{"op": "allreduce"}])],
        peer_groups=[PeerGroup(job="j", id="pg2-abc", ranks=[0, 1])],
    )
    assert all(getattr(records, name) for name in JobRecords.model_fields), "fill every kind"
    batch = Batch(tmp_path, next_seq=0)
    batch.add_records(records, 100)
    assert batch.peek().records == records
    assert Batch(tmp_path, next_seq=0).peek().records == records  # replayed from the journal
