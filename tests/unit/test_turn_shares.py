"""A turn's share of its task's deadline at the turn desk, and admission judging a turn's
deadline on the worker placement chose.

The desk learns each task class's pace from its tasks that succeed (their turns, the time
they ran, the time between them, the time to the close), and gives each turn of a task with
a deadline the deadline less what its class expects after it: the answer says both
(`X-Appliance-Turn-Timeout-S`, `X-Appliance-Deadline-Reserve-S`), and a turn still waiting
on its worker at the end of its share is aborted there (504 `deadline_missed`), not at the
deadline, when the task has no time left to do anything about it. The clock is the test's
(tests/fakes.py `ManualClock`): a worker's answer takes what it moves the clock by."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from appliance.domain.records import (
    SessionId,
    TaskEventType,
    TaskId,
    TaskStatus,
    TenantId,
    TurnId,
    WorkerId,
)
from appliance.policy.deadline_share import Reserve, TaskRun
from appliance.services.tasks.admission import AdmissionRefused
from appliance.services.tasks.task_paces import TaskPaces, run_of
from appliance.services.tasks.task_state import TaskError, TaskState
from appliance.services.turns.turn import Reply, TurnRequest
from tests.fakes import FixedIndex, ManualClock, RouterWorker, Wired, wired_desk

A = TenantId("a")
W0, W1 = WorkerId("w0"), WorkerId("w1")
ANSWER = b'{"usage": {"prompt_tokens": 40, "completion_tokens": 1}}'
TIMEOUT, RESERVE = "X-Appliance-Turn-Timeout-S", "X-Appliance-Deadline-Reserve-S"


class Worker:
    """Answers after `takes_s` on the test's clock; `hold` keeps it from answering until the
    test lets it (`go`), as a worker whose queue it waits in."""

    def __init__(self, clock: ManualClock, takes_s: float = 0.0, hold: bool = False) -> None:
        self.clock = clock
        self.takes_s = takes_s
        self.go = asyncio.Event()
        if not hold:
            self.go.set()
        self.aborted = 0

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        self.clock.advance(self.takes_s)
        return ANSWER


def turn(task: str, deadline_s: float | None = None, prompt: int = 40) -> TurnRequest:
    ids = list(range(prompt))
    return TurnRequest(
        A,
        "/v1/completions",
        {"model": "m", "prompt": ids},
        client_task_id=task,
        session_id=SessionId(task),
        deadline_s=deadline_s,
    )


def learned(wired: Wired, worker: Worker, tasks: int = 3) -> None:
    """`tasks` tasks of class `build` run and succeed through the desk: 3 turns of 2 s each,
    3 s of tools between them, 1 s from the last turn to the close."""
    worker.takes_s = 2.0

    async def main() -> None:
        for n in range(tasks):
            wired.tasks.create(A, f"h{n}", wired.clock.now(), task_class="build")
            for k in range(3):
                if k:
                    wired.clock.advance(3.0)
                await wired.desk.run(turn(f"h{n}"))
            wired.clock.advance(1.0)
            wired.tasks.event(A, f"h{n}", TaskEventType.SUCCEEDED, wired.clock.now())

    asyncio.run(main())


async def settled(running: Any) -> Any:
    """`running`'s result once the rows it handed the ledger are written (a loop turn)."""
    result = await running
    await asyncio.sleep(0)
    return result


def shares(reply: Reply) -> tuple[str | None, str | None]:
    return reply.headers.get(TIMEOUT), reply.headers.get(RESERVE)


