"""Acceptance: the retention connector inside a real vLLM CPU worker started by the
appliance's supervisor, driven over its control channel.

One worker serves the module; the tests run in file order and the last one kills it. Its KV
pool is 8 MiB: 8192 tokens, 255 usable blocks of 32. A session's turn is a 1500-token
prompt (47 cached blocks with its 16 generated tokens); a flood is 16 other 1500-token
prompts, three times the pool, so anything not held is evicted. The weights are random:
nothing looks at generated text.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.domain.worker import WorkerState
from appliance.engines.launch import Device, LaunchSpec
from appliance.engines.retention.client import RetentionClient, WorkerRetention
from appliance.engines.retention.plugin import RetentionLaunch, RetentionTuning
from appliance.engines.retention.protocol import GiveBackReason, GivenBack, RetentionReport
from appliance.engines.supervisor import Supervisor, SupervisorTimings
from appliance.engines.workers import WorkerHandle
from tests.loop_thread import LoopThread
from tests.ports import free_port_block

pytestmark = pytest.mark.vllm
BLOCK = 32
KV_BYTES = 8 * 2**20
PROMPT = 1500
FLOOD = 16


class Worker:
    def __init__(self, sup: Supervisor, loop: LoopThread) -> None:
        self.sup, self.loop = sup, loop
        self.reports: list[RetentionReport] = []

    @property
    def handle(self) -> WorkerHandle:
        return self.sup.workers[0]

    @property
    def retention(self) -> RetentionClient:
        assert self.sup.retention is not None
        return self.sup.retention

    def complete(self, prompt: list[int], session: str, max_tokens: int = 16) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "session_id": session,  # as the appliance forwards it: "{tenant}/{session}"
        }
        return self.loop.run(self.handle.client.completions(body))

    def flood(self, seed: int) -> None:
        for i in range(FLOOD):
            self.complete(token_ids(seed + i, PROMPT), f"t/flood-{seed + i}")

    def given_back(self, key: str, incarnation: str | None = None) -> list[GivenBack]:
        """Everything reported given back for `key` (by one incarnation, if named)."""
        return [
            g
            for r in self.reports
            if incarnation in (None, r.incarnation)
            for g in r.given_back
            if g.key == key
        ]

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.05)

    def settle(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Sends 1-token requests until `predicate` holds: a directive takes effect at the
        worker's next scheduler step, and may reach it after a request's last step."""
        deadline = time.monotonic() + timeout_s
        poke = 0
        while not predicate():
            assert time.monotonic() < deadline, "condition not met in time"
            poke += 1
            self.complete(token_ids(10_000 + poke, 40), "t/poke", max_tokens=1)
            time.sleep(0.05)

    def view_when(self, predicate, timeout_s: float = 30.0) -> WorkerRetention:
        w = self.handle.id
        return self.loop.run(self.retention.wait_for(w, predicate, timeout_s), timeout_s + 5)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def worker(
    loop: LoopThread, vllm_python: str, tiny_model_dir: Path, tmp_path_factory
) -> Iterator[Worker]:
    spec = LaunchSpec(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        python=vllm_python,
        device=Device.CPU,
        base_port=free_port_block(1),
        kv_events_base_port=free_port_block(1),
        block_size=BLOCK,
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=4096,
        enforce_eager=True,
        cpu_ids=tuple(sorted(os.sched_getaffinity(0))),
        extra_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        retention=RetentionLaunch(
            free_port_block(1), tuning=RetentionTuning(report_interval_s=1.0)
        ),
    )
    sup = Supervisor(
        spec,
        log_dir=tmp_path_factory.mktemp("retention"),
        timings=SupervisorTimings(
            startup_timeout_s=180, health_interval_s=0.5, restart_base_s=0.2, poll_s=0.1
        ),
    )
    started = time.monotonic()
    loop.run(sup.start())
    print(f"worker with the retention connector up in {time.monotonic() - started:.1f}s")
    handle = Worker(sup, loop)

    async def record() -> None:
        async for _, report in handle.retention.reports():
            handle.reports.append(report)

    recorder = asyncio.run_coroutine_threadsafe(record(), loop.loop)
    try:
        yield handle
    finally:
        recorder.cancel()
        loop.run(sup.stop(drain_deadline_s=0))


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


def burst_body(prompt: list[int], session: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 200,
        "ignore_eos": True,
        "session_id": session,
    }


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_connector_says_hello_with_the_pool(worker: Worker) -> None:
    view = worker.view_when(lambda v: v.report is not None and v.report.pool_blocks > 0)
    assert view.report is not None
    assert view.report.pool_blocks == KV_BYTES // 1024 // BLOCK - 1  # 1 KiB of KV per token
    assert view.held == {} and view.restarts == 0
    assert worker.reports[0].seq == 0 and worker.reports[0].held == ()


