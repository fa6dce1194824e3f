"""One simulated vLLM worker: engine, real-time loop, KV-event publisher, metrics and HTTP.

Model of the world: a worker is what one `vllm serve` process is to a router. `SimWorker`
owns a `SimEngine` (scheduler + prefix cache + latency model) and drives it with
`run_engine_loop` on a clock, so tokens come out when the modelled GPU would produce them;
`time_scale` stretches that clock (2.0: everything takes twice as long; 0.01: a hundred
times faster, for tests). Each engine step's KV events go out as one batch through
`KvEventPublisher` (vLLM's wire format; bind for `*`/`ipc://`, connect otherwise). Each
generation request is one or more engine requests (n choices, several prompts) whose
outputs are routed to per-request queues; closing a stream early aborts what is left.
Requests are timed on the worker's clock for the latency histograms of `/metrics`.
Given `retention` (the retention connector's settings, with its control endpoint), the
worker speaks the retention control protocol as a vLLM worker's connector does
(`sim/kv/retention.py`).

`serve_workers(n, base_port, ...)` (serving.py) runs n independent workers in one event
loop, worker i on HTTP port base_port + i and KV-event and retention endpoints port + i
(vLLM's data-parallel offset), which is what `appliance sim` starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from appliance.domain.block_hash import BlockHasher
from appliance.engines.retention.plugin import RetentionTuning
from appliance.engines.retention.protocol import RetentionRestore
from appliance.perf.kv_capacity import SIM_GPU_MEMORY_UTILIZATION, default_num_gpu_blocks
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile, load_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.engine_io import RequestOutput, SimRequest, StepResult
from appliance.sim.entrypoints.metrics import FinishedRequest, SimMetrics, cache_config_labels
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.kv_publisher import KvEventPublisher
from appliance.sim.kv.retention import SimRetention
from appliance.sim.runtime.clock import run_engine_loop
from appliance.sim.runtime.endpoints import resolve_endpoint
from appliance.sim.runtime.sleep_mode import SIM_WAKE_S, SleepMode
from appliance.tokenization.tokenizer import ModelTokenizer, load_tokenizer

log = logging.getLogger(__name__)
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What `vllm serve` flags would say about one worker."""

    served_model_name: str = "sim"
    model: str | None = None
    """A model directory: its tokenizer and chat template are used (else the fallback)."""
    host: str = "127.0.0.1"
    port: int = 8100
    block_size: int = 16
    num_gpu_blocks: int | None = None
    """KV cache size in blocks, null block included; None: from the GPU profile's memory."""
    num_host_blocks: int = 0
    """Blocks of host memory for KV (vLLM's `--kv-offloading-size`, native offloading: every
    cached prompt block is copied there, LRU); 0: no host tier."""
    gpu_memory_utilization: float = SIM_GPU_MEMORY_UTILIZATION
    max_model_len: int = 8192
    hash_algo: str = "sha256_cbor"
    python_hash_seed: str | None = "0"
    """PYTHONHASHSEED of the engine (None: unset, vLLM's fixed seed)."""
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    gpu_profile: str | Path | None = None
    """A calibration JSON, or None for the bundled profile."""
    time_scale: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    prompt_a_step: bool = False
    """Started with the appliance's `--scheduler-cls` (`engines/scheduling/`)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    output_mode: Literal["lorem", "echo"] = "lorem"
    """Generated tokens: word-like tokens drawn per request, or the prompt repeated."""
    natural_output_tokens: tuple[int, int] = (16, 256)
    """Range of a reply's length when the client set no max_tokens and not ignore_eos."""
    data_parallel_rank: int = 0
    enable_auto_tool_choice: bool = False
    """As `--enable-auto-tool-choice --tool-call-parser hermes`: every tool_choice is accepted
    and answered with tool calls (`sim/entrypoints/tool_calls.py`); without it vLLM's 400 is
    returned for any but "none"."""
    dev_mode: bool = False
    """vLLM's VLLM_SERVER_DEV_MODE=1: adds /reset_prefix_cache and sleep mode's routes."""
    wake_s: tuple[float, float] = SIM_WAKE_S
    """Seconds a wake from sleep level 1 and from level 2 takes (sleep_mode.py)."""
    startup_s: float = 0.0
    """Seconds a new process takes to answer /health (loading the model); 0: at once."""


