"""Prometheus text for one simulated engine, in vLLM 0.32's names, labels and layout.

Model of the world (vLLM `v1/metrics/loggers.py` PrometheusStatLogger, `buckets.py`, and the
text prometheus_client writes): every family of real vLLM's `/metrics` appears, in the same
order, with the labels `engine` and `model_name` (sorted by name, as exposed), its HELP and
TYPE lines, and for counters and histograms the `_created` gauge prometheus_client adds.
Counter families are registered without `_total` and exposed with it. Histograms use vLLM's
bucket boundaries; the token-count ones go up a 1-2-5 series to max_model_len. The families
themselves (names, HELP, labels, buckets) are listed in `metric_families.py`.

Where the numbers come from: gauges and cumulative counters are read from the engine's
`EngineStats` at scrape time (vLLM's semantics are the engine's); histograms are fed per
finished request (`observe_request`) and per engine step (`observe_iteration`) by the
worker, which times requests on its clock. A host tier's loads count as vLLM's offloading
connector counts them: `external_kv_transfer`, `source="host"`, `external_prefix_cache_*`.
Families the sim has no notion of (multimodal cache, other KV connectors, FLOP estimates,
admission rejections) stay at zero, as they do on a real engine that does not use them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.entrypoints.metric_families import (
    CACHE_CONFIG_INFO,
    COUNTER,
    FAMILIES,
    HISTOGRAM,
    MetricFamily,
    bucket_sets,
)


def go_float(value: float) -> str:
    """A sample value as prometheus_client writes it (`floatToGoString`)."""
    d = float(value)
    if d == float("inf"):
        return "+Inf"
    if d == float("-inf"):
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request, timed by the worker (seconds on its clock)."""

    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    n: int
    num_preemptions: int
    prefill_computed_tokens: int
    queue_s: float
    ttft_s: float | None
    e2e_s: float
    prefill_s: float
    decode_s: float
    inter_token_s: Sequence[float] = ()


def cache_config_labels(
    *,
    block_size: int,
    num_gpu_blocks: int,
    max_model_len: int,
    hash_algo: str,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float = 0.92,
    enable_prefix_caching: bool = True,
) -> dict[str, str]:
    """The label set of `vllm:cache_config_info` for a single full-attention group."""
    tokens = num_gpu_blocks * block_size
    labels = {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(enable_prefix_caching),
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / max_model_len, 2)),
        "kv_cache_memory_bytes": str(kv_cache_memory_bytes),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": hash_algo,
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }
    return labels


