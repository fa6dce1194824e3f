"""Replay a trace through each routing policy on the same simulated workers.

Model of the world: N identical GPUs, each a `SimEngine` (vLLM's scheduler and prefix cache,
timed by the latency model fitted to one GPU profile) with a KV cache of `hbm_gib` per
worker (default: what vLLM would leave at gpu_memory_utilization 0.9 after bf16 weights).
The trace's arrivals come at their recorded times, in virtual time (`sim.runtime.virtual.replay`);
each one asks the policy under test which worker takes it (`routers.PolicyRouter`), and
every policy sees the same arrivals, the same prompts (block id -> fixed tokens), the same
engines and the same session ids. Engines run at block size 512, the trace's own block
granularity (vLLM's default 16 would also hit inside a turn's trimmed last block, and costs
32x the bookkeeping). Prompts that do not fit `max_model_len` are left out of the replay and
of the bounds, and counted. The bounds (`bounds.py`) use the same prompts and block size,
with the workers' caches pooled; a policy's `vs_optimal` is its fresh prefill over the
optimal bound's. Nothing reads a wall clock but the progress bar and `wall_s`.

Host tier (`host_gib` per worker, default 0: none): each engine gets that much pinned host
memory for KV blocks, vLLM's native CPU offloading (`sim/kv/host_tier.py`): prompt blocks are
copied there as they are computed, a GPU miss continues in it, a host hit is loaded back
at the profile's host-to-device speed within that request's TTFT. A `pooled_host` row
gives the box one host tier of all workers' host memory together, shared by every engine
(a block any worker stored can be loaded by any other, at the same copy cost); each block
is still announced by the worker that stored it, so routers see it there.

Each row is a routing policy with a residency policy (`residency.py`): `lru` is vLLM as
shipped and keeps the routing policy's own name; any other is named `ROUTING+RESIDENCY`;
a pooled-host row adds `+pooled-host`, a row with idle workers sleeping or stopping
(`power.py`) `+worker-reaper:SETTING`.
A closed-loop workload (`workload_replay.py`) replays the same way, its turns released by
completions instead of a trace's timestamps, with the tasks' deadlines and outcomes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.kv_events import KvEvent
from appliance.perf.kv_capacity import default_num_gpu_blocks
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import GpuProfile, WakeTimes, bundled_profile, load_profile
from appliance.policy.residency import ResidencyPolicy
from appliance.replay.kv_residency.residency import PolicyResidency
from appliance.replay.metrics import policy_metrics
from appliance.replay.power import ReaperSetting, SleepyEngine, WorkerReaper, sim_power_table
from appliance.replay.progress import ProgressBar
from appliance.replay.routers import PolicyRouter
from appliance.replay.traces import Trace
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.core.waiting_queue import SchedulingPolicy
from appliance.sim.engine_io import StepResult
from appliance.sim.kv.host_tier import HostTier
from appliance.sim.runtime.trace import BlockTokens, trace_arrivals
from appliance.sim.runtime.virtual import replay

GIB = 1 << 30
DEFAULT_BLOCK_SIZE = 512
DEFAULT_MAX_MODEL_LEN = 131072
DEFAULT_RESIDENCY = "lru"
DEFAULT_GPU_SECOND = 0.0011
"""Price of a GPU-second for cost per successful task (the `costs.gpu_second` default)."""
POOLED_HOST = "pooled-host"


def row_name(
    policy: str, residency: str, *, pooled_host: bool = False, reaper: ReaperSetting | None = None
) -> str:
    """A report row's name: the routing policy's, with `+RESIDENCY` unless it is `lru`,
    `+pooled-host` for a host tier pooled across the workers, and `+worker-reaper:SETTING`
    for workers that sleep or stop when idle."""
    name = policy if residency == DEFAULT_RESIDENCY else f"{policy}+{residency}"
    if reaper is not None and reaper.worker_idle_s is not None:
        name += f"+worker-reaper:{reaper.label}"
    return f"{name}+{POOLED_HOST}" if pooled_host else name


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a report: a routing policy under a residency policy, and whether the
    workers' host tiers are pooled into one."""

    policy: str
    residency: str = DEFAULT_RESIDENCY
    pooled_host: bool = False
    reaper: ReaperSetting | None = None
    """Workers' power states watched (None: not), and sleeping when idle if it says so."""

    @property
    def name(self) -> str:
        return row_name(
            self.policy, self.residency, pooled_host=self.pooled_host, reaper=self.reaper
        )

    @property
    def twin(self) -> Row:
        """The same row with per-worker host tiers."""
        return Row(self.policy, self.residency)


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    """The simulated hardware every policy runs on."""

    workers: int
    block_size: int
    kv_blocks_per_worker: int
    """Usable blocks per worker (vLLM's count less the null block)."""
    kv_gib_per_worker: float
    max_model_len: int
    gpu_profile: str
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    prompt_a_step: bool = False
    """The appliance's scheduler: one prompt a step while two or more are in flight."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    token_seed: int = 0
    host_blocks_per_worker: int = 0
    """Blocks of pinned host memory per worker (0: no host tier)."""
    host_gib_per_worker: float = 0.0
    wake: WakeTimes | None = None
    """The profile's wake times by resting state, with their sources."""

    @property
    def pooled_blocks(self) -> int:
        return self.workers * self.kv_blocks_per_worker

    @property
    def pooled_host_blocks(self) -> int:
        return self.workers * self.host_blocks_per_worker

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def make_setup(
    *,
    workers: int,
    gpu_profile: Path | None = None,
    hbm_gib: float | None = None,
    host_gib: float = 0.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
) -> tuple[ReplaySetup, LatencyModel]:
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    profile: GpuProfile = load_profile(gpu_profile) if gpu_profile else bundled_profile()
    latency = LatencyModel.from_profile(profile)
    if hbm_gib is not None:
        if hbm_gib <= 0:
            raise ValueError(f"--hbm-gib must be positive, got {hbm_gib}")
        usable = int(hbm_gib * GIB) // (block_size * profile.kv_bytes_per_token)
    else:
        usable = default_num_gpu_blocks(profile, block_size, 0.9) - 1
    if usable < 2:
        raise ValueError(f"a KV cache of {usable} blocks of {block_size} tokens cannot serve")
    block_bytes = block_size * profile.kv_bytes_per_token
    if host_gib < 0:
        raise ValueError(f"--host-gib must not be negative, got {host_gib}")
    host = int(host_gib * GIB) // block_bytes
    if host_gib and host < 1:
        raise ValueError(f"--host-gib {host_gib} holds no block of {block_size} tokens")
    setup = ReplaySetup(
        workers=workers,
        block_size=block_size,
        kv_blocks_per_worker=usable,
        kv_gib_per_worker=round(usable * block_size * profile.kv_bytes_per_token / GIB, 3),
        max_model_len=min(max_model_len, usable * block_size),
        gpu_profile=str(gpu_profile) if gpu_profile else profile.name,
        host_blocks_per_worker=host,
        host_gib_per_worker=round(host * block_bytes / GIB, 3),
        wake=profile.wake,
    )
    return setup, latency


