"""A simulated engine's cumulative counters, and the snapshot of them and of its gauges that
`SimEngine.stats` gives (vLLM's semantics: `engine.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.sim.kv.host_tier import HostTier
from appliance.sim.kv.prefix_cache import PrefixCache


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and cumulative counters (vLLM semantics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    prompt_tokens_by_source: dict[str, int]
    generation_tokens_total: int
    num_preemptions_total: int
    request_success_total: dict[str, int]
    num_steps_total: int = 0
    busy_s_total: float = 0.0
    pinned_blocks: int = 0
    """Blocks held by residency pins now (they count as used in `kv_cache_usage`)."""
    pins_total: int = 0
    pins_expired_total: int = 0
    pins_resumed_total: int = 0
    pins_reclaimed_total: int = 0
    """Pins given back early because an allocation was short."""
    host_blocks: int = 0
    """The host tier's capacity in blocks (0: none)."""
    host_hit_tokens_total: int = 0
    """Prompt tokens loaded from the host tier (counted at the first token)."""
    host_load_s_total: float = 0.0
    """Seconds of host -> GPU copies for those loads."""
    host_stored_blocks_total: int = 0
    host_evicted_blocks_total: int = 0
    demotions_total: int = 0
    """Finished turns and held sessions whose blocks were demoted to the host tier."""
    evictions_total: int = 0
    """Finished turns and held sessions whose blocks were put first in the eviction order."""


class EngineCounters:
    """What the engine counts as it goes (a plain class: nothing is set at construction)."""

    __slots__ = (
        "busy_s",
        "demotions",
        "evictions",
        "generation_tokens",
        "host_load_s",
        "preemptions",
        "prompt_cached",
        "prompt_host",
        "prompt_tokens",
        "steps",
        "success",
    )

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_cached = 0
        self.prompt_host = 0
        self.host_load_s = 0.0
        self.demotions = 0
        self.evictions = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.busy_s = 0.0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}


def engine_stats(
    n: EngineCounters,
    cache: PrefixCache,
    host: HostTier | None,
    num_running: int,
    num_waiting: int,
    *,
    pins: bool,
) -> EngineStats:
    """The snapshot: `pins` adds the pin fields (an engine with a residency hook)."""
    cs = cache.stats
    return EngineStats(
        num_running=num_running,
        num_waiting=num_waiting,
        kv_cache_usage=cache.usage,
        prefix_cache_queries=cs.queries,
        prefix_cache_hits=cs.hits,
        prompt_tokens_total=n.prompt_tokens,
        prompt_tokens_by_source=_by_source(n, host),
        generation_tokens_total=n.generation_tokens,
        num_preemptions_total=n.preemptions,
        request_success_total=dict(n.success),
        num_steps_total=n.steps,
        busy_s_total=n.busy_s,
        demotions_total=n.demotions,
        evictions_total=n.evictions,
        **(_pin_fields(cache) if pins else {}),
        **_host_fields(n, host),
    )


def _by_source(n: EngineCounters, host: HostTier | None) -> dict[str, int]:
    local = n.prompt_cached - n.prompt_host
    out = {"local_cache_hit": local, "local_compute": n.prompt_tokens - n.prompt_cached}
    if host is not None:
        out["external_kv_transfer"] = n.prompt_host
    return out


def _host_fields(n: EngineCounters, host: HostTier | None) -> dict[str, Any]:
    if host is None:
        return {}
    h = host.stats
    return {
        "host_blocks": host.num_blocks,
        "host_hit_tokens_total": n.prompt_host,
        "host_load_s_total": n.host_load_s,
        "host_stored_blocks_total": h.stored,
        "host_evicted_blocks_total": h.evicted,
    }


def _pin_fields(cache: PrefixCache) -> dict[str, int]:
    p = cache.pin_stats
    return {
        "pinned_blocks": cache.num_pinned_blocks,
        "pins_total": p.pinned,
        "pins_expired_total": p.expired,
        "pins_resumed_total": p.resumed,
        "pins_reclaimed_total": p.reclaimed,
    }
