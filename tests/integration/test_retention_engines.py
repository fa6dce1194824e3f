"""Acceptance: KV retention over its control channel, the same tests on both engines: a real
vLLM CPU worker that loads the retention connector, started by the appliance's supervisor
(marker `vllm`), and a simulated worker, the `appliance sim --retention-endpoint` process
`appliance up --engine sim` starts (always run: a few seconds). Each is driven through the
appliance's `RetentionClient`, bound before the worker starts.

One worker per engine serves the module; the tests run in file order and the last one kills
it. Both pools have 255 usable blocks of 32 (vLLM: 8 MiB of KV, 1 KiB per token; the sim:
`--num-gpu-blocks-override 256`). A session's turn is a 1500-token prompt (47 cached blocks
with its 16 generated tokens); a flood is 16 other 1500-token prompts, three times the
pool, so anything not held is evicted. Nothing looks at generated text. The supervisor
restarts a killed vLLM worker and tells the client; for the sim the test does both, as
nothing supervises a simulated worker.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.domain.records import WorkerId
from appliance.domain.worker import WorkerState
from appliance.engines.clients.vllm_client import VllmClient
from appliance.engines.retention.client import RetentionClient, WorkerRetention
from appliance.engines.retention.plugin import RetentionLaunch, RetentionTuning
from appliance.engines.retention.protocol import GiveBackReason, GivenBack, RetentionReport
from appliance.engines.scheduling import SCHEDULER_CLS
from appliance.engines.supervision.launch import Device, LaunchSpec, worker_id
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings
from tests.loop_thread import LoopThread
from tests.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
KV_BYTES = 8 * 2**20
POOL = 255
PROMPT = 1500
FLOOD = 16
SIM_TIME_SCALE = 0.2  # steps a fifth of the modelled H200's time: the burst still overlaps


class Worker:
    """One worker, the appliance's end of its control channel, and every report it sent."""

    def __init__(self, loop: LoopThread, wid: WorkerId) -> None:
        self.loop, self.id = loop, wid
        self.reports: list[RetentionReport] = []

    # --- what each engine's harness provides ---

    @property
    def client(self) -> VllmClient:
        raise NotImplementedError

    @property
    def retention(self) -> RetentionClient:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    @property
    def restarts(self) -> int:
        raise NotImplementedError

    def exited(self) -> None:
        """The worker was killed: what its supervisor does when it notices."""

    def restart(self) -> None:
        """What its supervisor does next: start it again."""

    def serving(self, timeout_s: float) -> None:
        """Back and serving after a restart."""
        raise NotImplementedError

    # --- the tests' steps ---

    def record(self) -> asyncio.Future[None]:
        async def record() -> None:
            async for _, report in self.retention.reports():
                self.reports.append(report)

        return asyncio.run_coroutine_threadsafe(record(), self.loop.loop)

    def complete(self, prompt: list[int], session: str, max_tokens: int = 16) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "session_id": session,  # as the appliance forwards it: "{tenant}/{session}"
        }
        return self.loop.run(self.client.completions(body))

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
        return self.loop.run(self.retention.wait_for(self.id, predicate, timeout_s), timeout_s + 5)


class VllmWorker(Worker):
    """A vLLM worker under the appliance's supervisor, which restarts it and tells the
    retention client when it exits."""

    def __init__(self, loop: LoopThread, sup: Supervisor) -> None:
        super().__init__(loop, sup.workers[0].id)
        self.sup = sup

    @property
    def client(self) -> VllmClient:
        return self.sup.workers[0].client

    @property
    def retention(self) -> RetentionClient:
        assert self.sup.retention is not None
        return self.sup.retention

    @property
    def pid(self) -> int | None:
        return self.sup.workers[0].pid

    @property
    def restarts(self) -> int:
        return self.sup.workers[0].restarts

    def serving(self, timeout_s: float) -> None:
        self.wait(lambda: self.sup.workers[0].state == WorkerState.HEALTHY, timeout_s)


