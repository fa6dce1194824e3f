"""The boundaries the services are written against. Concrete adapters live in
appliance.ledger, appliance.engines, appliance.gpu and appliance.sim; only the composition
root (appliance.start.bootstrap, daemon, wiring) names them. The models shared with the simulator
(appliance.perf, appliance.tokenization) reach the services the same way, through protocols
of their callers (`policy.routing.PrefillCost`, `api.turns.requests.Tokenizer`). This module
imports appliance.domain only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from appliance.domain.gpu import GpuSnapshot
from appliance.domain.records import (
    AdmissionEvent,
    ArchivedTask,
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
    WorkerId,
    WorkerPowerEvent,
)
from appliance.domain.retention import HostTierSize, RetainedKv, ReturnedKv
from appliance.domain.worker import LoadSnapshot, PowerChange


class Clock(Protocol):
    """Wall time in Unix seconds; replay passes a virtual clock with the same face."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class Ledger(Protocol):
    """The durable record of what happened. Every `record_*` queues one write and returns at
    once; its Future resolves after the transaction holding the write committed (the write
    is then acknowledged: it survives a crash of the process) or fails with LedgerError.

    The one writer applies writes in the order they were queued."""

    def record_task(self, task: TaskRecord) -> Future[None]: ...

    def record_task_event(self, event: TaskEvent) -> Future[None]:
        """A terminal event (succeeded/failed/cancelled) also closes the task; on a task that
        is not open it fails with LedgerError and records nothing."""
        ...

    def record_session(self, session: SessionRecord) -> Future[None]:
        """Inserts the session or updates its task, worker and last activity."""
        ...

    def record_turn(self, turn: TurnRecord) -> Future[float | None]:
        """Costs the turn with the price in effect at its end and resolves to that cost
        (None when no price was in effect)."""
        ...

    def record_cache_receipt(self, receipt: CacheReceipt) -> Future[None]: ...

    def record_cache_eviction(self, eviction: CacheEviction) -> Future[None]:
        """Marks the receipt of that prefix on that worker evicted, with its cause (a later
        receipt of the same prefix there clears the mark)."""
        ...

    def record_residency_event(self, event: ResidencyEvent) -> Future[None]: ...

    def record_admission_event(self, event: AdmissionEvent) -> Future[None]: ...

    def record_worker_power(self, event: WorkerPowerEvent) -> Future[None]: ...

    def record_route_decision(self, decision: RouteDecisionRecord) -> Future[None]: ...

    def set_price(self, price: Price) -> Future[PriceId]:
        """Stores a new price version, unless the latest version has the same rates (then it
        resolves to that version's id)."""
        ...

    @property
    def failing(self) -> str | None:
        """Why the last write transaction failed (a full disk), until one commits again."""
        ...

    def probe(self) -> Future[None]:
        """A write of nothing new: commits once the file takes writes again."""
        ...

    def flush(self, timeout_s: float | None = None) -> None:
        """Returns when every write queued before the call has committed."""
        ...

    def close(self) -> None: ...


class TaskArchive(Protocol):
    """The ledger's tasks, read back by id (ledger/task_history.py)."""

    def find(self, task_id: str) -> ArchivedTask | None:
        """The task (`task_id`: tenant/client id) as the ledger keeps it; None: never made.
        Raises LedgerError when the ledger cannot be read."""
        ...

    def tree(self, task_id: str) -> list[ArchivedTask]:
        """The task and its descendants, parents first; blocking (call it in a thread)."""
        ...


class GpuProbe(Protocol):
    """The GPUs and the host, one reading per call: NVML on a GPU host, the simulated
    engine's model of its GPUs under `--engine sim`."""

    def snapshot(self) -> GpuSnapshot: ...

    def close(self) -> None: ...


