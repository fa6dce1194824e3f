"""The ledger for asyncio callers: the same writes, awaited instead of waited on."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TypeVar

from appliance.domain.records import (
    AdmissionEvent,
    CacheEviction,
    CacheReceipt,
    Price,
    PriceId,
    ResidencyEvent,
    RouteDecisionRecord,
    SessionRecord,
    TaskEvent,
    TaskRecord,
    TurnRecord,
)
from appliance.ledger.writer import LedgerWriter

T = TypeVar("T")


async def acknowledged(fut: Future[T]) -> T:
    """Await a ledger write. Shielded: a caller cancelled while waiting (a client hung up)
    must not withdraw the record of what it already did."""
    return await asyncio.shield(asyncio.wrap_future(fut))


class AsyncLedger:
    """Each method returns once its write committed; the event loop never blocks on the
    disk. `ledger` stays usable directly for fire-and-forget writes."""

    def __init__(self, ledger: LedgerWriter) -> None:
        self.ledger = ledger

    async def record_task(self, task: TaskRecord) -> None:
        await acknowledged(self.ledger.record_task(task))

    async def record_task_event(self, event: TaskEvent) -> None:
        await acknowledged(self.ledger.record_task_event(event))

    async def record_session(self, session: SessionRecord) -> None:
        await acknowledged(self.ledger.record_session(session))

    async def record_turn(self, turn: TurnRecord) -> float | None:
        return await acknowledged(self.ledger.record_turn(turn))

    async def record_cache_receipt(self, receipt: CacheReceipt) -> None:
        await acknowledged(self.ledger.record_cache_receipt(receipt))

    async def record_cache_eviction(self, eviction: CacheEviction) -> None:
        await acknowledged(self.ledger.record_cache_eviction(eviction))

    async def record_residency_event(self, event: ResidencyEvent) -> None:
        await acknowledged(self.ledger.record_residency_event(event))

    async def record_admission_event(self, event: AdmissionEvent) -> None:
        await acknowledged(self.ledger.record_admission_event(event))

    async def record_route_decision(self, decision: RouteDecisionRecord) -> None:
        await acknowledged(self.ledger.record_route_decision(decision))

    async def set_price(self, price: Price) -> PriceId:
        return await acknowledged(self.ledger.set_price(price))

    async def flush(self) -> None:
        await acknowledged(self.ledger.barrier())

    async def close(self) -> None:
        await asyncio.to_thread(self.ledger.close)
