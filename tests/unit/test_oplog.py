"""The appliance's own log (appliance/oplog.py): through one writer thread to stderr and a
rotating file, at its level; a request line per turn; operator events as log lines."""

from __future__ import annotations

import logging
import logging.handlers
from concurrent.futures import Future
from pathlib import Path

import pytest

from appliance import oplog
from appliance.domain.records import (
    SessionId,
    TaskId,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.oplog import LOG_FILE, LoggedEventFeed, log_turns, start_logging
from appliance.services.operator.events import EventKind


def _turn(**over: object) -> TurnRecord:
    fields: dict[str, object] = dict(
        turn_id=TurnId("u1"),
        tenant=TenantId("acme"),
        task_id=TaskId("acme/t1"),
        session_id=SessionId("s1"),
        worker=WorkerId("w1"),
        model="m",
        prompt_tokens=100,
        cached_tokens=64,
        output_tokens=7,
        outcome=TurnOutcome.OK,
        started_at=10.0,
        finished_at=10.25,
        ttft_s=0.05,
        e2e_s=0.25,
    )
    return TurnRecord(**(fields | over))  # type: ignore[arg-type]


def test_the_file_gets_the_lines_at_the_level_and_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oplog, "LOG_FILE_BYTES", 2000)
    stop = start_logging("WARNING", tmp_path)
    try:
        logging.getLogger("appliance.x").info("not at WARNING")
        logging.getLogger("appliance.x").warning("worker %s is down", "w3")
    finally:
        stop()  # writes out what is queued
    text = (tmp_path / LOG_FILE).read_text()
    assert "WARNING appliance.x: worker w3 is down" in text and "not at WARNING" not in text
    stop = start_logging("INFO", tmp_path)
    try:
        for i in range(300):  # about 20 kB: more than 6 files of 2 kB
            logging.getLogger("appliance.x").info("line %d of a long run", i)
    finally:
        stop()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [LOG_FILE] + [f"{LOG_FILE}.{i}" for i in range(1, oplog.LOG_FILE_BACKUPS + 1)]
    assert "line 299 of a long run" in (tmp_path / LOG_FILE).read_text()
    stop = start_logging("INFO", tmp_path)
    try:
        [queued] = logging.getLogger().handlers
        assert isinstance(queued, logging.handlers.QueueHandler)  # the loop only enqueues
        assert logging.getLogger().level == logging.INFO
    finally:
        stop()


def test_a_turn_is_one_request_line_and_the_hook_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[TurnRecord] = []
    hook = log_turns(lambda record, written: seen.append(record))
    with caplog.at_level(logging.INFO, logger="appliance.requests"):
        hook(_turn(), Future())
        hook(_turn(turn_id=TurnId("u2"), outcome=TurnOutcome.FAILED, ttft_s=None), Future())
    assert [r.turn_id for r in seen] == ["u1", "u2"]
    first, second = (r.getMessage() for r in caplog.records)
    assert first == (
        "turn u1 tenant=acme session=s1 task=acme/t1 worker=w1 status=ok prompt_tokens=100 "
        "cached_tokens=64 output_tokens=7 ttft_s=0.05 latency_s=0.250"
    )
    assert " status=failed " in second and " ttft_s=None " in second


def test_no_request_line_above_info_and_no_formatting_either(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hook = log_turns(lambda record, written: None)
    with caplog.at_level(logging.WARNING, logger="appliance.requests"):
        hook(_turn(), Future())
    assert caplog.records == []


def test_operator_events_are_log_lines_too(caplog: pytest.LogCaptureFixture) -> None:
    feed = LoggedEventFeed()
    with caplog.at_level(logging.INFO, logger="appliance.events"):
        feed.record(1.0, EventKind.WORKER_DOWN, "w0", "no answer to /health for 3 s")
        feed.record(2.0, EventKind.RELEASE, "s9", "released by an operator", tenant="acme")
        feed.record(3.0, EventKind.REJECTION, "t1", "overloaded")  # DEBUG: not at INFO
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "worker_down w0: no answer to /health for 3 s"),
        ("INFO", "release s9 (tenant acme): released by an operator"),
    ]
    assert len(feed) == 3 and feed.counts[EventKind.REJECTION] == 1
