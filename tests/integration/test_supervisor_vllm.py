"""Acceptance: real vLLM CPU workers started, watched and stopped by the supervisor.

One supervisor with two workers (one core each) serves the whole module; the tests run in
file order and the last one shuts it down. Each worker has a 4 MiB KV cache: 4096 tokens,
128 blocks of 32, twice max_model_len, so a few long prompts evict older blocks. Worker w0
carries the KV-index tests, w1 the multi-turn session and then the kill/restart. The weights
are random: nothing looks at generated text.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from appliance.domain.block_hash import BlockHasher
from appliance.domain.worker import PowerChange, WorkerEvent, WorkerEventKind, WorkerState
from appliance.engines.clients.workers import KvIndexFeed, WorkerHandle
from appliance.engines.errors import WorkerPowerRefused
from appliance.engines.external import connect_external
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.preflight import probe_vllm
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings
from appliance.engines.supervision.worker_process import group_alive
from tests.loop_thread import LoopThread
from tests.ports import free_port_block
from tests.processes import live_children_since

pytestmark = pytest.mark.vllm
BLOCK = 32
KV_BYTES = 4 * 2**20
MAX_LEN = 2048


class Workers:
    def __init__(self, sup: Supervisor, feed: KvIndexFeed, events: list[WorkerEvent]) -> None:
        self.sup, self.feed, self.events = sup, feed, events
        self.groups: set[int] = set()
        self.startup_s = 0.0
        self.started_at = 0.0
        """When the fixture began: every process the supervisor spawned is younger."""

    @property
    def w0(self) -> WorkerHandle:
        return self.sup.workers[0]

    @property
    def w1(self) -> WorkerHandle:
        return self.sup.workers[1]


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def workers(
    loop: LoopThread, vllm_python: str, tiny_model_dir: Path, tmp_path_factory
) -> Iterator[Workers]:
    t0 = time.time()
    install = probe_vllm(vllm_python)
    assert install.device == Device.CPU
    spec = LaunchSpec(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        python=vllm_python,
        device=install.device,
        workers=2,
        base_port=free_port_block(2),
        kv_events_base_port=free_port_block(2),
        block_size=BLOCK,
        hash_algo="sha256_cbor",
        python_hash_seed="0",
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=MAX_LEN,
        enforce_eager=True,
        cpu_ids=tuple(sorted(os.sched_getaffinity(0))),
        extra_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    feed = KvIndexFeed()
    events: list[WorkerEvent] = []
    sup = Supervisor(
        spec,
        log_dir=tmp_path_factory.mktemp("workers"),
        on_event=events.append,
        on_kv_batch=feed.on_batch,
        on_kv_reset=feed.on_reset,
        timings=SupervisorTimings(
            startup_timeout_s=180, health_interval_s=0.5, restart_base_s=0.2, poll_s=0.1
        ),
    )
    handle = Workers(sup, feed, events)
    handle.started_at = t0
    started = time.monotonic()
    loop.run(sup.start())
    handle.startup_s = time.monotonic() - started
    handle.groups |= sup.process_groups()
    try:
        yield handle
    finally:
        loop.run(sup.stop(drain_deadline_s=0))


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


def chain(ids: list[int]) -> tuple[int, ...]:
    return BlockHasher.for_engine("sha256_cbor", BLOCK, "0").chain(ids).event_hashes


def wait_until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_workers_are_healthy_pinned_and_serving(workers: Workers, loop: LoopThread) -> None:
    print(f"two workers healthy in {workers.startup_s:.1f}s")
    cpus = sorted(os.sched_getaffinity(0))
    for i, w in enumerate(workers.sup.workers):
        assert w.state == WorkerState.HEALTHY and w.accepts_requests
        assert loop.run(w.client.health())
        [model] = loop.run(w.client.models())
        assert (model["id"], model["max_model_len"]) == ("tiny", MAX_LEN)
        proc = psutil.Process(w.pid)
        expected = [cpus[i]] if len(cpus) >= 2 else cpus
        for p in (proc, *proc.children(recursive=True)):
            assert p.cpu_affinity() == expected, p
        assert proc.environ()["OMP_NUM_THREADS"] == str(len(expected))
        assert proc.environ()["PYTHONHASHSEED"] == "0"


def test_streamed_completion(workers: Workers, loop: LoopThread) -> None:
    body = {
        "model": "tiny",
        "prompt": token_ids(1, 100),
        "max_tokens": 12,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }

    async def go() -> list[dict]:
        return [c async for c in workers.w0.client.stream("/v1/completions", body)]

    chunks = loop.run(go())
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["usage"]["prompt_tokens"] == 100
    assert sum(1 for c in chunks if c["choices"]) >= 2


def test_external_engine_reaches_a_server_it_did_not_start(
    workers: Workers, loop: LoopThread
) -> None:
    async def go() -> tuple[WorkerState, int, str]:
        async with await connect_external([workers.w0.url], model="tiny") as engine:
            (handle,) = engine.workers
            assert handle.load is not None
            reply = await handle.client.completions(
                {"model": "tiny", "prompt": token_ids(2, 40), "max_tokens": 3}
            )
            return handle.state, handle.load.prompt_tokens, reply["usage"]["completion_tokens"]

    state, prompt_tokens, completion_tokens = loop.run(go())
    assert state == WorkerState.HEALTHY and prompt_tokens >= 100 and completion_tokens == 3


def test_cached_tokens_rise_and_the_index_predicts_them(workers: Workers, loop: LoopThread) -> None:
    """A growing conversation on w1: each turn hits the blocks the previous turns stored,
    exactly as many as the KV index (fed by w1's events) said before the turn was sent."""
    w1, feed = workers.w1, workers.feed
    messages: list[dict[str, str]] = []
    cached, predicted, lengths = [], [], []
    before = loop.run(w1.client.load())
    for turn in range(4):
        words = " ".join(f"step{turn}-{i} result ok" for i in range(30))
        messages.append({"role": "user", "content": words})
        ids = loop.run(w1.client.tokenize(messages=messages))
        hit_blocks = feed.lookup(chain(ids)).get(w1.id, 0)
        predicted.append(min(hit_blocks, (len(ids) - 1) // BLOCK) * BLOCK)
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "ignore_eos": True}
        reply = loop.run(w1.client.chat(body, headers={"X-Session-ID": "chat-1"}))
        usage = reply["usage"]
        assert usage["prompt_tokens"] == len(ids)
        lengths.append(len(ids))
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": f"tool call {turn}"})
        full = len(ids) // BLOCK
        wait_until(lambda ids=ids, full=full: feed.lookup(chain(ids)).get(w1.id, 0) >= full)
    print(f"prompt tokens per turn: {lengths}; cached: {cached}")
    assert cached[0] == 0
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    assert cached == predicted
    load = loop.run(w1.client.load()).since(before)
    assert load.prefix_cache_hits_tokens == sum(cached)
    assert load.prompt_tokens_by_source["local_cache_hit"] == sum(cached)


def test_index_learns_a_prompt_and_forgets_it_on_eviction(
    workers: Workers, loop: LoopThread
) -> None:
    w0, feed = workers.w0, workers.feed
    ids = token_ids(10, 1000)
    hashes = chain(ids)

    def complete(prompt: list[int], session: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        return loop.run(w0.client.completions(body, headers={"X-Session-ID": session}))

    assert complete(ids, "agent-A")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_until(lambda: feed.lookup(hashes) == {w0.id: len(hashes)})
    index = feed.index
    assert feed.read(lambda i: i.media(hashes[0])) == {w0.id: frozenset({"GPU"})}

    # 4 x 1500 new tokens through a 4096-token cache evict the oldest blocks first.
    removed_before = index.stats().removed
    for seed in range(20, 24):
        complete(token_ids(seed, 1500), f"flood-{seed}")
    wait_until(lambda: feed.lookup(hashes).get(w0.id, 0) == 0)
    assert index.stats().removed > removed_before
    # The engine agrees: the session's prefix is really gone.
    assert complete(ids, "agent-A")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_killed_worker_is_restarted_and_reported(workers: Workers, loop: LoopThread) -> None:
    w1, feed = workers.w1, workers.feed
    old_pid = w1.pid
    assert old_pid is not None and feed.read(lambda i: i.worker_blocks(w1.id)) > 0
    seen = len(workers.events)
    killed = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: w1.restarts == 1 and w1.state == WorkerState.HEALTHY, timeout_s=180)
    print(f"w1 back in {time.monotonic() - killed:.1f}s after SIGKILL")
    workers.groups |= workers.sup.process_groups() | {old_pid}
    new = [e for e in workers.events[seen:] if e.worker == w1.id]
    assert [e.kind for e in new] == [
        WorkerEventKind.EXITED,
        WorkerEventKind.RESTART_SCHEDULED,
        WorkerEventKind.STARTED,
        WorkerEventKind.HEALTHY,
    ]
    assert new[0].exit_code == -signal.SIGKILL and new[0].pid == old_pid
    assert new[2].restarts == 1 and new[2].pid == w1.pid != old_pid
    assert (w1.id, "worker exited with code -9") in feed.resets
    assert not group_alive(old_pid)
    assert workers.w0.restarts == 0 and workers.w0.healthy
    body = {"model": "tiny", "prompt": token_ids(30, 64), "max_tokens": 2}
    assert loop.run(w1.client.completions(body))["usage"]["completion_tokens"] == 2


def test_stopped_on_request_stays_stopped_until_woken_once(
    workers: Workers, loop: LoopThread
) -> None:
    """The reaper's stop and wake on the CPU build (which cannot sleep): not a crash, the
    KV forgotten, and three wakes at once start one process."""
    sup, w1, feed = workers.sup, workers.w1, workers.feed
    with pytest.raises(WorkerPowerRefused, match="cannot sleep"):
        loop.run(sup.power.sleep(w1.id, 1))
    body = {"model": "tiny", "prompt": token_ids(50, 96), "max_tokens": 2}
    loop.run(w1.client.completions(body))
    wait_until(lambda: feed.gpu_blocks(w1.id) > 0)
    old_pid, seen = w1.pid, len(workers.events)
    assert old_pid is not None

    stopped = loop.run(sup.power.stop(w1.id))
    assert (stopped.after, w1.state, w1.pid) == (WorkerState.STOPPED, WorkerState.STOPPED, None)
    assert feed.gpu_blocks(w1.id) == 0 and (w1.id, "stopped on request") in feed.resets
    assert not group_alive(old_pid)
    time.sleep(2.0)  # ten restart backoffs: a crash would have been restarted
    assert w1.state == WorkerState.STOPPED and w1.restarts == 1

    async def three_wakes() -> list[PowerChange]:
        return list(await asyncio.gather(*(sup.power.wake(w1.id) for _ in range(3))))

    a, b, c = loop.run(three_wakes())
    assert a is b is c and a.spawned and a.after == WorkerState.HEALTHY
    print(f"w1 woken from stopped in {a.duration_s:.1f}s")
    assert a.duration_s > 0 and w1.last_wake_s == a.duration_s
    new = [e.kind for e in workers.events[seen:] if e.worker == w1.id]
    assert new == [
        WorkerEventKind.STOPPED_ON_REQUEST,
        WorkerEventKind.WAKE_STARTED,
        WorkerEventKind.STARTED,
        WorkerEventKind.HEALTHY,
        WorkerEventKind.WOKEN,
    ]
    workers.groups |= sup.process_groups() | {old_pid}
    assert w1.state == WorkerState.HEALTHY and w1.pid not in (None, old_pid)
    assert loop.run(w1.client.completions(body))["usage"]["completion_tokens"] == 2


def test_drain_on_shutdown_finishes_the_stream_and_leaves_no_process(
    workers: Workers, loop: LoopThread
) -> None:
    sup, w0 = workers.sup, workers.w0
    workers.groups |= sup.process_groups()
    body = {
        "model": "tiny",
        "prompt": token_ids(40, 20),
        "max_tokens": 800,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }

    async def go() -> tuple[list[dict], float, bool]:
        chunks: list[dict] = []

        async def consume() -> None:
            async for chunk in w0.client.stream("/v1/completions", body):
                chunks.append(chunk)

        streaming = asyncio.create_task(consume())
        while len(chunks) < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        stopping = asyncio.create_task(sup.stop(drain_deadline_s=60))
        await asyncio.sleep(0.2)
        closed = not any(w.accepts_requests for w in sup.workers) and not streaming.done()
        await stopping
        await streaming
        return chunks, time.monotonic() - started, closed

    chunks, took_s, closed_while_streaming = loop.run(go())
    print(f"drained and stopped in {took_s:.1f}s")
    assert closed_while_streaming
    assert chunks[-1]["usage"]["completion_tokens"] == 800
    assert all(w.state == WorkerState.STOPPED for w in sup.workers)
    kinds = [e.kind for e in workers.events]
    assert kinds[-4:].count(WorkerEventKind.STOPPED) == 2
    for pgid in workers.groups:
        assert not group_alive(pgid), f"process group {pgid} left running"
    ours = live_children_since(workers.started_at)
    assert not ours, ours