class ScaledClock:
    """Real time stretched by `scale`: `now()` is simulated seconds, `sleep(s)` takes
    `s * scale` real seconds."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"time_scale must be positive, got {scale}")
        self.scale = scale

    def now(self) -> float:
        return time.monotonic() / self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0) * self.scale)


@dataclass(slots=True)
class _Timing:
    arrival_s: float
    max_tokens: int
    n: int
    token_times: list[float] = field(default_factory=list)


class SimWorker:
    """An engine driven in real time, with its publisher, tokenizer and metrics."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        tokenizer: ModelTokenizer | None = None,
        retention: RetentionTuning | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        profile = load_profile(config.gpu_profile) if config.gpu_profile else bundled_profile()
        self.latency = LatencyModel.from_profile(profile)
        blocks = config.num_gpu_blocks or default_num_gpu_blocks(
            profile, config.block_size, config.gpu_memory_utilization
        )
        self.num_gpu_blocks = blocks
        self.hasher = BlockHasher.for_engine(
            config.hash_algo, config.block_size, config.python_hash_seed
        )
        self.retention: SimRetention | None = None
        if retention is not None and retention.control_endpoint:
            self.retention = SimRetention(retention, block_size=config.block_size)
        host = HostTier(config.num_host_blocks) if config.num_host_blocks > 0 else None
        self.engine = SimEngine(
            _engine_config(config, blocks),
            hasher=self.hasher,
            latency=self.latency,
            host=host,
            output_token_ids=self._output_token,
            retention=self.retention,
        )
        self.clock = ScaledClock(config.time_scale)
        self.sleep_mode = SleepMode(self, config.wake_s)
        if self.retention is not None:
            self.retention.restorer = self._restore
        self.metrics = SimMetrics(
            model_name=config.served_model_name,
            max_model_len=config.max_model_len,
            engine=str(config.data_parallel_rank),
            cache_config=cache_config_labels(
                block_size=config.block_size,
                num_gpu_blocks=blocks,
                max_model_len=config.max_model_len,
                hash_algo=config.hash_algo,
                kv_cache_memory_bytes=blocks * config.block_size * profile.kv_bytes_per_token,
                gpu_memory_utilization=config.gpu_memory_utilization,
            ),
        )
        self.kv_events_endpoint = resolve_endpoint(config.kv_events_endpoint)
        self.publisher: KvEventPublisher | None = None
        digest = hashlib.sha256(repr(asdict(config)).encode()).hexdigest()[:8]
        self.system_fingerprint = f"vllm-{VLLM_VERSION}-{digest}"
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._timing: dict[str, _Timing] = {}
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._seq = 0

    # --- lifecycle ---

    async def start(self) -> None:
        """Open the publisher and the retention channel, and start the engine loop in the
        running event loop."""
        if self.kv_events_endpoint and self.publisher is None:
            self.publisher = KvEventPublisher(
                self.kv_events_endpoint,
                replay_endpoint=self.config.kv_events_replay_endpoint,
                topic=self.config.kv_events_topic,
                data_parallel_rank=self.config.data_parallel_rank,
            )
        if self.retention is not None:
            loop = asyncio.get_running_loop()
            self.retention.start(wake=lambda: loop.call_soon_threadsafe(self._wake.set))
        self._stop.clear()
        self._loop_task = asyncio.create_task(
            run_engine_loop(self.engine, self.clock, self._on_step, self._wake, self._stop),
            name=f"sim-engine-{self.config.port}",
        )

    def _restore(self, restore: RetentionRestore) -> bool:
        """A restore directive: the engine's prefetch from its host tier, kept until the
        directive's unix time (in the engine's seconds, which the time scale stretches)."""
        hold_s = max(0.0, restore.until_s - time.time()) / self.clock.scale
        blocks = self.engine.restore_blocks(restore.key)
        if blocks and self.retention is not None:
            self.retention.make_room_for_restore(restore.key, blocks, restore.priority)
        return self.engine.restore(restore.key, self.clock.now(), hold_s)

    async def stop(self) -> None:
        self._stop.set()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.retention is not None:
            self.retention.close()

    @property
    def healthy(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # --- generation ---

    def new_request_id(self, base: str) -> str:
        """An engine request id, unique like vLLM's (which appends random characters)."""
        self._seq += 1
        return f"{base}-{self._seq:08x}"

    async def generate(
        self, requests: Sequence[SimRequest], *, n_param: int = 1
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run engine requests; yield (index in `requests`, output) as steps produce them.
        Leaving the iteration early aborts the requests that have not finished. While the
        worker sleeps they wait for its wake (their latency counts the wait)."""
        arrival = self.clock.now()
        await self.sleep_mode.until_awake()
        now = self.clock.now()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        index = {r.request_id: i for i, r in enumerate(requests)}
        pending: set[str] = set()
        try:
            for r in requests:
                self._queues[r.request_id] = queue
                self._timing[r.request_id] = _Timing(arrival, r.max_tokens, n_param)
                r.arrival_s = now
                self.engine.add_request(r, now)
                pending.add(r.request_id)
            self._wake.set()
            while pending:
                out = await queue.get()
                if out.finished:
                    pending.discard(out.request_id)
                yield index[out.request_id], out
        finally:
            now = self.clock.now()
            for request_id in pending:
                self.engine.abort_request(request_id, now)
            if pending:
                self._wake.set()
            for r in requests:
                self._forget(r.request_id)

    def nudge(self) -> None:
        """Wake the engine loop (after work was added or aborted from outside it)."""
        self._wake.set()

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._timing.pop(request_id, None)

    def _on_step(self, result: StepResult) -> None:
        if self.publisher is not None and result.events:
            self.publisher.publish(result.events)
        self.metrics.observe_iteration(result.num_scheduled_tokens)
        now = self.clock.now()
        for out in result.outputs:
            timing = self._timing.get(out.request_id)
            if timing is not None and out.new_token_ids:
                timing.token_times.append(now)
            if out.finished and timing is not None:
                self._observe_finished(out, timing, now)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
            elif out.finished:  # aborted by a client that has gone
                self._forget(out.request_id)

    def _observe_finished(self, out: RequestOutput, t: _Timing, now: float) -> None:
        first = t.token_times[0] if t.token_times else None
        ttft = first - t.arrival_s if first is not None else None
        gaps = [b - a for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
        self.metrics.observe_request(
            FinishedRequest(
                prompt_tokens=out.num_prompt_tokens,
                generation_tokens=len(t.token_times),
                max_tokens=t.max_tokens,
                n=t.n,
                num_preemptions=0,
                prefill_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens,
                queue_s=0.0,
                ttft_s=ttft,
                e2e_s=now - t.arrival_s,
                prefill_s=ttft or 0.0,
                decode_s=now - first if first is not None else 0.0,
                inter_token_s=gaps,
            )
        )

    def _output_token(self, req: SimRequest, index: int) -> int:
        """The `index`-th generated token: a word token drawn per request, or the prompt."""
        if self.config.output_mode == "echo":
            special = self.tokenizer.special_ids()
            prompt = [t for t in req.prompt_token_ids if t not in special] or [0]
            return prompt[index % len(prompt)]
        words = self.tokenizer.word_token_ids
        seed = zlib.crc32(req.request_id.encode())
        return words[zlib.crc32(index.to_bytes(4, "little"), seed) % len(words)]

    def natural_length(self, request_id: str) -> int:
        """A reply's length when the model stops by itself (deterministic per id)."""
        lo, hi = self.config.natural_output_tokens
        return lo + zlib.crc32(request_id.encode()) % max(hi - lo + 1, 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and publish AllBlocksCleared at once; refused while a
        request holds blocks."""
        ok = self.engine.reset_prefix_cache()
        events = self.engine.cache.take_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)
        return ok

    # --- what the HTTP side reports ---

    def kv_event_sources(self) -> dict[str, Any]:
        if not self.kv_events_endpoint:
            return {}
        return {
            str(self.config.data_parallel_rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events_endpoint,
                "replay_endpoint": self.config.kv_events_replay_endpoint,
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": self.config.kv_events_topic,
            }
        }

    def metrics_text(self) -> str:
        return self.metrics.render(self.engine.stats, self.sleep_mode.gauge())


def _engine_config(config: WorkerConfig, num_blocks: int) -> EngineConfig:
    return EngineConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        prompt_a_step=config.prompt_a_step,
        policy=config.scheduling_policy,
    )
