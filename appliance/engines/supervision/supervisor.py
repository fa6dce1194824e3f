"""Starts the vLLM workers, keeps them running, and stops them without leaving a process.

Model of the world: each worker is one process group (its own session), so one signal
reaches vLLM and every process it spawned. `start()` checks first (preflight), binds the KV
event and retention control sockets (vLLM connects to them), spawns every worker and waits
for all /health 200s; if any fails, all are stopped and the error names the cause from the
worker's log. After that one watcher per worker waits on its process: an exit nobody asked
for is reported (WorkerEvent EXITED, the KV index is told to forget the worker, and
`retention`, the workers' retention connectors' control channels, that it holds nothing)
and the worker is started again after an exponential backoff (1, 2, 4 ... 30 s); once it
has exited more than `max_restarts_in_a_row` times in a row (staying up `stable_after_s`
starts the count anew) it stays FAILED. A health loop polls /health and /metrics every
`health_interval_s`: HEALTHY <-> UNHEALTHY, and a worker unhealthy for
`unhealthy_restart_s` is killed (then restarted).

`stop()` drains: every worker is marked `draining` (the router sends nothing new), requests
already running or waiting finish until vllm:num_requests_running + waiting reach 0 or the
drain deadline passes; then SIGTERM to each group, SIGKILL after `term_grace_s`, until no
member of any group is left. Orphans are also prevented when things go wrong: a failed
start, an exception or a cancelled task stops everything, an atexit hook SIGKILLs the
groups, and each worker asks the kernel to SIGTERM it should the appliance die.

Each worker's own steps (spawn, wait for /health, terminate, its state and events) are
appliance/engines/supervision/supervised_worker.py's; this decides when to take them. `power`
sleeps, stops and wakes workers on request (appliance/engines/supervision/power_control.py): a
worker stopped that way is STOPPED, not a crash, and nothing restarts it until it is woken.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import replace
from functools import partial
from pathlib import Path

import zmq

from appliance.domain.gpu import GpuSnapshot
from appliance.domain.kv_events import KvEventBatch
from appliance.domain.records import WorkerId
from appliance.domain.worker import (
    WORKER_KEEPALIVE_S,
    WorkerEvent,
    WorkerEventKind,
    WorkerState,
    restart_backoff_s,
)
from appliance.engines.clients.kv_events import KvEventSubscriber
from appliance.engines.clients.vllm_client import VllmClient
from appliance.engines.clients.workers import KvBatchSink, KvResetSink, WorkerHandle
from appliance.engines.errors import PortInUse, WorkerStartFailed
from appliance.engines.retention.client import RetentionClient
from appliance.engines.retention.plugin import plugin_path
from appliance.engines.supervision.launch import Device, LaunchSpec, plan_workers
from appliance.engines.supervision.power_control import PowerControl
from appliance.engines.supervision.preflight import preflight
from appliance.engines.supervision.supervised_worker import SupervisedWorker, SupervisorTimings
from appliance.engines.supervision.worker_process import reap_group, signal_group

log = logging.getLogger(__name__)
__all__ = ["Supervisor", "SupervisorTimings"]


class Supervisor:
    """The workers of one LaunchSpec. Use `async with Supervisor(...) as sup:` or start/stop."""

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        log_dir: Path,
        on_event: Callable[[WorkerEvent], None] | None = None,
        on_kv_batch: KvBatchSink | None = None,
        on_kv_reset: KvResetSink | None = None,
        timings: SupervisorTimings | None = None,
        gpu_snapshot: GpuSnapshot | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        if spec.retention is not None and spec.retention.python_path is None:
            path = str(log_dir / "retention-pythonpath")  # made in start()
            spec = replace(spec, retention=replace(spec.retention, python_path=path))
        self.spec = spec
        self.timings = timings or SupervisorTimings()
        self._log_dir = log_dir
        self._on_kv_batch = on_kv_batch
        self._on_kv_reset = on_kv_reset
        self._gpu_snapshot = gpu_snapshot
        plans = plan_workers(spec, os.environ if base_env is None else base_env)
        self._slots = [
            SupervisedWorker(
                plan,
                WorkerHandle(
                    id=plan.worker,
                    engine="sim" if spec.device == Device.SIM else "vllm",
                    url=plan.url,
                    client=VllmClient(
                        plan.url,
                        model=spec.served_model_name,
                        read_timeout_s=self.timings.request_timeout_s,
                        server_keepalive_s=WORKER_KEEPALIVE_S,
                    ),
                    kv_events_endpoint=plan.kv_events_endpoint,
                    gpus=plan.gpus,
                    can_sleep=spec.sleep_mode,
                ),
                log_dir / f"{plan.worker}.log",
                on_event,
            )
            for plan in plans
        ]
        self._started = False
        self._stopping = False
        self._stopped = False
        self._health_task: asyncio.Task[None] | None = None
        self.retention: RetentionClient | None = None
        """The workers' retention connectors, once started (None: they load none)."""
        self.power = PowerControl(
            self._slots,
            self.timings,
            forget=self._forget,
            watch=self._start_watch,
            stopping=lambda: self._stopping or not self._started,
        )
        """Sleep, stop and wake of single workers while they run."""

    # --- reading ---

    @property
    def workers(self) -> tuple[WorkerHandle, ...]:
        return tuple(s.handle for s in self._slots)

    @property
    def draining(self) -> bool:
        return self._stopping

    def worker(self, worker: WorkerId) -> WorkerHandle:
        return self._slot(worker).handle

    def log_path(self, worker: WorkerId) -> Path:
        return self._slot(worker).log_path

    def process_groups(self) -> frozenset[int]:
        """Every process group this supervisor ever started (for orphan checks)."""
        return frozenset(g for s in self._slots for g in s.pgids)

    def _slot(self, worker: WorkerId) -> SupervisedWorker:
        for slot in self._slots:
            if slot.handle.id == worker:
                return slot
        raise KeyError(worker)

    # --- lifecycle ---

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Preflight, spawn all, wait for every /health; on any failure nothing is left."""
        if self._started:
            raise RuntimeError("supervisor already started")
        self._started = True
        try:
            await asyncio.to_thread(preflight, self.spec, self._gpu_snapshot)
            self._log_dir.mkdir(parents=True, exist_ok=True)
            atexit.register(self.kill_now)
            self._subscribe()
            self._bind_retention()
            for slot in self._slots:
                await slot.spawn()
            deadline = time.monotonic() + self.timings.startup_timeout_s
            waits = [asyncio.create_task(self._await_healthy(s, deadline)) for s in self._slots]
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:  # one failed: do not wait for the others
                task.cancel()
            for task in done:
                task.result()
        except BaseException:
            self._stopping = True
            await self._shutdown()
            raise
        for slot in self._slots:
            self._start_watch(slot)
        self._health_task = asyncio.create_task(self._health_loop(), name="worker health")

    async def stop(self, *, drain_deadline_s: float | None = None) -> None:
        """Drain (up to the deadline), then terminate every group. Idempotent."""
        if self._stopped or not self._started:
            return
        self._stopping = True
        try:
            for slot in self._slots:
                slot.handle.draining = True
                if slot.move(WorkerState.DRAINING):
                    slot.emit(WorkerEventKind.DRAINING)
            deadline_s = (
                self.timings.drain_deadline_s if drain_deadline_s is None else drain_deadline_s
            )
            if deadline_s > 0:
                await self._drain(time.monotonic() + deadline_s)
        finally:
            await self._shutdown()

    async def _drain(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            busy = []
            for slot in self._slots:
                if slot.proc is None or slot.proc.returncode is not None:
                    continue
                load = await slot.handle.refresh_load()
                if load is not None and load.busy:
                    busy.append(slot.handle.id)
            if not busy:
                return
            await asyncio.sleep(self.timings.poll_s)
        log.warning("drain deadline passed with requests still running; terminating")

    async def _shutdown(self) -> None:
        try:
            waits = (t for s in self._slots for t in (s.watcher, s.wake_task))
            tasks = [t for t in (self._health_task, *waits) if t]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with suppress(asyncio.CancelledError, Exception):
                    await task
            await asyncio.gather(*(s.terminate(self.timings.term_grace_s) for s in self._slots))
        finally:
            self.kill_now()  # whatever is left, e.g. after a second cancellation
            if self.retention is not None:
                await self.retention.aclose()
                self.retention = None
            for slot in self._slots:
                if slot.subscriber is not None:
                    slot.subscriber.close()
                    slot.subscriber = None
                with suppress(Exception):
                    await slot.handle.client.aclose()
                if slot.handle.state != WorkerState.STOPPED:
                    slot.handle.set_state(WorkerState.STOPPED)
                    slot.handle.pid = None
                    if slot.proc is not None:  # never started: nothing to report
                        slot.emit(WorkerEventKind.STOPPED)
            self._stopped = True
            atexit.unregister(self.kill_now)

    def kill_now(self) -> None:
        """SIGKILL every group at once; synchronous, for atexit and last-resort cleanup."""
        for slot in self._slots:
            slot.kill_now()

    # --- while they run: KV events, restarts, health ---

    def _subscribe(self) -> None:
        if self._on_kv_batch is None and self._on_kv_reset is None:
            return
        for slot in self._slots:
            wid = slot.handle.id
            try:
                slot.subscriber = KvEventSubscriber(
                    slot.launch.kv_events_endpoint,
                    partial(self._kv_batch, wid),
                    on_reset=partial(self._kv_reset, wid),
                ).start()
            except zmq.ZMQError as exc:
                raise PortInUse(
                    f"cannot bind {slot.launch.kv_events_endpoint} for worker {wid}'s KV "
                    f"events ({exc}); choose another engine.kv_events_base_port"
                ) from None

    def _bind_retention(self) -> None:
        """The control channels' sockets, bound before the workers connect to them."""
        plan = self.spec.retention
        if plan is None:
            return
        assert plan.python_path is not None
        plugin_path(Path(plan.python_path))
        endpoints = {s.handle.id: plan.endpoint(s.launch.index) for s in self._slots}
        self.retention = RetentionClient(endpoints)
        try:
            self.retention.bind()
        except zmq.ZMQError as exc:
            raise PortInUse(
                f"cannot bind the retention control channel ({exc}); choose another "
                "engine.kv_retention_base_port"
            ) from None

    def _kv_batch(self, worker: WorkerId, batch: KvEventBatch) -> None:
        if self._on_kv_batch is not None:
            self._on_kv_batch(worker, batch)

    def _forget(self, slot: SupervisedWorker, reason: str) -> None:
        """Its KV is gone: the index forgets it, the retention view its holds."""
        self._kv_reset(slot.handle.id, reason)
        if self.retention is not None:
            self.retention.forget(slot.handle.id)

    def _start_watch(self, slot: SupervisedWorker) -> None:
        slot.watcher = asyncio.create_task(self._watch(slot), name=f"watch {slot.handle.id}")

    def _kv_reset(self, worker: WorkerId, reason: str) -> None:
        if self._on_kv_reset is not None:
            try:
                self._on_kv_reset(worker, reason)
            except Exception:
                log.exception("on_kv_reset failed for %s", worker)

    async def _await_healthy(self, slot: SupervisedWorker, deadline: float) -> None:
        t = self.timings
        await slot.await_healthy(deadline, timeout_s=t.startup_timeout_s, poll_s=t.poll_s)

    async def _watch(self, slot: SupervisedWorker) -> None:
        t = self.timings
        while slot.proc is not None:
            code = await slot.proc.wait()
            if self._stopping:
                return
            self._forget(slot, f"worker exited with code {code}")  # a restart holds nothing
            now = time.monotonic()
            if slot.healthy_since is not None and now - slot.healthy_since >= t.stable_after_s:
                slot.failures = 0
            slot.failures += 1
            slot.healthy_since = None
            slot.move(WorkerState.EXITED)
            slot.emit(WorkerEventKind.EXITED, exit_code=code, detail=slot.cause())
            slot.forget_group(await reap_group(slot.proc.pid, 1.0, slot.proc))
            if slot.failures > t.max_restarts_in_a_row:
                slot.move(WorkerState.FAILED)
                slot.emit(WorkerEventKind.GAVE_UP, detail=f"{slot.failures} exits in a row")
                return
            backoff = restart_backoff_s(
                slot.failures, base_s=t.restart_base_s, cap_s=t.restart_cap_s
            )
            slot.emit(WorkerEventKind.RESTART_SCHEDULED, backoff_s=backoff)
            await asyncio.sleep(backoff)
            if self._stopping:
                return
            slot.handle.restarts += 1
            try:
                await slot.spawn()
                await self._await_healthy(slot, time.monotonic() + t.startup_timeout_s)
            except WorkerStartFailed as exc:
                log.warning("%s", exc.message)
                if slot.proc is not None and slot.proc.returncode is None:
                    signal_group(slot.proc.pid, signal.SIGKILL)
            except OSError as exc:
                slot.move(WorkerState.FAILED)
                slot.emit(WorkerEventKind.GAVE_UP, detail=f"cannot spawn: {exc}")
                return

    async def _health_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.timings.health_interval_s)
            watched = (WorkerState.HEALTHY, WorkerState.UNHEALTHY)
            await asyncio.gather(
                *(self._check(s) for s in self._slots if s.handle.state in watched)
            )

    async def _check(self, slot: SupervisedWorker) -> None:
        handle = slot.handle
        ok = await handle.client.health(timeout_s=self.timings.health_timeout_s)
        if self._stopping or (not ok and not slot.running()):
            return  # it exited: the watcher reports that
        if ok:
            if handle.state == WorkerState.UNHEALTHY and slot.move(WorkerState.HEALTHY):
                slot.emit(WorkerEventKind.RECOVERED)
            await handle.refresh_load()
        elif handle.state == WorkerState.HEALTHY:
            if slot.move(WorkerState.UNHEALTHY):
                slot.emit(WorkerEventKind.UNHEALTHY, detail="/health did not answer 200")
        elif (
            handle.state == WorkerState.UNHEALTHY
            and time.monotonic() - handle.state_since > self.timings.unhealthy_restart_s
            and slot.proc is not None
        ):
            log.warning("worker %s unresponsive: killing it to restart it", handle.id)
            signal_group(slot.proc.pid, signal.SIGKILL)