class SimProcess(Worker):
    """An `appliance sim` process, as `appliance up --engine sim` starts one, with the
    retention endpoint it would pass; the test plays the supervisor."""

    def __init__(self, loop: LoopThread, log_dir: Path) -> None:
        super().__init__(loop, WorkerId("w0"))
        port, control = free_port_block(1), free_port_block(1)
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [
            sys.executable,
            "-m",
            "cli.main",
            "sim",
            "--workers",
            "1",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            str(POOL + 1),
            "--max-model-len",
            "4096",
            "--time-scale",
            str(SIM_TIME_SCALE),
            "--retention-endpoint",
            f"tcp://127.0.0.1:{control}",
        ]
        self.log_dir = log_dir
        self._retention = RetentionClient({self.id: f"tcp://127.0.0.1:{control}"})
        loop.run(self._bind())
        self._client = VllmClient(self.url, model="tiny")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def _bind(self) -> None:
        self._retention.bind()

    @property
    def client(self) -> VllmClient:
        return self._client

    @property
    def retention(self) -> RetentionClient:
        return self._retention

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def restarts(self) -> int:
        return self.starts - 1

    def start(self) -> SimProcess:
        self.starts += 1
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with (self.log_dir / f"sim-{self.starts}.log").open("wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=log, cwd=ROOT)
        self.serving(60)
        return self

    def exited(self) -> None:
        assert self.proc is not None
        self.proc.wait(10)

        async def forget() -> None:
            self._retention.forget(self.id)

        self.loop.run(forget())

    def restart(self) -> None:
        self.start()

    def serving(self, timeout_s: float) -> None:
        def health() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "the sim exited"
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait(health, timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.loop.run(self._retention.aclose())
        self.loop.run(self._client.aclose())


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def worker(
    request: pytest.FixtureRequest, loop: LoopThread, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    if request.param == "sim":
        sim = SimProcess(loop, tmp_path_factory.mktemp("retention-sim"))
        recorder = sim.record()
        try:
            yield sim.start()
        finally:
            recorder.cancel()
            sim.stop()
        return
    yield from vllm_worker(request, loop, tmp_path_factory)


def vllm_worker(
    request: pytest.FixtureRequest, loop: LoopThread, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    vllm_python: str = request.getfixturevalue("vllm_python")
    tiny_model_dir: Path = request.getfixturevalue("tiny_model_dir")
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
        # A threshold: the worker also loads the appliance's scheduler (`--scheduler-cls`),
        # from the same plugin directory as the connector, as a GPU worker does.
        long_prefill_token_threshold=256,
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
    log = sup.log_path(worker_id(0)).read_text(errors="replace")
    assert f"Using custom scheduler class {SCHEDULER_CLS}" in log, "vLLM's own scheduler ran"
    handle = VllmWorker(loop, sup)
    recorder = handle.record()
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


def test_the_worker_says_hello_with_the_pool(worker: Worker) -> None:
    view = worker.view_when(lambda v: v.report is not None and v.report.pool_blocks > 0)
    assert view.report is not None
    assert view.report.pool_blocks == POOL
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
    w = worker.id
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
    """Three held sessions (93 blocks), then four requests that need 216 of the 255 blocks
    at once: the lowest-priority holds are given back first, nothing is preempted."""
    w = worker.id
    keys = {"t/low": 1.0, "t/mid": 2.0, "t/high": 3.0}
    for i, key in enumerate(keys):
        worker.complete(token_ids(10 + i, 1000), key)
    for key, priority in keys.items():
        assert worker.loop.run(worker.retention.hold(w, key, time.time() + 120, priority))
    worker.settle(lambda: set(keys) <= set(worker.retention.view(w).held))
    before = worker.loop.run(worker.client.load())

    async def burst() -> list[dict[str, Any]]:
        bodies = [burst_body(token_ids(30 + i, PROMPT), f"t/burst-{i}") for i in range(4)]
        return await asyncio.gather(*(worker.client.completions(b) for b in bodies))

    replies = worker.loop.run(burst())
    assert [r["usage"]["completion_tokens"] for r in replies] == [200] * 4
    after = worker.loop.run(worker.client.load())
    assert after.since(before).preemptions == 0
    worker.wait(lambda: any(worker.given_back(k) for k in keys))
    given = [g for r in worker.reports for g in r.given_back if g.key in keys]
    print(f"given back under pressure: {[g.key for g in given]}")
    assert [g.key for g in given] == list(keys)[: len(given)]  # lowest priority first
    assert {g.reason for g in given} == {GiveBackReason.PRESSURE}


def test_a_killed_worker_comes_back_holding_nothing(worker: Worker) -> None:
    w = worker.id
    worker.complete(token_ids(50, 600), "t/doomed")
    assert worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    worker.settle(lambda: "t/doomed" in worker.retention.view(w).held)
    old = worker.retention.view(w)
    old_pid = worker.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    worker.exited()
    gone = worker.view_when(lambda v: v.incarnation is None, timeout_s=30)
    assert gone.held == {}
    assert not worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    worker.restart()
    back = worker.view_when(lambda v: v.incarnation not in (None, old.incarnation), 180)
    assert back.restarts == 1 and back.held == {}
    first = next(r for r in worker.reports if r.incarnation == back.incarnation)
    assert first.seq == 0 and first.held == () and first.given_back == ()
    worker.serving(180)
    assert worker.restarts == 1
    # The restarted worker never ran the session: a hold finds nothing to hold.
    assert worker.loop.run(worker.retention.hold(w, "t/doomed", time.time() + 120))
    worker.settle(lambda: worker.given_back("t/doomed", back.incarnation) != [])
    [answer] = worker.given_back("t/doomed", back.incarnation)
    assert (answer.blocks, answer.reason) == (0, GiveBackReason.NOT_FOUND)
