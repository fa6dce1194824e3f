"""What a restarted appliance reads back of its task classes' paces from a real ledger file
(appliance/start/class_paces.py): the newest succeeded tasks of each tenant's class, as runs of
turns, time between them and time to the close; not failed, cancelled or classless tasks,
nor those created before the window; failed attempts are no turns."""

from __future__ import annotations

from pathlib import Path

from appliance.domain.records import (
    TaskEvent,
    TaskEventType,
    TaskId,
    TaskRecord,
    TenantId,
    TurnId,
    TurnOutcome,
    TurnRecord,
    WorkerId,
)
from appliance.ledger import LedgerWriter
from appliance.policy.deadline_share import TaskRun
from appliance.start.class_paces import finished_runs


def _task(
    ledger: LedgerWriter,
    key: str,
    spans: list[tuple[float, float]],
    closed: float | None,
    *,
    created: float = 100.0,
    task_class: str | None = "build",
    kind: TaskEventType = TaskEventType.SUCCEEDED,
    failed: tuple[float, ...] = (),
) -> None:
    """Task `key` (tenant/id), its attempts (`spans` ok, `failed` failed), closed as `kind`."""
    tenant = TenantId(key.split("/")[0])
    ledger.record_task(TaskRecord(TaskId(key), tenant, created, task_class=task_class))
    attempts = [(a, b, TurnOutcome.OK) for a, b in spans]
    attempts += [(a, a + 0.5, TurnOutcome.FAILED) for a in failed]
    for n, (start, end, outcome) in enumerate(attempts):
        turn_id, worker = TurnId(f"{key}-{n}"), WorkerId("w0")
        ledger.record_turn(
            TurnRecord(
                turn_id, tenant, TaskId(key), None, worker, "m", 100, 40, 5, outcome, start, end
            )
        )
    if closed is not None:
        ledger.record_task_event(TaskEvent(TaskId(key), kind, closed))


def test_the_newest_succeeded_tasks_of_each_class_come_back_as_runs(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with LedgerWriter.open(path) as ledger:
        # 3 turns of 2 s, 3 s apart, closed 1 s after; a failed attempt is no turn.
        _task(ledger, "t/a", [(110, 112), (115, 117), (120, 122)], 123.0, failed=(113,))
        # Two overlapping turns count once: 10 s of turns over a 6 s span.
        _task(ledger, "t/b", [(200, 205), (201, 206)], 210.0)
        _task(ledger, "t/c", [(300, 301)], 302.0)  # the newest of t's build
        _task(ledger, "u/a", [(150, 151)], 151.5)  # another tenant's class
        _task(ledger, "t/gone", [(400, 401)], 402.0, kind=TaskEventType.CANCELLED)
        _task(ledger, "t/broke", [(400, 401)], 402.0, kind=TaskEventType.FAILED)
        _task(ledger, "t/open", [(400, 401)], None)
        _task(ledger, "t/plain", [(400, 401)], 402.0, task_class=None)
        _task(ledger, "t/old", [(400, 401)], 402.0, created=10.0)  # before the window
        ledger.flush()
    runs = finished_runs(path, since=50.0)
    assert runs == [
        ("t", "build", TaskRun(3, 6.0, 6.0, 1.0)),
        ("u", "build", TaskRun(1, 1.0, 0.0, 0.5)),
        ("t", "build", TaskRun(2, 6.0, 0.0, 4.0)),
        ("t", "build", TaskRun(1, 1.0, 0.0, 1.0)),
    ]  # oldest first
    newest = finished_runs(path, since=50.0, per_class=2)
    assert [run.turns for _, _, run in newest] == [1, 2, 1]  # t's oldest build task left out
    assert [run.turns for _, _, run in finished_runs(path, since=50.0, limit=1)] == [1]


def test_a_ledger_that_cannot_be_read_starts_the_history_empty(tmp_path: Path) -> None:
    assert finished_runs(tmp_path / "missing.db", since=0.0) == []
    (tmp_path / "other.db").write_bytes(b"not a ledger at all")
    assert finished_runs(tmp_path / "other.db", since=0.0) == []