def fitting(trace: Trace, setup: ReplaySetup) -> Trace:
    """The trace without prompts an engine of `max_model_len` refuses."""
    keep = [r for r in trace.records if r.input_length < setup.max_model_len]
    if len(keep) == len(trace.records):
        return trace
    return Trace(trace.path, trace.format, keep, trace.sessions, trace.session_source)


def host_tiers(
    setup: ReplaySetup, residency: PolicyResidency | None = None, *, pooled: bool = False
) -> list[HostTier | None]:
    """Each worker's host tier: its own, one shared by all (`pooled`), or none."""
    n, blocks = setup.workers, setup.host_blocks_per_worker
    if not blocks:
        if pooled:
            raise ValueError("a pooled host tier needs host memory (--host-gib)")
        return [None] * n
    priority = residency.host_priority if residency is not None else None
    if pooled:
        return [HostTier(n * blocks, priority=priority)] * n
    return [HostTier(blocks, priority=priority) for _ in range(n)]


def make_engines(
    setup: ReplaySetup,
    latency: LatencyModel,
    residency: PolicyResidency | None = None,
    *,
    pooled_host: bool = False,
    sleepy: bool = False,
) -> list[SimEngine]:
    """One engine per worker; `sleepy`: engines that can wait for a wake (`power.py`)."""
    hasher = BlockHasher(HashAlgo.SHA256, setup.block_size)
    hosts = host_tiers(setup, residency, pooled=pooled_host)
    config = EngineConfig(
        num_blocks=setup.kv_blocks_per_worker + 1,
        block_size=setup.block_size,
        max_model_len=setup.max_model_len,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        long_prefill_token_threshold=setup.long_prefill_token_threshold,
        prompt_a_step=setup.prompt_a_step,
        policy=setup.scheduling_policy,
    )
    kind = SleepyEngine if sleepy else SimEngine
    return [
        kind(config, hasher=hasher, latency=latency, residency=residency, host=host)
        for host in hosts
    ]


