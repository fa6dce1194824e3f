"""One vLLM worker under the supervisor: its process group, its handle's state, and the
events that say what happened to it. appliance/engines/supervision/supervisor.py decides when to
start, restart and stop it; this does each step and keeps the worker's own record."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance.domain.records import WorkerId
from appliance.domain.worker import (
    PowerChange,
    WorkerEvent,
    WorkerEventKind,
    WorkerState,
    can_move,
)
from appliance.engines.clients.kv_events import KvEventSubscriber
from appliance.engines.clients.vllm_client import READ_TIMEOUT_S
from appliance.engines.clients.workers import WorkerHandle
from appliance.engines.errors import WorkerStartFailed
from appliance.engines.supervision.launch import WorkerLaunch
from appliance.engines.supervision.worker_process import (
    log_cause,
    process_running,
    signal_group,
    spawn,
    terminate_group,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SupervisorTimings:
    """The supervisor's waits and limits, in seconds (the restart counts excepted)."""

    startup_timeout_s: float = 900.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    unhealthy_restart_s: float = 60.0
    restart_base_s: float = 1.0
    restart_cap_s: float = 30.0
    max_restarts_in_a_row: int = 5
    stable_after_s: float = 120.0
    drain_deadline_s: float = 30.0
    term_grace_s: float = 15.0
    poll_s: float = 0.25
    request_timeout_s: float = READ_TIMEOUT_S
    """How long a worker may send nothing on a model request (`engine.request_timeout_s`)."""


class SupervisedWorker:
    def __init__(
        self,
        launch: WorkerLaunch,
        handle: WorkerHandle,
        log_path: Path,
        on_event: Callable[[WorkerEvent], None] | None = None,
    ) -> None:
        self.launch = launch
        self.handle = handle
        self.log_path = log_path
        self._on_event = on_event
        self.proc: asyncio.subprocess.Process | None = None
        self.pgids: set[int] = set()
        """The process groups it ran in that may still have a member."""
        self.log_offset = 0
        """Where the latest start's lines begin in the log."""
        self.failures = 0
        """Exits in a row."""
        self.healthy_since: float | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.subscriber: KvEventSubscriber | None = None
        self.power_lock = asyncio.Lock()
        """Held by a sleep, stop or wake of this worker: one at a time."""
        self.wake_task: asyncio.Task[PowerChange] | None = None
        """The wake in progress, which every caller of a wake awaits (single flight)."""

    @property
    def id(self) -> WorkerId:
        return self.handle.id

    async def spawn(self, state: WorkerState = WorkerState.STARTING) -> None:
        """Start its process; the handle is `state` meanwhile (WAKING for a wake)."""
        waking = state == WorkerState.WAKING
        self.proc, self.log_offset = await spawn(self.launch, self.log_path, waking=waking)
        self.pgids.add(self.proc.pid)
        self.handle.pid = self.proc.pid
        self.move(state)
        self.emit(WorkerEventKind.STARTED)

    async def await_healthy(self, deadline: float, *, timeout_s: float, poll_s: float) -> None:
        """Until /health answers 200; WorkerStartFailed if the process exits first or
        `deadline` passes (`timeout_s` is the wait the message names)."""
        proc, handle = self.proc, self.handle
        assert proc is not None
        started = time.monotonic()
        while True:
            if proc.returncode is not None:
                raise WorkerStartFailed(
                    f"worker {handle.id} exited with code {proc.returncode} during startup: "
                    f"{self.cause()} (log: {self.log_path})"
                )
            if await handle.client.health(timeout_s=2.0):
                break
            if time.monotonic() > deadline:
                raise WorkerStartFailed(
                    f"worker {handle.id} did not answer {handle.url}/health within "
                    f"{timeout_s:.0f}s (log: {self.log_path})"
                )
            await asyncio.sleep(poll_s)
        self.healthy_since = time.monotonic()
        self.move(WorkerState.HEALTHY)
        self.emit(WorkerEventKind.HEALTHY, detail=f"up in {time.monotonic() - started:.1f}s")

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM to its group, SIGKILL after `grace_s`."""
        if self.proc is not None:
            if self.proc.returncode is None:
                log.info("worker %s: SIGTERM", self.id)
            self.forget_group(await terminate_group(self.proc, grace_s))

    def forget_group(self, gone: bool) -> None:
        assert self.proc is not None
        if gone:
            self.pgids.discard(self.proc.pid)
        else:
            log.error("worker %s: group %d survived SIGKILL", self.id, self.proc.pid)

    def kill_now(self) -> None:
        """SIGKILL every group it may have left; synchronous."""
        for pgid in tuple(self.pgids):
            signal_group(pgid, signal.SIGKILL)

    def running(self) -> bool:
        proc = self.proc
        return proc is not None and proc.returncode is None and process_running(proc.pid)

    def move(self, state: WorkerState) -> bool:
        if not can_move(self.handle.state, state):
            return False
        self.handle.set_state(state)
        return True

    def emit(self, kind: WorkerEventKind, **fields: object) -> None:
        event = WorkerEvent(
            worker=self.handle.id,
            kind=kind,
            time=time.time(),
            state=self.handle.state,
            restarts=self.handle.restarts,
            pid=self.handle.pid,
            **fields,  # type: ignore[arg-type]
        )
        log.info("worker %s %s %s", event.worker, kind.value, event.detail)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("on_event failed for %s", event)

    def cause(self) -> str:
        """Why it failed, from its log since its latest start."""
        return log_cause(self.log_path, self.log_offset)