class StreamResponse(Protocol):
    """A worker's streaming HTTP answer, status already checked."""

    status_code: int

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, to relay unchanged."""
        ...


class EngineClient(Protocol):
    """One worker's OpenAI-compatible HTTP face (real vLLM or the simulator).

    Raises EngineUnavailable when the worker cannot be reached and EngineRequestError when it
    answers with an error status (both in appliance.domain.errors)."""

    async def post(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> bytes:
        """A non-streaming request's answer, as the worker sent it."""
        ...

    def open_stream(
        self, path: str, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[StreamResponse]: ...


class WorkerEndpoint(Protocol):
    """What the router reads of one worker; the supervisor or the sim keeps it current."""

    @property
    def id(self) -> WorkerId: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def load(self) -> LoadSnapshot | None: ...

    @property
    def client(self) -> EngineClient: ...


class KvLookup(Protocol):
    """The KV index as the router asks it: per worker, how many leading blocks of a chain of
    block hashes (event form) are resident."""

    def lookup(self, chain: Sequence[int], *, medium: str | None = None) -> dict[WorkerId, int]: ...

    def losses(self, worker: WorkerId) -> int:
        """A count that changes whenever the worker loses blocks (eviction, restart)."""
        ...

    def generation(self, worker: WorkerId) -> int:
        """The worker's cache generation: moves on whenever its whole cache is known gone
        (a reset, a restart, lost events, the worker lost)."""
        ...


class KvRetention(Protocol):
    """Holds on waiting sessions' KV inside the workers (`engine.kv_retention`: the retention
    connector each vLLM worker loads, its twin in each simulated worker, sim/kv/retention.py).
    Keys are `"{tenant}/{session}"`. A directive goes out at once and takes effect at the
    worker's next scheduler step; each returns False when it was not sent (no connector of
    that worker is connected). `controls` False: a retention that sends nothing (workers
    without `engine.kv_retention`, external vLLM), so the reaper's decisions are recorded
    but change nothing in the workers."""

    @property
    def controls(self) -> bool: ...

    async def hold(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        """Hold (or extend, or move to its newest request) `key`'s cached prefix until the
        unix time `until_s`; under pressure the lowest `priority` is given back first."""
        ...

    async def release(self, worker: WorkerId, key: str) -> bool:
        """Stop holding: the blocks are ordinary cached blocks, least recently used first."""
        ...

    async def evict_first(
        self, worker: WorkerId, key: str, keep_blocks: int = 0, drop_host: bool = False
    ) -> bool:
        """Stop holding, and evict the key's blocks before any other, past its first
        `keep_blocks` (a branch's inherited prefix: left to LRU); `drop_host`: drop their
        host-tier copies too."""
        ...

    async def demote(self, worker: WorkerId, key: str) -> bool:
        """Stop holding, copy the key's blocks to the worker's host tier (where its reports
        show one) and evict them first on the GPU."""
        ...

    async def restore(self, worker: WorkerId, key: str, until_s: float, priority: float) -> bool:
        """Bring `key`'s prefix back into HBM from the worker's host tier ahead of its next
        turn, and keep it there until the unix time `until_s` (a hold of `priority`)."""
        ...

    async def order(self, worker: WorkerId, priorities: Mapping[str, float]) -> bool:
        """New priorities for held keys."""
        ...

    def host_tier(self, worker: WorkerId) -> HostTierSize | None:
        """The worker's host tier as its latest report shows it; None: it has none, or no
        report."""
        ...

    def retained(self, worker: WorkerId) -> Mapping[str, RetainedKv]:
        """What the worker holds, as its latest report shows it (empty: nothing, or unknown)."""
        ...

    def kv_usage(self, worker: WorkerId) -> float | None:
        """Share of the worker's KV pool that requests and holds take (0..1; cached blocks
        nobody holds count as free), as its latest report shows it; None: no report."""
        ...

    def returned(self) -> AsyncIterator[ReturnedKv]:
        """Every hold a worker gives back, as its reports arrive (forever; one reader)."""
        ...


class WorkerPowerSwitch(Protocol):
    """Sleep, stop and wake of the workers the appliance started
    (engines/supervision/power_control.py). Each call returns the change as it happened, its
    duration measured; concurrent wakes of one worker share one wake. Refused (WorkerPowerRefused)
    from a state it cannot leave."""

    async def sleep(self, worker: WorkerId, level: int = 1) -> PowerChange: ...

    async def stop(self, worker: WorkerId) -> PowerChange: ...

    async def wake(self, worker: WorkerId) -> PowerChange: ...
