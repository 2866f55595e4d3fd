"""Reporter against a real HTTP server: delivery, retries, backoff, resend, rejection."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agents.errors import AgentConfigError
from agents.reporter import (
    BackoffPolicy,
    Reporter,
    _FileToken,
    classify,
    parse_reply,
    read_token_file,
)
from agents.spool import Spool
from agents.stats import AgentStats
from tests.agents.agents_testkit import TOKEN, FakeController
from trainguard.wire import NodeIdentity, NodeSample, Report, ReportReply

FAST = BackoffPolicy(base_s=0.01, max_s=0.05, min_s=0.001)


def spool_reports(spool: Spool, n: int) -> None:
    for _ in range(n):

        def build(seq: int, dropped: int) -> Report:
            return Report(
                node=NodeIdentity(name="n1"),
                agent_instance=spool.agent_instance,
                seq=seq,
                sent_unix_s=time.time(),
                samples=[NodeSample(time_unix_s=float(seq))],
                spool_dropped_total=dropped,
            )

        spool.append(build)


def reporter(spool: Spool, url: str, replies: list[ReportReply], **kw: object) -> Reporter:
    kw.setdefault("token", TOKEN)
    kw.setdefault("backoff", FAST)
    return Reporter(
        spool,
        controller_url=url,
        stats=AgentStats(),
        on_reply=replies.append,
        seed=1,
        **kw,  # type: ignore[arg-type]
    )


def test_delivers_in_order_and_empties_the_spool(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool_reports(spool, 5)
    replies: list[ReportReply] = []
    rep = reporter(spool, agents_controller.url, replies)
    assert [rep.send_oldest() for _ in range(6)] == ["delivered"] * 5 + [None]
    assert [r.seq for r in agents_controller.state.ordered()] == [0, 1, 2, 3, 4]
    assert [r.seq for r in replies] == [0, 1, 2, 3, 4]
    assert spool.pending() == [] and rep._stats.reports_sent_total == 5


def test_5xx_and_429_are_retried_with_backoff_then_delivered(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool_reports(spool, 2)
    agents_controller.fail(503, times=3)
    agents_controller.fail(429, headers={"Retry-After": "0.2"})
    rep = reporter(spool, agents_controller.url, [], backoff=BackoffPolicy(base_s=0.01, max_s=1.0))
    rep.start()
    try:
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) == 2)
    finally:
        rep.stop()
    state = agents_controller.state
    assert state.posts == 6 and rep._stats.report_failures_total == 4
    # Retry-After was honoured: the post after the 429 came >= 0.2 s later.
    assert state.post_times[4] - state.post_times[3] >= 0.19
    assert spool.pending() == []


def test_controller_down_then_back_resends_everything_in_order(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    agents_controller.stop()  # connections refused
    rep = reporter(spool, agents_controller.url, [])
    rep.start()
    try:
        spool_reports(spool, 4)
        rep.wake()
        time.sleep(0.3)
        assert spool.pending() == [0, 1, 2, 3] and rep._stats.report_failures_total >= 2
        agents_controller.start()  # same port
        agents_controller.wait_for(lambda: len(agents_controller.state.reports) == 4)
    finally:
        rep.stop()
    assert [r.seq for r in agents_controller.state.ordered()] == [0, 1, 2, 3]


def test_lost_ack_resend_is_a_duplicate_and_still_clears_the_spool(
    tmp_path: Path, agents_controller: FakeController
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool_reports(spool, 1)
    agents_controller.state.stall_s = 0.5  # stores the report, answers after our timeout
    rep = reporter(spool, agents_controller.url, [], timeout_s=0.2)
    assert rep.send_oldest() == "retry"
    agents_controller.wait_for(lambda: len(agents_controller.state.reports) == 1)
    assert spool.pending() == [0]
    agents_controller.state.stall_s = 0
    replies: list[ReportReply] = []
    rep._on_reply = replies.append
    assert rep.send_oldest() == "delivered"
    assert replies[0].duplicate and agents_controller.state.duplicates == 1
    assert len(agents_controller.state.reports) == 1 and spool.pending() == []


def test_a_bad_report_is_rejected_once_and_the_queue_moves_on(
    tmp_path: Path, agents_controller: FakeController, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool_reports(spool, 2)
    spool.path_for(0).write_text('{"seq": 0, "node": {"name": "BAD NAME"}}')  # not a Report
    rep = reporter(spool, agents_controller.url, [])
    with caplog.at_level(logging.ERROR):
        assert rep.send_oldest() == "rejected"
    assert "rejected report 0" in caplog.text and "422" in caplog.text
    assert rep.send_oldest() == "delivered"
    assert spool.pending() == [] and (spool.rejected_dir / "000000000000.json").exists()
    assert rep._stats.reports_rejected_total == 1


def test_wrong_token_keeps_reports_and_never_logs_the_token(
    tmp_path: Path, agents_controller: FakeController, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tmp_path, max_bytes=10_000_000)
    spool_reports(spool, 1)
    secret = "wrong-token-must-stay-secret-123"
    rep = reporter(spool, agents_controller.url, [], token=secret)
    with caplog.at_level(logging.DEBUG):
        assert rep.send_oldest() == "config"
        assert rep.send_oldest() == "config"
    assert spool.pending() == [0]
    assert secret not in caplog.text
    assert caplog.text.count("report delivery failed") == 1  # logged once, not per retry
    assert "check the agent token" in caplog.text


def test_reply_parsing_keeps_good_commands_and_names_bad_ones() -> None:
    body = (
        b'{"seq": 3, "commands": ['
        b'{"id": "a", "kind": "unlock_clocks", "gpu_index": 1},'
        b'{"id": "b", "kind": "reboot_node"},'
        b'{"id": "c", "kind": "set_power_limit", "gpu_index": 0, "limit_w": -5},'
        b'"garbage"]}'
    )
    reply, invalid = parse_reply(body)
    assert reply.seq == 3 and [c.id for c in reply.commands] == ["a"]
    assert [i for i, _ in invalid] == ["b", "c", ""]
    assert "reboot_node" in invalid[0][1] and "limit_w" in invalid[1][1]
    with pytest.raises(ValueError):
        parse_reply(b"[]")


def test_classification() -> None:
    assert classify(200) == "delivered"
    assert [classify(s) for s in (408, 429, 500, 502, 503, 504)] == ["retry"] * 6
    assert [classify(s) for s in (401, 403, 404)] == ["config"] * 3
    assert [classify(s) for s in (400, 413, 422)] == ["rejected"] * 3


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = BackoffPolicy(base_s=0.5, max_s=30.0, min_s=0.05)
    rng = random.Random(3)
    for failures, ceiling in ((1, 1.0), (3, 4.0), (6, 30.0), (40, 30.0)):
        draws = [policy.delay_s(failures, rng) for _ in range(2000)]
        assert all(0.05 <= d <= ceiling for d in draws)
        # Full jitter: spread over the whole window, mean near half the ceiling.
        assert sum(draws) / len(draws) == pytest.approx(ceiling / 2, rel=0.1)
        assert max(draws) > 0.9 * ceiling and min(draws) < 0.1 * ceiling + 0.05
    assert policy.delay_s(1, rng, retry_after_s=7) >= 7
    assert policy.delay_s(1, rng, retry_after_s=500) <= 30


def _bad_token_files(tmp_path: Path) -> list[tuple[Path, str]]:
    """(path, the reason it reads as) for each kind of unusable token file."""
    (tmp_path / "binary").write_bytes(b"\xff\xfe token")
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "dir").mkdir()
    return [
        (tmp_path / "missing", "No such file or directory"),
        (tmp_path / "dir", "Is a directory"),
        (tmp_path / "binary", "not UTF-8 text"),
        (tmp_path / "empty", "empty; it must hold the agent's token"),
    ]


def test_read_token_file_is_the_token_or_one_line_reason(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text(f"  {TOKEN}\n")
    assert read_token_file(good) == TOKEN
    for path, reason in _bad_token_files(tmp_path):
        with pytest.raises(AgentConfigError) as info:
            read_token_file(path)
        assert str(info.value) == f"token_file {path}: {reason}"


def _header_of(auth: _FileToken) -> Callable[[], str | None]:
    """The Authorization header ``auth`` puts on the next report."""

    def header() -> str | None:
        (request,) = auth.auth_flow(httpx.Request("POST", "http://ctl/api/v1/reports"))
        value: str | None = request.headers.get("Authorization")
        return value

    return header


def test_file_token_that_goes_bad_keeps_the_last_good_token_and_logs_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    auth = _FileToken(path)

    header = _header_of(auth)

    caplog.set_level(logging.WARNING, logger="agents.reporter")
    assert header() is None  # not there yet: sent without, the controller answers 401
    path.write_text(TOKEN)
    assert header() == f"Bearer {TOKEN}"
    path.write_bytes(b"\xff\xfe rotated")  # a non-UTF-8 file is a warning, not a traceback
    assert header() == f"Bearer {TOKEN}"
    path.write_text("")
    assert header() == f"Bearer {TOKEN}"
    warnings = [getattr(r, "fields", {}).get("error") for r in caplog.records]
    assert warnings == [
        f"{path}: No such file or directory",
        f"token_file {path}: not UTF-8 text",
        f"token_file {path}: empty; it must hold the agent's token",
    ]
    assert TOKEN not in caplog.text


def test_a_token_file_not_there_yet_is_warned_once_not_on_every_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent started before its token was issued retries for a minute: one warning, then
    one line when the file appears; it going away again is worth a warning again."""
    path = tmp_path / "token"
    auth = _FileToken(path)

    header = _header_of(auth)

    caplog.set_level(logging.INFO, logger="agents.reporter")
    for _ in range(5):
        assert header() is None
    path.write_text(TOKEN)
    assert header() == f"Bearer {TOKEN}"
    assert header() == f"Bearer {TOKEN}"
    path.unlink()
    for _ in range(3):
        assert header() == f"Bearer {TOKEN}"  # the last good token, while it is gone
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", "agent token file unreadable"),
        ("INFO", "agent token file readable"),
        ("WARNING", "agent token file unreadable"),
    ]