def test_a_turn_leaves_its_class_the_work_it_expects_after_the_turn() -> None:
    """After turn k of 3, a task of the class is expected to run 3 - k more turns of 2 s,
    with 3 s of tools before each, and to close 1 s after the last: the turn has its
    deadline less that."""
    clock = ManualClock(100.0)
    worker = Worker(clock)
    wired = wired_desk([RouterWorker(W0, worker)], clock=clock)
    learned(wired, worker)
    wired.tasks.create(A, "t", clock.now(), task_class="build", deadline_s=30.0)

    async def main() -> list[Reply]:
        replies = []
        for k in range(3):
            if k:
                clock.advance(3.0)
            replies.append(await wired.desk.run(turn("t")))
        return replies

    first, second, third = asyncio.run(main())
    assert shares(first) == ("19.000", "11.000")  # 30 s left: 2 more turns (2 x 5 s) + 1 s
    assert shares(second) == ("19.000", "6.000")  # 25 s left: 1 more turn + 1 s
    assert shares(third) == ("19.000", "1.000")  # 20 s left: the close alone
    # A task of no class, or of a class without history, may use the whole deadline.
    wired.tasks.create(A, "new", clock.now(), task_class="fresh", deadline_s=30.0)
    for task in ("new", "plain"):
        reply = asyncio.run(wired.desk.run(turn(task, deadline_s=30.0)))
        assert shares(reply) == ("30.000", "0.000")
    # A turn without a deadline has no share to tell.
    assert shares(asyncio.run(wired.desk.run(turn("free")))) == (None, None)


def test_a_turn_still_queued_at_the_end_of_its_share_is_aborted_then() -> None:
    clock = ManualClock(100.0)
    worker = Worker(clock)
    wired = wired_desk([RouterWorker(W0, worker)], clock=clock)
    learned(wired, worker)
    worker.go.clear()  # the next turn waits in the worker's queue
    wired.tasks.create(A, "t", clock.now(), task_class="build", deadline_s=30.0)

    async def main() -> TaskError:
        running = asyncio.create_task(wired.desk.run(turn("t")))
        for _ in range(5):
            await asyncio.sleep(0)
        clock.advance(18.9)  # within its share: it waits on
        for _ in range(5):
            await asyncio.sleep(0)
        assert not running.done()
        clock.advance(0.2)  # 19.1 s: its share is over, 10.9 s before the deadline
        with pytest.raises(TaskError) as missed:
            await asyncio.wait_for(running, 5)
        return missed.value

    error = asyncio.run(main())
    assert (error.http_status, error.code) == (504, "deadline_missed")
    assert error.message == (
        "task t's turn had not started within its share of the deadline (19.000 s; 11.000 s "
        "kept for about 2.0 more turns of 2.000 s with 3.000 s between, then 1.000 s to close, "
        "learned from 3 tasks of its class); the turn was aborted"
    )
    assert worker.aborted == 1


def test_a_turn_is_never_given_less_than_it_needs_at_its_worker() -> None:
    """A class whose tasks spend 100 s between turns asks more than the whole deadline: the
    turn still has its own need, its estimated first token at the worker placement chose
    (5 s queued there, 0.04 s of prefill), and admission lets it in: it can make the
    deadline itself."""
    clock = ManualClock(100.0)
    worker = Worker(clock)
    wired = wired_desk([RouterWorker(W0, worker)], clock=clock, admission=True)
    for _ in range(3):
        wired.desk.paces.observe(A, "slow", TaskRun(3, 6.0, 200.0, 1.0))
    wired.tasks.create(A, "t", clock.now(), task_class="slow", deadline_s=30.0)
    wired.queues.sent(W0, TurnId("ahead"), 5.0, clock.now())
    reply = asyncio.run(wired.desk.run(turn("t")))
    assert shares(reply) == ("5.040", "24.960")


