"""An attempt's ledger rows (route decision, turn, cache receipt, session) are handed to the
ledger together once its answer is out, so the writer commits them in one transaction; a
failed attempt's decision is written with its failed turn row. A receipt names its worker's
cache generation at the attempt's placement. Attempt ids need no random draw."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from concurrent.futures import Future
from typing import Any

from appliance.domain.errors import EngineUnavailable
from appliance.domain.records import CacheReceipt, SessionId, TaskId, TenantId, WorkerId
from appliance.services.turns.turn import TurnRequest, new_turn_id
from tests.fakes import AckLedger, FixedIndex, RouterWorker, wired_desk


class RowLog(AckLedger):
    """Every row in the order it was handed over, with the worker's answers in between."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("record_"):
            return super().__getattr__(name)

        def record(row: Any) -> Future[Any]:
            self.seen.append(name.removeprefix("record_"))
            return super(RowLog, self).__getattr__(name)(row)

        return record

    def record_turn(self, record: Any) -> Future[Any]:
        self.seen.append("turn")
        return super().record_turn(record)


def turn() -> TurnRequest:
    return TurnRequest(
        TenantId("a"),
        "/v1/completions",
        {"model": "m"},
        list(range(100)),
        TaskId("a/t"),
        SessionId("s"),
    )


def test_an_attempts_rows_go_together_once_its_answer_is_out() -> None:
    ledger = RowLog()

    class Client:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            await asyncio.sleep(0)  # a loop turn or two while the worker works
            await asyncio.sleep(0)
            ledger.seen.append("answered")
            return b'{"usage": {"prompt_tokens": 100, "completion_tokens": 1}}'

    wired = wired_desk([RouterWorker(WorkerId("w0"), Client())], ledger=ledger)

    async def main() -> None:
        await wired.desk.handle(turn())
        await asyncio.sleep(0)  # the rows are written on the loop's next turn

    asyncio.run(main())
    assert ledger.seen == ["answered", "route_decision", "turn", "cache_receipt", "session"]


def test_a_failed_attempts_decision_goes_with_its_failed_turn() -> None:
    ledger = RowLog()

    class Down:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            raise EngineUnavailable("w0 is down")

    class Up:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            return b'{"usage": {"prompt_tokens": 100, "completion_tokens": 1}}'

    workers = [RouterWorker(WorkerId("w0"), Down()), RouterWorker(WorkerId("w1"), Up())]
    wired = wired_desk(workers, ledger=ledger)

    async def main() -> None:
        await wired.desk.handle(turn())
        await asyncio.sleep(0)

    asyncio.run(main())
    assert ledger.seen == [
        "route_decision",
        "turn",
        "session",  # no receipt for a failure
        "route_decision",
        "turn",
        "cache_receipt",
        "session",
    ]
    assert [t.worker for t in ledger.turns] == ["w0", "w1"]


class ReceiptLog(AckLedger):
    def __init__(self) -> None:
        super().__init__()
        self.receipts: list[CacheReceipt] = []

    def record_cache_receipt(self, receipt: CacheReceipt) -> Future[Any]:
        self.receipts.append(receipt)
        return super().__getattr__("record_cache_receipt")(receipt)


def test_a_receipt_names_its_workers_cache_generation_at_placement() -> None:
    """Worker w1 has reset its cache three times; a reset while an attempt runs leaves its
    receipt on the generation it was placed in, which is then stale."""
    ledger = ReceiptLog()
    index = FixedIndex(generations={WorkerId("w1"): 3})

    class Resets:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            index.generations[WorkerId("w1")] += 1  # reset while the worker computes
            return b'{"usage": {"prompt_tokens": 100, "completion_tokens": 1}}'

    wired = wired_desk([RouterWorker(WorkerId("w1"), Resets())], ledger=ledger, index=index)

    async def main() -> None:
        await wired.desk.handle(turn())
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [(r.worker, r.generation, r.token_count) for r in ledger.receipts] == [
        ("w1", 3, 96)  # six full blocks of 16 of the 100 tokens
    ]
    assert index.generation(WorkerId("w1")) == 4 > ledger.receipts[0].generation  # stale


def test_attempt_ids_are_32_hex_digits_and_never_repeat() -> None:
    ids = [new_turn_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len({i[:16] for i in ids}) == 1  # this process's prefix, then a serial number


def test_a_turn_row_carries_its_wait_before_the_worker_and_its_reasoning_tokens() -> None:
    """These stayed 0 on every live turn (the task issue's "costs that add up")."""
    ledger = AckLedger()

    class Thinking:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            return (
                b'{"usage": {"prompt_tokens": 100, "completion_tokens": 40, '
                b'"completion_tokens_details": {"reasoning_tokens": 25}}}'
            )

    wired = wired_desk([RouterWorker(WorkerId("w0"), Thinking())], ledger=ledger)
    waited = dataclasses.replace(turn(), received_at=time.monotonic() - 0.75)

    async def main() -> None:
        await wired.desk.handle(waited)
        await wired.desk.handle(turn())  # no arrival time: no wait to count
        await asyncio.sleep(0)

    asyncio.run(main())
    first, second = ledger.turns
    assert 0.75 <= first.queue_s < 5.0
    assert second.queue_s == 0.0
    assert (first.reasoning_tokens, first.output_tokens) == (25, 40)


def test_a_worker_that_says_more_reasoning_than_output_has_all_its_output_reasoning() -> None:
    """Reasoning tokens are a part of the output (vLLM's count), so they are priced once."""
    ledger = AckLedger()

    class Overthinking:
        async def post(self, path: str, body: Any, headers: Any = None) -> bytes:
            usage = {
                "prompt_tokens": 100,
                "completion_tokens": 40,
                "completion_tokens_details": {"reasoning_tokens": 55},
            }
            return json.dumps({"usage": usage}).encode()

    wired = wired_desk([RouterWorker(WorkerId("w0"), Overthinking())], ledger=ledger)
    asyncio.run(wired.desk.handle(turn()))
    (row,) = ledger.turns
    assert (row.reasoning_tokens, row.output_tokens) == (40, 40)
