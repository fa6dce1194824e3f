"""The router's queue estimate: its own requests in a stale worker reading are not load;
requests the worker reports waiting beyond those the book counts are, at the worker's mean
prefill (fresh over cached; its mean prompt before any finished), its own past their
estimate included; a request it sent counts only for the
prefill the worker cannot have done yet."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from appliance.domain.records import SessionId, TaskId, TenantId, TurnId, WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.turn import TurnRequest
from tests.fakes import FakeTurnTokenizer, LinearCost, ManualClock, RouterWorker, Wired, wired_desk


@dataclass
class Client:
    clock: ManualClock

    async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
        self.clock.t += 1.0  # the worker takes a second
        return b'{"usage": {"prompt_tokens": 100, "completion_tokens": 1}}'


def reading(at: float, waiting: int, mean_prompt: int = 1000) -> LoadSnapshot:
    return LoadSnapshot(
        time=at,
        running=0,
        waiting=waiting,
        kv_cache_usage_perc=0.0,
        prompt_tokens=mean_prompt * 4,
        ttft_count=4,
    )


def setup(
    slowdown: dict[str, float] | None = None, tokenizer: FakeTurnTokenizer | None = None
) -> tuple[Wired, list[RouterWorker]]:
    clock = ManualClock(100.0)
    workers = [RouterWorker(WorkerId(w), Client(clock)) for w in ("w0", "w1")]
    return wired_desk(workers, clock=clock, slowdown=slowdown, tokenizer=tokenizer), workers


def turn() -> TurnRequest:
    return TurnRequest(
        TenantId("a"),
        "/v1/completions",
        {"model": "m"},
        list(range(100)),
        TaskId("a/t"),
        SessionId("s"),
    )


def queue_scores(wired: Wired) -> dict[str, float]:
    session = wired.desk.sessions.open(TenantId("a"), SessionId("s"), 0.0)
    decision = wired.desk.placer.place(turn(), session).decision
    return {c.worker: c.scores["queue"] for c in decision.candidates}


def test_the_routers_own_request_in_a_stale_reading_is_not_load() -> None:
    wired, (w0, w1) = setup()
    reply = asyncio.run(wired.desk.handle(turn()))  # runs on w0 from t=100 to t=101
    assert reply.headers["X-Appliance-Worker"] == "w0"
    w0.load, w1.load = reading(100.5, waiting=1), reading(100.5, waiting=0)
    assert queue_scores(wired) == {"w0": 1.0, "w1": 1.0}


def test_waiting_requests_that_are_not_the_routers_count_at_the_mean_prompt() -> None:
    wired, (w0, w1) = setup()
    asyncio.run(wired.desk.handle(turn()))
    w0.load, w1.load = reading(100.5, waiting=4), reading(100.5, waiting=0)
    scores = queue_scores(wired)
    # 3 foreign requests x 1000 tokens x 1 ms = 3 s queued, the scale of this decision.
    assert scores["w0"] == 0.0 and scores["w1"] == 1.0


def test_a_turn_in_flight_counts_only_for_the_prefill_the_worker_may_still_have_to_do() -> None:
    wired, (w0, _) = setup()
    clock = w0.client.clock
    answered: asyncio.Future[bytes]

    async def held(path: str, body: Any, headers: Any = None) -> bytes:
        return await answered  # a non-streamed answer: no first byte until it is whole

    w0.client.post = held  # type: ignore[method-assign]
    first_s = LinearCost().prefill_s(100, 0)  # 100 fresh tokens at 1 ms: 0.1 s
    second_s = LinearCost().prefill_s(4, 96)  # the same prompt, 6 blocks resident

    async def main() -> list[float]:
        nonlocal answered
        answered = asyncio.get_running_loop().create_future()
        first = asyncio.create_task(wired.desk.handle(turn()))
        await asyncio.sleep(0)
        seen = [wired.queues.queue_s(w0)]
        clock.t += 0.06
        seen.append(wired.queues.queue_s(w0))
        wired.index.blocks = {w0.id: 6}
        second = asyncio.create_task(wired.desk.handle(turn()))  # queued behind the first
        await asyncio.sleep(0)
        seen.append(wired.queues.queue_s(w0))
        clock.t += 0.02
        seen.append(wired.queues.queue_s(w0))
        clock.t += 0.1
        seen.append(wired.queues.queue_s(w0))
        answered.set_result(b"{}")
        await asyncio.gather(first, second)
        return seen

    expected = [first_s, 0.04, 0.04 + second_s, 0.02 + second_s, 0.0]
    assert asyncio.run(main()) == pytest.approx(expected)


def test_a_slow_workers_queue_is_the_prefill_at_its_measured_speed() -> None:
    wired, (w0, w1) = setup(slowdown={"w0": 20.0, "w1": 20.0})  # alike: w0 gets it
    answered: asyncio.Future[bytes]

    async def held(path: str, body: Any, headers: Any = None) -> bytes:
        return await answered

    w0.client.post = held  # type: ignore[method-assign]
    clock = w0.client.clock

    async def main() -> list[float]:
        nonlocal answered
        answered = asyncio.get_running_loop().create_future()
        first = asyncio.create_task(wired.desk.handle(turn()))
        await asyncio.sleep(0)
        clock.t += 1.0  # the profile's 0.1 s would be long done; 20x slower it is not
        seen = [wired.queues.queue_s(w0), wired.queues.queue_s(w1)]
        w0.load = reading(clock.t, waiting=2)  # one of them is the router's own
        seen.append(wired.queues.queue_s(w0))
        answered.set_result(b"{}")
        await first
        return seen

    # 100 fresh tokens x 1 ms x 20 = 2 s, 1 s of it done; one foreign request of 1000
    # tokens x 1 ms x 20 = 20 s on top.
    assert asyncio.run(main()) == pytest.approx([1.0, 0.0, 21.0])


def book_and_worker() -> tuple[QueueBook, ManualClock, RouterWorker]:
    clock = ManualClock(100.0)
    return QueueBook(LinearCost(), clock), clock, RouterWorker(WorkerId("w0"), None)


def test_the_routers_own_request_still_waiting_past_its_estimate_is_load() -> None:
    # A worker whose KV cache is full holds a request back until running ones end: long
    # after the book's estimate of its prefill ran out, the worker still reports it waiting.
    book, clock, w0 = book_and_worker()
    book.sent(w0.id, TurnId("a"), 0.1, 100.0, streamed=False)
    clock.t = 102.0
    assert book.queue_s(w0) == 0.0  # no reading: the book alone thinks it done
    w0.load = reading(102.0, waiting=1)
    assert book.queue_s(w0) == pytest.approx(1.0)  # 1000 tokens x 1 ms


def test_a_request_the_book_still_counts_is_not_counted_again_from_the_reading() -> None:
    book, clock, w0 = book_and_worker()
    book.sent(w0.id, TurnId("a"), 0.1, 100.0)
    w0.load = reading(100.0, waiting=1)  # that request
    clock.t = 100.05
    assert book.queue_s(w0) == pytest.approx(0.05)
    w0.load = reading(100.0, waiting=2)  # and one that is not the router's
    assert book.queue_s(w0) == pytest.approx(1.05)
    book.sent(w0.id, TurnId("b"), 0.1, 100.05)  # sent after the reading: not in it
    assert book.queue_s(w0) == pytest.approx(1.15)


def test_a_request_that_left_the_queue_since_the_reading_is_not_load() -> None:
    book, clock, w0 = book_and_worker()
    book.sent(w0.id, TurnId("a"), 0.1, 100.0)
    book.sent(w0.id, TurnId("b"), 0.1, 100.0)
    w0.load = reading(100.0, waiting=2)
    clock.t = 101.0
    book.first_byte(w0.id, TurnId("a"))  # streamed: its prefill is done
    book.ended(w0.id, TurnId("b"), failed=False)  # answered whole before the next reading
    clock.t = 102.0
    assert book.queue_s(w0) == 0.0
    book.ended(w0.id, TurnId("a"), failed=False)  # a second time: not another that left
    w0.load = reading(100.5, waiting=3)
    assert book.queue_s(w0) == pytest.approx(1.0)


def test_a_waiting_request_counts_at_the_workers_mean_fresh_prefill_once_one_finished() -> None:
    # Agent turns re-send a long prompt that is mostly cached: a waiting one costs its fresh
    # part. Counted at the whole prompt, every reading made an evenly loaded worker look
    # seconds busier than its sibling, and sessions moved off their prefixes for nothing.
    book, clock, w0 = book_and_worker()
    clock.t = 102.0
    w0.load = dataclasses.replace(
        reading(102.0, waiting=2),
        prefill_count=4,
        prefill_fresh_tokens=4 * 100,
        prefill_prompt_tokens=4 * 1000,
    )
    # 2 x (100 fresh tokens x 1 ms + 900 cached x 0.1 ms)
    assert book.queue_s(w0) == pytest.approx(0.38)


def test_a_streamed_attempt_past_its_estimate_counts_until_its_first_byte() -> None:
    """A streamed attempt with no first byte past its estimate is still prefilling: as long
    again as it has overrun, up to its estimate; a non-streamed one (no first byte until
    its end) lapses at its estimate."""
    clock = ManualClock(100.0)
    book = QueueBook(LinearCost(), clock)
    w0, w1 = WorkerId("w0"), WorkerId("w1")
    book.sent(w0, TurnId("long"), 10.0, 100.0)
    book.sent(w1, TurnId("whole"), 10.0, 100.0, streamed=False)
    clock.t = 104.0
    assert book.routed_s(w0, clock.t) == pytest.approx(6.0) == book.routed_s(w1, clock.t)
    clock.t = 113.0  # 3 s over its estimate
    assert book.routed_s(w0, clock.t) == pytest.approx(3.0)
    assert book.routed_s(w1, clock.t) == 0.0
    clock.t = 150.0
    assert book.routed_s(w0, clock.t) == pytest.approx(10.0)  # at most its estimate
    book.first_byte(w0, TurnId("long"))
    assert book.routed_s(w0, clock.t) == 0.0
