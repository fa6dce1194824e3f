"""The supervisor's sleep, stop and wake against a real simulated worker process, started
as vLLM is (same argv and environment, `python -m appliance.sim.entrypoints.vllm_entry` in vLLM's
place): the sim answers vLLM's sleep-mode endpoints and models the wake and the start.

One supervisor serves the module; the tests run in file order and the last shuts it down.
Durations are checked as lower bounds only (a wake never ends before its modelled time).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.domain.worker import PowerChange, WorkerEvent, WorkerEventKind, WorkerState
from appliance.engines.clients.workers import KvIndexFeed, WorkerHandle
from appliance.engines.errors import WorkerPowerRefused
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings
from appliance.engines.supervision.worker_process import group_alive
from tests.loop_thread import LoopThread
from tests.ports import free_port_block

WAKE_S = (0.3, 0.6)
STARTUP_S = 0.5
SIM = ("--sim-wake-s", f"{WAKE_S[0]},{WAKE_S[1]}", "--sim-startup-s", str(STARTUP_S))


def sim_spec(tmp_path: Path, *, sleep_mode: bool = True) -> LaunchSpec:
    return LaunchSpec(
        model="simm",
        served_model_name="simm",
        python=sys.executable,
        device=Device.CPU,
        base_port=free_port_block(1),
        kv_events_base_port=free_port_block(1),
        block_size=32,
        entrypoint=("-m", "appliance.sim.entrypoints.vllm_entry"),
        extra_args=SIM,
        sleep_mode=sleep_mode,
        extra_env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


class Box:
    def __init__(self, sup: Supervisor, feed: KvIndexFeed, events: list[WorkerEvent]) -> None:
        self.sup, self.feed, self.events = sup, feed, events
        self.groups: set[int] = set()

    @property
    def w0(self) -> WorkerHandle:
        return self.sup.workers[0]

    def kinds(self, since: int = 0) -> list[WorkerEventKind]:
        return [e.kind for e in self.events[since:]]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def box(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    feed, events = KvIndexFeed(), []
    sup = Supervisor(
        sim_spec(tmp_path_factory.mktemp("spec")),
        log_dir=tmp_path_factory.mktemp("logs"),
        on_event=events.append,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        timings=SupervisorTimings(
            startup_timeout_s=60, health_interval_s=0.2, restart_base_s=0.1, poll_s=0.05
        ),
    )
    loop.run(sup.start())
    b = Box(sup, feed, events)
    b.groups |= sup.process_groups()
    try:
        yield b
    finally:
        loop.run(sup.stop(drain_deadline_s=0))


def serve(loop: LoopThread, w: WorkerHandle, seed: int) -> dict:
    prompt = [(seed * 7919 + i * 31) % 4000 + 10 for i in range(96)]
    body = {"model": "simm", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    return loop.run(w.client.completions(body))


def wait_until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_drops_the_kv_and_the_wake_serves_again(
    box: Box, loop: LoopThread, level: int
) -> None:
    w0, wid = box.w0, box.w0.id
    serve(loop, w0, level)
    wait_until(lambda: box.feed.gpu_blocks(wid) >= 3)
    mark = len(box.events)

    slept = loop.run(box.sup.power.sleep(wid, level))
    assert slept == PowerChange(
        wid, WorkerState.HEALTHY, WorkerState.ASLEEP, slept.duration_s, level
    )
    assert (w0.state, w0.sleep_level, w0.accepts_requests) == (WorkerState.ASLEEP, level, False)
    assert w0.power.value == "asleep"
    assert loop.run(w0.client.is_sleeping())
    assert box.feed.gpu_blocks(wid) == 0  # the index forgot its KV at once
    assert box.feed.resets[-1] == (wid, f"put to sleep (level {level})")

    woken = loop.run(box.sup.power.wake(wid))
    assert (woken.before, woken.after, woken.level, woken.spawned) == (
        WorkerState.ASLEEP,
        WorkerState.HEALTHY,
        level,
        False,
    )
    assert woken.duration_s >= WAKE_S[level - 1]
    assert (w0.state, w0.sleep_level, w0.last_wake_s) == (
        WorkerState.HEALTHY,
        None,
        woken.duration_s,
    )
    assert not loop.run(w0.client.is_sleeping())
    answer = serve(loop, w0, level)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # slept: no cache
    assert box.kinds(mark) == [
        WorkerEventKind.SLEPT,
        WorkerEventKind.WAKE_STARTED,
        WorkerEventKind.WOKEN,
    ]
    slept_event, _, woken_event = box.events[mark:]
    assert (slept_event.level, woken_event.level) == (level, level)
    assert woken_event.duration_s == woken.duration_s


def test_a_stopped_worker_is_not_restarted_and_its_kv_is_forgotten(
    box: Box, loop: LoopThread
) -> None:
    w0, wid = box.w0, box.w0.id
    serve(loop, w0, 3)
    wait_until(lambda: box.feed.gpu_blocks(wid) >= 3)
    pid, mark = w0.pid, len(box.events)
    assert pid is not None

    stopped = loop.run(box.sup.power.stop(wid))
    assert (stopped.before, stopped.after) == (WorkerState.HEALTHY, WorkerState.STOPPED)
    assert (w0.state, w0.pid, w0.power.value) == (WorkerState.STOPPED, None, "stopped")
    assert not group_alive(pid)
    assert box.feed.gpu_blocks(wid) == 0
    assert box.feed.resets[-1] == (wid, "stopped on request")
    time.sleep(1.0)  # ten restart backoffs: a crash would have been restarted by now
    assert w0.state == WorkerState.STOPPED and w0.restarts == 0
    assert box.kinds(mark) == [WorkerEventKind.STOPPED_ON_REQUEST]


def test_concurrent_wakes_of_a_stopped_worker_start_it_once(box: Box, loop: LoopThread) -> None:
    w0, wid, mark = box.w0, box.w0.id, len(box.events)

    async def three_wakes() -> list[PowerChange]:
        return list(await asyncio.gather(*(box.sup.power.wake(wid) for _ in range(3))))

    a, b, c = loop.run(three_wakes())
    assert a is b is c
    assert (a.before, a.after, a.spawned, a.level) == (
        WorkerState.STOPPED,
        WorkerState.HEALTHY,
        True,
        None,
    )
    assert a.duration_s >= STARTUP_S
    assert box.kinds(mark).count(WorkerEventKind.STARTED) == 1
    assert box.kinds(mark)[0] == WorkerEventKind.WAKE_STARTED
    assert box.kinds(mark)[-1] == WorkerEventKind.WOKEN
    assert w0.state == WorkerState.HEALTHY and w0.pid is not None and w0.restarts == 0
    box.groups |= box.sup.process_groups()
    assert serve(loop, w0, 4)["usage"]["completion_tokens"] == 2


def test_a_woken_worker_is_watched_again(box: Box, loop: LoopThread) -> None:
    w0 = box.w0
    assert w0.pid is not None
    os.killpg(w0.pid, signal.SIGKILL)
    wait_until(lambda: w0.restarts == 1 and w0.state == WorkerState.HEALTHY)
    assert WorkerEventKind.EXITED in box.kinds()
    box.groups |= box.sup.process_groups()


def test_what_cannot_be_done_is_refused(box: Box, loop: LoopThread, tmp_path: Path) -> None:
    wid, mark = box.w0.id, len(box.events)
    awake = loop.run(box.sup.power.wake(wid))
    assert (awake.before, awake.after, awake.duration_s) == (
        WorkerState.HEALTHY,
        WorkerState.HEALTHY,
        0.0,
    )
    with pytest.raises(ValueError, match="sleep level"):
        loop.run(box.sup.power.sleep(wid, 3))
    assert box.kinds(mark) == []
    plain = Supervisor(sim_spec(tmp_path, sleep_mode=False), log_dir=tmp_path / "logs")
    assert not plain.workers[0].can_sleep
    with pytest.raises(WorkerPowerRefused, match="not started with sleep mode"):
        loop.run(plain.power.sleep(plain.workers[0].id, 1))
    with pytest.raises(WorkerPowerRefused, match="stopping"):  # never started
        loop.run(plain.power.stop(plain.workers[0].id))


def test_shutdown_with_a_stopped_worker_leaves_nothing(box: Box, loop: LoopThread) -> None:
    loop.run(box.sup.power.stop(box.w0.id))
    loop.run(box.sup.stop(drain_deadline_s=0))
    assert box.w0.state == WorkerState.STOPPED
    assert box.sup.process_groups() == frozenset()
    for pgid in box.groups:
        assert not group_alive(pgid)
    with pytest.raises(WorkerPowerRefused, match="stopping"):
        loop.run(box.sup.power.wake(box.w0.id))