def worker_reaper(
    setting: ReaperSetting, setup: ReplaySetup, engines: list[SimEngine], router: PolicyRouter
) -> WorkerReaper:
    """The worker reaper of one row, telling the router of the KV a sleep drops."""
    if setup.wake is None:
        raise ValueError(f"GPU profile {setup.gpu_profile} has no wake times")
    kv_bytes = int(setup.kv_gib_per_worker * GIB)

    def dropped(i: int, now: float, events: list[KvEvent]) -> None:
        router.on_step(i, now, StepResult(0.0, [], events, 0))

    return WorkerReaper(engines, setting, sim_power_table(setup.wake, kv_bytes), dropped)


def replay_policy(
    trace: Trace,
    policy: str,
    setup: ReplaySetup,
    latency: LatencyModel,
    *,
    residency: str | ResidencyPolicy = DEFAULT_RESIDENCY,
    optimal_fresh: int | None = None,
    optimal_with_host_fresh: int | None = None,
    pooled_host: bool = False,
    progress: bool = False,
    reaper: ReaperSetting | None = None,
) -> dict[str, object]:
    """Replay `trace` with `policy` routing and `residency` holding, and with `reaper` the
    workers' power states; returns its metrics (`metrics.py`, `power` null without one)."""
    hold = PolicyResidency(residency, latency=latency, block_size=setup.block_size)
    engines = make_engines(setup, latency, hold, pooled_host=pooled_host, sleepy=bool(reaper))
    router = PolicyRouter(policy, workers=setup.workers, hasher=engines[0].hasher, latency=latency)
    power = worker_reaper(reaper, setup, engines, router) if reaper is not None else None
    arrivals = trace_arrivals(
        trace.records, BlockTokens(seed=setup.token_seed), sessions=trace.sessions
    )
    name = row_name(policy, hold.name, pooled_host=pooled_host, reaper=reaper)
    bar = ProgressBar(name, len(trace.records)) if progress else None
    on_step, route = router.on_step, power.routed(router) if power else router
    if power is not None:
        on_step = both(router.on_step, power.on_step)
    t0 = time.perf_counter()
    result = replay(engines, bar.wrap(arrivals) if bar else arrivals, route, on_step=on_step)
    wall_s = time.perf_counter() - t0
    if bar:
        bar.close()
    sessions = {f"req-{r.index}": trace.sessions[r.index] for r in trace.records}
    out = policy_metrics(
        result,
        sessions,
        optimal_fresh=optimal_fresh,
        optimal_with_host_fresh=optimal_with_host_fresh,
        workers=setup.workers,
        pooled_host=pooled_host,
    )
    out["power"] = power.summary(result.end_s) if power is not None else None
    return with_decision_counts(out, router, hold, wall_s)


def both(
    first: Callable[[int, float, StepResult], None], then: Callable[[int, float, StepResult], None]
) -> Callable[[int, float, StepResult], None]:
    """Two step watchers, in order."""

    def on_step(i: int, now: float, result: StepResult) -> None:
        first(i, now, result)
        then(i, now, result)

    return on_step


def with_decision_counts(
    out: dict[str, object], router: PolicyRouter, hold: PolicyResidency, wall_s: float
) -> dict[str, object]:
    """`out` with the routing and residency decisions counted, and the row's wall time."""
    out["routed_by_reason"] = dict(router.reasons.most_common(8))
    out["residency_by_reason"] = dict(hold.reasons.most_common(8))
    out["residency_by_action"] = dict(hold.actions.most_common())
    out["residency_by_kind"] = dict(hold.kinds.most_common())
    out["residency_by_tool"] = _by_tool(hold)
    out["wall_s"] = round(wall_s, 2)
    return out


def _by_tool(hold: PolicyResidency) -> dict[str, dict[str, int]]:
    """Tool class -> action -> decisions (revisits included)."""
    out: dict[str, dict[str, int]] = {}
    for (tool, action), n in sorted(hold.by_tool.items()):
        out.setdefault(tool, {})[action] = n
    return out
