"""The router's handle on one worker, whoever started it, and the feed from KV events to
the index.

Model of the world: a WorkerHandle is mutable shared state read by the router and written by
whoever watches the worker (the supervisor for workers it started, `external.py` for the
others): the current state, the `draining` flag (set: send nothing new), the restart count
and the last load reading. Only the event-loop thread writes it.

KV events arrive on one subscriber thread per worker, while resets also come from the
supervisor on the loop thread; KvIndexFeed puts one lock around the (single-threaded)
KvIndex so all of them, and the router's lookups, can share it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from appliance.domain.kv_events import KvEventBatch, Medium
from appliance.domain.kv_index import KvIndex
from appliance.domain.records import WorkerId
from appliance.domain.worker import (
    LoadSnapshot,
    WorkerPowerState,
    WorkerState,
    WorkerStatus,
    accepts_requests,
    power_state,
)
from appliance.engines.clients.vllm_client import VllmClient
from appliance.engines.errors import EngineError

T = TypeVar("T")
log = logging.getLogger(__name__)
KvBatchSink = Callable[[WorkerId, KvEventBatch], None]
KvResetSink = Callable[[WorkerId, str], None]


@dataclass(eq=False)
class WorkerHandle:
    id: WorkerId
    engine: str
    """"vllm" or "sim" (the supervisor's) or "external"."""
    url: str
    client: VllmClient
    kv_events_endpoint: str | None = None
    gpus: tuple[int, ...] = ()
    state: WorkerState = WorkerState.STARTING
    draining: bool = False
    restarts: int = 0
    pid: int | None = None
    load: LoadSnapshot | None = None
    load_error: str | None = None
    state_since: float = field(default_factory=time.monotonic)
    can_sleep: bool = False
    """It can be put ASLEEP: a vLLM worker started with sleep mode and its dev endpoints
    (`engine.sleep_mode`, the CUDA build), and every simulated worker. Every worker the
    supervisor starts can be STOPPED; an external one neither."""
    sleep_level: int | None = None
    """The level it sleeps at while ASLEEP (1 or 2), else None."""
    last_wake_s: float | None = None
    """How long its latest wake took, measured (None: never woken)."""

    @property
    def healthy(self) -> bool:
        return self.state == WorkerState.HEALTHY

    @property
    def power(self) -> WorkerPowerState:
        return power_state(self.state)

    @property
    def resting(self) -> bool:
        """Asleep, stopped or waking on request (`Supervisor.power`): not an outage."""
        return self.state in (WorkerState.ASLEEP, WorkerState.STOPPED, WorkerState.WAKING)

    @property
    def accepts_requests(self) -> bool:
        return accepts_requests(self.state) and not self.draining

    def set_state(self, state: WorkerState) -> None:
        if state != self.state:
            self.state = state
            self.state_since = time.monotonic()
            if state != WorkerState.ASLEEP:
                self.sleep_level = None

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            id=self.id,
            engine=self.engine,
            url=self.url,
            gpus=self.gpus,
            state=self.state,
            draining=self.draining,
            restarts=self.restarts,
            pid=self.pid,
            load=self.load,
            sleep_level=self.sleep_level,
            last_wake_s=self.last_wake_s,
        )

    async def refresh_load(self) -> LoadSnapshot | None:
        """Scrapes /metrics into `load`; on failure keeps the last reading and says why."""
        try:
            self.load = await self.client.load()
            self.load_error = None
        except EngineError as exc:
            self.load_error = exc.message
            return None
        return self.load


async def reported_model_len(workers: Sequence[WorkerHandle], model: str) -> int | None:
    """The smallest context limit (`max_model_len`) the healthy workers report for `model` in
    `/v1/models`, or None when none reports one. A worker started without
    `--max-model-len` takes the model's own limit, which only the worker knows."""
    limits = []
    for handle in workers:
        if not handle.healthy:
            continue
        try:
            cards = await handle.client.models()
        except EngineError as exc:
            log.warning("%s: /v1/models failed: %s", handle.id, exc.message)
            continue
        limits += [
            int(card["max_model_len"])
            for card in cards
            if card.get("id") == model and isinstance(card.get("max_model_len"), int)
        ]
    return min(limits, default=None)


class KvIndexFeed:
    """A KvIndex behind one lock, with the sink signatures the supervisor calls."""

    def __init__(self, index: KvIndex | None = None) -> None:
        self.index = index or KvIndex()
        self._lock = threading.Lock()
        self.resets: list[tuple[WorkerId, str]] = []

    def on_batch(self, worker: WorkerId, batch: KvEventBatch) -> None:
        with self._lock:
            self.index.apply_batch(worker, batch)

    def on_reset(self, worker: WorkerId, reason: str) -> None:
        with self._lock:
            self.index.forget_worker(worker)
            self.resets.append((worker, reason))

    def lookup(self, chain: Sequence[int], *, medium: str | None = None) -> dict[WorkerId, int]:
        with self._lock:
            return self.index.lookup(chain, medium=medium)

    def losses(self, worker: WorkerId) -> int:
        with self._lock:
            return self.index.losses(worker)

    def generation(self, worker: WorkerId) -> int:
        with self._lock:
            return self.index.generation(worker)

    def start_generations(self, last: Mapping[WorkerId, int]) -> None:
        with self._lock:
            self.index.start_generations(last)

    def gpu_blocks(self, worker: WorkerId) -> int:
        """Full blocks the index holds on the worker's GPU tier now (held, in use or cached)."""
        with self._lock:
            return self.index.worker_blocks(worker, medium=Medium.GPU)

    def read(self, fn: Callable[[KvIndex], T]) -> T:
        """Runs `fn` on the index under the lock (keep it short: events wait meanwhile)."""
        with self._lock:
            return fn(self.index)
