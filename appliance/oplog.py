"""The appliance's own log: to stderr (the journal, under systemd) and to `appliance.log` in
the log dir (`log_dir`, else logs/ in the data dir), rotated at LOG_FILE_BYTES with
LOG_FILE_BACKUPS old files kept, at `log_level` (a reload changes it).

What it says: the startup plan (engine, each worker's address and GPUs), worker events
(up, down, restarted), operators' releases and cancelled tasks, admission refusals, one
request line per turn at INFO (`appliance.requests`), drain and shutdown.

Off the event loop's back: a log call there only builds the record and puts it on a queue;
one thread formats it (lazily, from the plain values passed as arguments) and writes it.
The request line is one such call per turn, made after the answer went out.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from appliance.domain.records import TurnRecord
from appliance.services.operator.events import Event, EventFeed, EventKind

LOG_FILE = "appliance.log"
LOG_FILE_BYTES = 10 * 2**20
LOG_FILE_BACKUPS = 5
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""Under systemd: the journal stamps each line itself."""

requests_log = logging.getLogger("appliance.requests")
events_log = logging.getLogger("appliance.events")


class _RecordQueue(logging.handlers.QueueHandler):
    """Hands the record over as it is: formatting happens in the writer's thread."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


def start_logging(level: str, log_dir: Path | None) -> Callable[[], None]:
    """The root logger at `level`, to stderr and (with `log_dir`) the rotating file; returns
    the function that writes out what is queued and stops the writer's thread."""
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter(JOURNAL_FORMAT if _journal() else FORMAT))
    handlers: list[logging.Handler] = [stderr]
    if log_dir is not None:
        file = logging.handlers.RotatingFileHandler(
            log_dir / LOG_FILE,
            maxBytes=LOG_FILE_BYTES,
            backupCount=LOG_FILE_BACKUPS,
            encoding="utf-8",
            delay=True,
        )
        file.setFormatter(logging.Formatter(FORMAT))
        handlers.append(file)
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    writer = logging.handlers.QueueListener(records, *handlers)
    root = logging.getLogger()
    previous = root.handlers[:]
    root.handlers[:] = [_RecordQueue(records)]
    root.setLevel(level)
    writer.start()

    def stop() -> None:
        writer.stop()
        for handler in handlers:
            handler.close()
        root.handlers[:] = previous

    return stop


def _journal() -> bool:
    """Whether stderr is the journal (systemd says so in JOURNAL_STREAM: device:inode)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def log_turns(
    then: Callable[[TurnRecord, Future[float | None]], None],
) -> Callable[[TurnRecord, Future[float | None]], None]:
    """The turn-records hook with the request line in front: one line per turn (a ledger
    `turns` row, so a retried attempt has its own) at INFO."""

    def on_turn(record: TurnRecord, written: Future[float | None]) -> None:
        if requests_log.isEnabledFor(logging.INFO):
            requests_log.info(
                "turn %s tenant=%s session=%s task=%s worker=%s status=%s prompt_tokens=%d "
                "cached_tokens=%d output_tokens=%d ttft_s=%s latency_s=%.3f",
                record.turn_id,
                record.tenant,
                record.session_id,
                record.task_id,
                record.worker or f"outside:{record.endpoint}",
                record.outcome.value,
                record.prompt_tokens,
                record.cached_tokens,
                record.output_tokens,
                None if record.ttft_s is None else round(record.ttft_s, 4),
                record.e2e_s,
            )
        then(record, written)

    return on_turn


_EVENT_LEVELS = {
    EventKind.WORKER_DOWN: logging.WARNING,
    EventKind.WORKER_RESTART: logging.WARNING,
    EventKind.WORKER_UP: logging.INFO,
    EventKind.WORKER_WAKE_FAILED: logging.WARNING,
    EventKind.RELEASE: logging.INFO,
    EventKind.TASK_CANCELLED: logging.INFO,
    EventKind.REJECTION: logging.DEBUG,  # admission logs its refusals itself
}


class LoggedEventFeed(EventFeed):
    """The operator's event feed, each event also a log line."""

    def record(
        self, at: float, kind: EventKind, subject: str, detail: str, *, tenant: str | None = None
    ) -> Event:
        event = super().record(at, kind, subject, detail, tenant=tenant)
        level = _EVENT_LEVELS.get(kind, logging.INFO)
        if events_log.isEnabledFor(level):
            events_log.log(
                level,
                "%s %s%s: %s",
                kind.value,
                subject,
                f" (tenant {tenant})" if tenant else "",
                detail,
            )
        return event