def test_admission_judges_the_deadline_on_the_worker_placement_chose() -> None:
    """w0 holds 1584 tokens of the turn's 1600 behind 1.5 s of queue (first token in
    1.674 s); w1 holds none and is idle (1.600 s). Placement picks w0, for what its prefix
    saves; admission used to judge the fastest, w1, and let in a turn that then waited at w0
    past its deadline."""
    clock = ManualClock(100.0)
    workers = [RouterWorker(W0, Worker(clock)), RouterWorker(W1, Worker(clock))]
    wired = wired_desk(workers, clock=clock, index=FixedIndex({W0: 99}), admission=True)
    wired.queues.sent(W0, TurnId("ahead"), 1.5, clock.now())
    with pytest.raises(AdmissionRefused) as refused:
        asyncio.run(wired.desk.run(turn("t", deadline_s=1.65, prompt=1600)))
    assert refused.value.code == "deadline_infeasible"
    assert refused.value.message == (
        "the deadline is 1.650 s away, but the first token at w0, placement's choice, is "
        "1.674 s away (queue 1.500 s + prefill 0.174 s)"
    )
    assert wired.ledger.turns == []  # no worker saw it
    served = asyncio.run(settled(wired.desk.run(turn("t", deadline_s=1.7, prompt=1600))))
    assert served.headers["X-Appliance-Worker"] == W0  # where admission judged it
    assert shares(served) == ("1.700", "0.000")
    [row] = wired.ledger.turns
    assert row.worker == W0


def test_the_history_learns_only_whole_successes_and_stays_bounded() -> None:
    clock = ManualClock(100.0)
    paces = TaskPaces(clock, runs=2, classes=2, min_runs=1)
    ok = TaskRun(2, 4.0, 2.0, 1.0)
    for n in range(3):  # the newest 2 of a class
        paces.observe(A, "c", TaskRun(n + 1, 2.0 * (n + 1), 0.0, 0.0))
    reserve = paces.reserve(_task("c", turns=1))
    assert reserve is not None and (reserve.runs, reserve.more_turns) == (2, 1.5)
    paces.observe(A, "d", ok)
    paces.observe(A, "e", ok)  # a third class: the least recently learned (c) goes
    assert paces.reserve(_task("c", turns=1)) is None
    assert paces.reserve(_task("d", turns=0)) == Reserve(9.0, 2.0, 2.0, 2.0, 1.0, 1)
    assert paces.reserve(_task("e", turns=2)) == Reserve(1.0, 0.0, 2.0, 2.0, 1.0, 1)
    assert paces.reserve(_task(None, turns=1)) is None  # no class: nothing to learn from


def test_a_task_counts_as_a_run_only_when_it_succeeded_whole() -> None:
    task = _task("c", turns=0)
    for at in (10.0, 20.0):  # two turns of 2 s, 8 s apart
        task.turns += 1
        task.load.pace.began(at, 0)
        task.load.pace.ended(at + 2.0, 0)
    assert run_of(task, 25.0) is None  # still open
    task.status = TaskStatus.SUCCEEDED
    assert run_of(task, 25.0) == TaskRun(2, 4.0, 8.0, 3.0)
    task.load.in_flight = 1
    assert run_of(task, 25.0) is None  # closed with a turn still running
    task.load.in_flight = 0
    task.turns = 5  # taken back after a restart: 3 of its turns ran before it
    assert run_of(task, 25.0) is None
    failed = _task("c", turns=0)
    failed.status = TaskStatus.FAILED
    assert run_of(failed, 25.0) is None


def test_overlapping_turns_count_once_and_the_book_tells_who_closed() -> None:
    task = _task("c", turns=2)
    pace = task.load.pace
    pace.began(10.0, 0)
    pace.began(11.0, 1)  # a second turn while the first runs
    pace.ended(12.0, 1)
    pace.ended(13.0, 0)
    assert (pace.turns, pace.busy_s, pace.first_began_at, pace.last_ended_at) == (2, 3.0, 10, 13)
    told: list[TaskId] = []
    paces = TaskPaces(ManualClock(20.0), min_runs=1)
    task.status = TaskStatus.SUCCEEDED
    done = paces.hearing(told.append)
    done(task)
    assert told == [task.key]
    assert paces.reserve(task) == Reserve(7.0, 0.0, 1.5, 0.0, 7.0, 1)


def _task(task_class: str | None, *, turns: int) -> TaskState:
    state = TaskState(TaskId("a/t"), "t", A, 0.0, task_class=task_class)
    state.turns = turns
    return state