class SimMetrics:
    """One engine's metrics: histograms it accumulates, counters it reads at scrape time."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        cache_config: Mapping[str, str],
        engine: str = "0",
    ) -> None:
        self.model_name = model_name
        self.engine = engine
        self.cache_config = dict(cache_config)
        self._created = time.time()
        sets = bucket_sets(max_model_len)
        self.histograms = {f.name: Histogram(sets[f.buckets]) for f in FAMILIES if f.buckets}

    def observe_iteration(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.histograms["vllm:iteration_tokens_total"].observe(num_tokens)

    def observe_request(self, r: FinishedRequest) -> None:
        h = self.histograms
        h["vllm:request_prompt_tokens"].observe(r.prompt_tokens)
        h["vllm:request_generation_tokens"].observe(r.generation_tokens)
        h["vllm:request_max_num_generation_tokens"].observe(r.max_tokens)
        h["vllm:request_params_n"].observe(r.n)
        h["vllm:request_params_max_tokens"].observe(r.max_tokens)
        h["vllm:e2e_request_latency_seconds"].observe(r.e2e_s)
        h["vllm:request_queue_time_seconds"].observe(r.queue_s)
        h["vllm:request_inference_time_seconds"].observe(r.prefill_s + r.decode_s)
        h["vllm:request_prefill_time_seconds"].observe(r.prefill_s)
        h["vllm:request_decode_time_seconds"].observe(r.decode_s)
        h["vllm:request_num_preemptions"].observe(r.num_preemptions)
        h["vllm:request_prefill_kv_computed_tokens"].observe(r.prefill_computed_tokens)
        if r.ttft_s is not None:
            h["vllm:time_to_first_token_seconds"].observe(r.ttft_s)
        for itl in r.inter_token_s:
            h["vllm:inter_token_latency_seconds"].observe(itl)
        if r.generation_tokens > 1:
            tpot = r.decode_s / (r.generation_tokens - 1)
            h["vllm:request_time_per_output_token_seconds"].observe(tpot)

    def _values(
        self, s: EngineStats, sleep_state: Mapping[str, float] | None = None
    ) -> dict[str, dict[str, float]]:
        """Gauge and counter values by family, keyed by the extra label's value ("")."""
        hits = float(s.prefix_cache_hits)
        by_source = s.prompt_tokens_by_source
        local = by_source.get("local_cache_hit", 0)
        host = by_source.get("external_kv_transfer", 0)  # the host tier's, as vLLM's connector
        return {
            "vllm:num_requests_running": {"": s.num_running},
            "vllm:num_requests_waiting": {"": s.num_waiting},
            "vllm:num_requests_waiting_by_reason": {"capacity": s.num_waiting},
            "vllm:engine_sleep_state": dict(sleep_state or {"awake": 1.0}),
            "vllm:kv_cache_usage_perc": {"": s.kv_cache_usage},
            "vllm:prefix_cache_queries": {"": s.prefix_cache_queries},
            "vllm:prefix_cache_hits": {"": hits},
            "vllm:num_preemptions": {"": s.num_preemptions_total},
            "vllm:prompt_tokens": {"": s.prompt_tokens_total},
            "vllm:prompt_tokens_by_source": {k: float(v) for k, v in by_source.items()},
            "vllm:prompt_tokens_cached": {"": local + host},
            "vllm:prompt_tokens_cached_by_source": {"device": local, "host": host},
            "vllm:external_prefix_cache_queries": {
                "": s.prefix_cache_queries if s.host_blocks else 0
            },
            "vllm:external_prefix_cache_hits": {"": host},
            "vllm:generation_tokens": {"": s.generation_tokens_total},
            "vllm:request_success": {k: float(v) for k, v in s.request_success_total.items()},
        }

    def render(self, stats: EngineStats, sleep_state: Mapping[str, float] | None = None) -> str:
        """The `vllm:` part of `/metrics` for the engine's current stats (and sleep state:
        `vllm:engine_sleep_state` by label; None: awake)."""
        values = self._values(stats, sleep_state)
        out: list[str] = []
        for fam in FAMILIES:
            if fam.kind == HISTOGRAM:
                self._render_histogram(out, fam)
                continue
            exposed = fam.name + "_total" if fam.kind == COUNTER else fam.name
            out += [f"# HELP {exposed} {fam.help}", f"# TYPE {exposed} {fam.kind}"]
            got = values.get(fam.name, {})
            keys = fam.values or ("",)
            for key in keys:
                out.append(f"{exposed}{self._labels(fam, key)} {go_float(got.get(key, 0.0))}")
            if fam.kind == COUNTER:
                self._render_created(out, fam, keys)
        cc = CACHE_CONFIG_INFO
        labels = {**self.cache_config, "engine": self.engine}
        out += [f"# HELP {cc.name} {cc.help}", f"# TYPE {cc.name} gauge"]
        out.append(f"{cc.name}{_fmt_labels(labels)} 1.0")
        return "\n".join(out) + "\n"

    def _labels(self, fam: MetricFamily, key: str, **extra: str) -> str:
        labels = {"model_name": self.model_name, **extra}
        if fam.name != "vllm:admission_rejections":
            labels["engine"] = self.engine
        if fam.label and key:
            labels[fam.label] = key
        return _fmt_labels(labels)

    def _render_created(self, out: list[str], fam: MetricFamily, keys: Sequence[str]) -> None:
        name = fam.name + "_created"
        out += [f"# HELP {name} {fam.help}", f"# TYPE {name} gauge"]
        out += [f"{name}{self._labels(fam, k)} {go_float(self._created)}" for k in keys]

    def _render_histogram(self, out: list[str], fam: MetricFamily) -> None:
        h = self.histograms[fam.name]
        out += [f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} histogram"]
        cumulative = 0
        for bound, n in zip((*h.buckets, float("inf")), h.counts, strict=True):
            cumulative += n
            labels = self._labels(fam, "", le=go_float(bound))
            out.append(f"{fam.name}_bucket{labels} {go_float(cumulative)}")
        out.append(f"{fam.name}_count{self._labels(fam, '')} {go_float(h.count)}")
        out.append(f"{fam.name}_sum{self._labels(fam, '')} {go_float(h.total)}")
        self._render_created(out, fam, ("",))


def _fmt_labels(labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
