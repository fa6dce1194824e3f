"""Small twins the tests share: a clock the test moves, a prefill cost easy to check by
hand, and what a router needs around it (a worker handle, a ledger that acknowledges every
record at once and keeps the turns, a KV index that answers what the test set)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from appliance.domain.records import TurnRecord, WorkerId
from appliance.domain.worker import LoadSnapshot


class ManualClock:
    """`now()` is `t`; `sleep` moves it on without waiting."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


class LinearCost:
    """1 ms per fresh token plus 0.1 ms per reused token."""

    def prefill_s(self, fresh: int, reused: int = 0) -> float:
        return fresh * 1e-3 + reused * 1e-4


@dataclass
class RouterWorker:
    """A worker as the router reads it; `client` is whatever the test talks to."""

    id: WorkerId
    client: Any
    load: LoadSnapshot | None = None
    healthy: bool = True
    draining: bool = False


class AckLedger:
    """Acknowledges every record at once; keeps the turns for assertions."""

    def __init__(self) -> None:
        self.turns: list[TurnRecord] = []

    def record_turn(self, record: TurnRecord) -> Future[Any]:
        self.turns.append(record)
        return _acknowledged()

    def __getattr__(self, name: str) -> Any:
        return lambda *_: _acknowledged()


def _acknowledged() -> Future[Any]:
    done: Future[Any] = Future()
    done.set_result(None)
    return done


@dataclass
class FixedIndex:
    """A KV index that holds `blocks` leading blocks of any chain on each worker."""

    blocks: dict[WorkerId, int] = field(default_factory=dict)

    def lookup(self, chain: Any, *, medium: str | None = None) -> dict[WorkerId, int]:
        return self.blocks