def test_without_a_hold_a_flood_evicts_the_session(worker: Worker) -> None:
    prompt = token_ids(1, PROMPT)
    assert cached(worker.complete(prompt, "t/free")) == 0
    worker.flood(100)
    again = worker.complete([*prompt, *token_ids(2, 100)], "t/free")
    print(f"no hold: {cached(again)} of {PROMPT} cached after the flood")
    assert cached(again) <= 0.1 * PROMPT


def test_a_held_session_survives_a_flood(worker: Worker) -> None:
    w = worker.handle.id
    prompt = token_ids(3, PROMPT)
    assert cached(worker.complete(prompt, "t/held")) == 0
    assert worker.loop.run(worker.retention.hold(w, "t/held", time.time() + 120))
    worker.settle(lambda: "t/held" in worker.retention.view(w).held)
    worker.flood(200)
    assert worker.given_back("t/held") == []  # a give-back would have been reported
    assert worker.retention.view(w).held == {"t/held": (PROMPT + 16) // BLOCK}
    again = worker.complete([*prompt, *token_ids(4, 100)], "t/held")
    print(f"held: {cached(again)} of {PROMPT} cached after the flood")
    assert cached(again) >= 0.9 * PROMPT

    assert worker.loop.run(worker.retention.release(w, "t/held"))
    worker.settle(lambda: worker.given_back("t/held") != [])
    assert [g.reason for g in worker.given_back("t/held")] == [GiveBackReason.RELEASED]
    assert "t/held" not in worker.retention.view(w).held


def test_holds_give_way_in_priority_order_and_no_request_fails(worker: Worker) -> None:
    """Three held sessions (96 blocks), then four requests that need 216 of the 255 blocks
    at once: the lowest-priority holds are given back first, nothing is preempted."""
    w = worker.handle.id
    keys = {"t/low": 1.0, "t/mid": 2.0, "t/high": 3.0}
    for i, key in enumerate(keys):
        worker.complete(token_ids(10 + i, 1000), key)
    for key, priority in keys.items():
        assert worker.loop.run(worker.retention.hold(w, key, time.time() + 120, priority))
    worker.settle(lambda: set(keys) <= set(worker.retention.view(w).held))
    before = worker.loop.run(worker.handle.client.load())

    async def burst() -> list[dict[str, Any]]:
        client = worker.handle.client
        bodies = [burst_body(token_ids(30 + i, PROMPT), f"t/burst-{i}") for i in range(4)]
        return await asyncio.gather(*(client.completions(b) for b in bodies))

    replies = worker.loop.run(burst())
    assert [r["usage"]["completion_tokens"] for r in replies] == [200] * 4
    after = worker.loop.run(worker.handle.client.load())
    assert after.since(before).preemptions == 0
    worker.wait(lambda: any(worker.given_back(k) for k in keys))
    given = [g for r in worker.reports for g in r.given_back if g.key in keys]
    print(f"given back under pressure: {[g.key for g in given]}")
    assert [g.key for g in given] == list(keys)[: len(given)]  # lowest priority first
    assert {g.reason for g in given} == {GiveBackReason.PRESSURE}


def test_a_killed_worker_comes_back_holding_nothing(worker: Worker) -> None:
    w, sup = worker.handle.id, worker.sup
    worker.complete(token_ids(50, 600), "t/doomed")
    assert worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    worker.settle(lambda: "t/doomed" in worker.retention.view(w).held)
    old = worker.retention.view(w)
    old_pid = worker.handle.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    gone = worker.view_when(lambda v: v.incarnation is None, timeout_s=30)
    assert gone.held == {}
    assert not worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    back = worker.view_when(lambda v: v.incarnation not in (None, old.incarnation), 180)
    assert back.restarts == 1 and back.held == {}
    first = next(r for r in worker.reports if r.incarnation == back.incarnation)
    assert first.seq == 0 and first.held == () and first.given_back == ()
    deadline = time.monotonic() + 180
    while worker.handle.state != WorkerState.HEALTHY:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert sup.workers[0].restarts == 1
    # The restarted worker never ran the session: a hold finds nothing to hold.
    assert worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    worker.settle(lambda: worker.given_back("t/doomed", back.incarnation) != [])
    [answer] = worker.given_back("t/doomed", back.incarnation)
    assert (answer.blocks, answer.reason) == (0, GiveBackReason.NOT_FOUND)
