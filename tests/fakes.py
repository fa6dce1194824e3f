"""Small twins the tests share: a clock the test moves, a prefill cost easy to check by
hand, what the turn desk needs around it (a worker handle, a ledger that acknowledges every
record at once and keeps the turns, a KV index that answers what the test set), and the
desk wired over them as the daemon wires it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import TurnRecord, WorkerId
from appliance.domain.worker import LoadSnapshot
from appliance.policy.admission import AdmissionLimits
from appliance.policy.routing.core import default_profile
from appliance.services.sessions.chat_tokens import ChatTokens
from appliance.services.sessions.sessions import SessionState, SessionTable, TurnSubscriber
from appliance.services.tasks.admission import AdmissionService, WorkerEstimator
from appliance.services.tasks.task_paces import TaskPaces
from appliance.services.tasks.tasks import TaskBook
from appliance.services.turns.attempt_spans import AttemptSpans
from appliance.services.turns.desk_aides import TurnDeskAides
from appliance.services.turns.flights import Flights
from appliance.services.turns.placement import Placer, RoutingRule
from appliance.services.turns.queue_book import QueueBook
from appliance.services.turns.turn import TurnRequest
from appliance.services.turns.turn_desk import TurnDesk
from appliance.services.turns.turn_records import TurnRecords
from appliance.services.workers.worker_speed import WorkerSpeeds


class ManualClock:
    """`now()` is `t`; `sleep` and `advance` move it on without waiting, and ring the alarms
    (`alarm`: the turn desk's deadlines) that come due on the way."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self._alarms: list[tuple[float, int, Callable[[], None]]] = []
        self._armed = itertools.count()

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.t += seconds
        while self._alarms and self._alarms[0][0] <= self.t:
            heapq.heappop(self._alarms)[2]()

    @property
    def alarms(self) -> int:
        """Alarms armed and not yet rung."""
        return len(self._alarms)

    def alarm(self, when: float, call: Callable[[], None]) -> Callable[[], None]:
        """Rings at `when` once the clock reaches it (an alarm due already: at the next
        move); returns what disarms it."""
        entry = (when, next(self._armed), call)
        heapq.heappush(self._alarms, entry)

        def disarm() -> None:
            if entry in self._alarms:
                self._alarms.remove(entry)
                heapq.heapify(self._alarms)

        return disarm


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
        self.failing: str | None = None

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
    """A KV index that holds `blocks` leading blocks of any chain on each worker (on the
    host tier, medium "CPU": `host`)."""

    blocks: dict[WorkerId, int] = field(default_factory=dict)
    lost: dict[WorkerId, int] = field(default_factory=dict)
    lookups: int = 0
    host: dict[WorkerId, int] = field(default_factory=dict)
    generations: dict[WorkerId, int] = field(default_factory=dict)

    def lookup(self, chain: Any, *, medium: str | None = None) -> dict[WorkerId, int]:
        self.lookups += 1
        return self.host if medium == "CPU" else self.blocks

    def losses(self, worker: WorkerId) -> int:
        return self.lost.get(worker, 0)

    def generation(self, worker: WorkerId) -> int:
        return self.generations.get(worker, 0)

    def evict(self, worker: WorkerId, left: int, *, host: bool = False) -> None:
        """The worker lost blocks: `left` leading blocks of any chain remain (on its host
        tier with `host`)."""
        (self.host if host else self.blocks)[worker] = left
        self.lost[worker] = self.lost.get(worker, 0) + 1


@dataclass
class Wired:
    """A turn desk over test workers, and the parts a test reads through."""

    desk: TurnDesk
    queues: QueueBook
    index: Any
    ledger: AckLedger
    clock: ManualClock
    speeds: WorkerSpeeds
    """The measured speeds (the queue book reads them unless the test fixed a slowdown)."""
    tasks: TaskBook
    """The desk's task book (its closed tasks end their sessions, as the daemon wires it)."""


class FakeTurnTokenizer:
    """The desk's tokenizer port over a function of the turn: `ids` gives its prompt's ids
    (by default a completion's token-id `prompt`, else 40 ones), or raises; `estimate`
    (None by default: every turn is tokenised first)."""

    def __init__(
        self,
        ids: Callable[[TurnRequest], Sequence[int]] | None = None,
        estimate: Callable[[TurnRequest, SessionState | None], int | None] | None = None,
    ) -> None:
        self.ids = ids or _listed_prompt
        self._estimate = estimate

    def tokenize(
        self, turn: TurnRequest, previous: ChatTokens | None
    ) -> tuple[Sequence[int], ChatTokens | None]:
        return self.ids(turn), None

    def estimate(self, turn: TurnRequest, session: SessionState | None) -> int | None:
        return self._estimate(turn, session) if self._estimate is not None else None


def _listed_prompt(turn: TurnRequest) -> Sequence[int]:
    prompt = turn.body.get("prompt")
    return prompt if isinstance(prompt, list) else [1] * 40


def wired_desk(
    workers: list[RouterWorker],
    *,
    clock: ManualClock | None = None,
    index: Any = None,
    ledger: AckLedger | None = None,
    slowdown: dict[str, float] | None = None,
    block_size: int = 16,
    admission: bool = False,
    retention: Any = None,
    subscribers: Sequence[TurnSubscriber] = (),
    tokenizer: FakeTurnTokenizer | None = None,
) -> Wired:
    """The turn desk as the daemon wires it (queue book, turn records, placer, worker
    speeds), over fakes of the outside only: workers, the KV index, the ledger and the clock.
    `slowdown`: fixed per worker; without it, measured (`Wired.speeds`). `admission`: with
    the admission controller at its default limits, over the same estimates."""
    clock = clock or ManualClock(100.0)
    index = index if index is not None else FixedIndex()
    ledger = ledger or AckLedger()
    spans = AttemptSpans(clock)
    speeds = WorkerSpeeds(LinearCost(), spans)
    fixed = slowdown
    measured = speeds.slowdown if fixed is None else lambda w: fixed.get(w, 1.0)
    queues = QueueBook(LinearCost(), clock, measured, spans)
    sessions = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, block_size), subscribers=subscribers)
    placer = Placer(
        workers=lambda: workers,
        index=index,
        sessions=sessions,
        queues=queues,
        rule=RoutingRule(default_profile(), LinearCost(), "m"),
        salt=lambda t, c: f"salt-{t}",
        retention=retention,
    )
    paces = TaskPaces(clock)
    tasks = TaskBook(ledger, on_close=paces.hearing(sessions.forget_task))
    estimator = WorkerEstimator(lambda: workers, queues.queue_s, LinearCost(), measured)
    judge = AdmissionService(
        limits=AdmissionLimits(), tasks=tasks, estimator=estimator, ledger=ledger, clock=clock
    )
    desk = TurnDesk(
        sessions=sessions,
        placer=placer,
        queues=queues,
        records=TurnRecords(ledger, model="m"),
        tasks=tasks,
        clock=clock,
        workers=lambda: workers,
        aides=TurnDeskAides(
            admission=judge if admission else None,
            paces=paces,
            tokenizer=tokenizer or FakeTurnTokenizer(),
            flights=Flights(clock.alarm),  # deadlines ring as the test moves the clock
        ),
    )
    return Wired(desk, queues, index, ledger, clock, speeds, tasks)


async def read_request_body(reader: asyncio.StreamReader) -> bytes | None:
    """One HTTP/1.1 request's body as a fake worker reads it (Content-Length framing);
    None when the client has closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)
