"""Reads vLLM's Prometheus text (`GET /metrics`) into a LoadSnapshot.

Model of the world: the exposition format is one sample per line, `name{label="v",...} value
[timestamp]`, with `# HELP` / `# TYPE` comments. The parser is tolerant: a line it cannot read
is counted and skipped, never fatal, since a scrape that half-works still tells the router
more than none. Counters appear with the `_total` suffix (prometheus_client adds it; the
`_created` samples beside them are timestamps and ignored); histograms appear as `_bucket`,
`_sum` and `_count` samples, of which only TTFT's sum and count are kept. With several engine
cores (data parallel) a server exposes one sample per `engine` label: counts and gauges are
summed, the KV-cache usage is the fullest engine's. The KV pool's size comes from
`vllm:cache_config_info`'s labels. Names of older vLLM releases
(`gpu_cache_usage_perc`, `gpu_prefix_cache_*`) are read as fallbacks.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from appliance.domain.worker import LoadSnapshot

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+(\S+))?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(slots=True)
class Metrics:
    """Every sample of one scrape, with the declared types and the lines that were skipped."""

    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)
    skipped: int = 0

    def select(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    def total(self, *names: str, **labels: str) -> float:
        """Sum of the first name that has samples (fallbacks for older releases); 0 if none."""
        for name in names:
            found = self.select(name, **labels)
            if found:
                return math.fsum(s.value for s in found if not math.isnan(s.value))
        return 0.0

    def maximum(self, *names: str, **labels: str) -> float:
        for name in names:
            found = [s.value for s in self.select(name, **labels) if not math.isnan(s.value)]
            if found:
                return max(found)
        return 0.0

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.select(name, **labels):
            key = s.labels.get(label)
            if key is not None and not math.isnan(s.value):
                out[key] = out.get(key, 0.0) + s.value
        return out


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], value)


def _labels(text: str) -> dict[str, str] | None:
    labels: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            return None
        labels[match.group(1)] = _unescape(match.group(2))
        pos = match.end()
    return labels


def _value(text: str) -> float | None:
    try:
        return float(text)  # also "NaN", "+Inf", "-Inf"
    except ValueError:
        return None


def parse(text: str, only: Collection[str] | None = None) -> Metrics:
    """All samples of a Prometheus text exposition, or only the samples named in `only`
    (found by one regular-expression scan; the other lines, and the comments, are not
    read); unreadable lines are counted in `skipped`."""
    out = Metrics()
    lines = _lines_of(frozenset(only)).findall(text) if only is not None else text.splitlines()
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                out.types[parts[2]] = parts[3].strip()
            continue
        match = _SAMPLE.match(line)
        labels = _labels(match.group(2) or "") if match else None
        value = _value(match.group(3)) if match else None
        if match is None or labels is None or value is None:
            out.skipped += 1
            continue
        out.samples.append(Sample(match.group(1), labels, value))
    return out


@functools.cache
def _lines_of(names: frozenset[str]) -> re.Pattern[str]:
    """Whole sample lines of these metric names (a name ends at `{` or a blank)."""
    alternatives = "|".join(map(re.escape, sorted(names)))
    return re.compile(rf"^[ \t]*(?:{alternatives})[{{ \t][^\n]*", re.MULTILINE)


def _int(value: float) -> int:
    return round(value) if math.isfinite(value) else 0


def _ints(values: Mapping[str, float]) -> dict[str, int]:
    return {k: _int(v) for k, v in values.items()}


LOAD_FAMILIES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:prompt_tokens_cached_by_source_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_prefill_kv_computed_tokens_sum",
        "vllm:request_prompt_tokens_sum",
        "vllm:cache_config_info",
    }
)
"""The samples a LoadSnapshot reads: a scrape parses only these lines (the rest, mostly
histogram buckets, is most of the text and would cost the event loop milliseconds)."""


def load_snapshot(
    metrics: Metrics | str, *, now: float, model_name: str | None = None
) -> LoadSnapshot:
    """The appliance's view of one worker's load; `model_name` filters when several are served."""
    m = parse(metrics, LOAD_FAMILIES) if isinstance(metrics, str) else metrics
    labels = {"model_name": model_name} if model_name else {}

    def total(*names: str) -> int:
        return _int(m.total(*names, **labels))

    return LoadSnapshot(
        time=now,
        running=total("vllm:num_requests_running"),
        waiting=total("vllm:num_requests_waiting"),
        kv_cache_usage_perc=m.maximum(
            "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", **labels
        ),
        prefix_cache_queries_tokens=total(
            "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"
        ),
        prefix_cache_hits_tokens=total(
            "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"
        ),
        preemptions=total("vllm:num_preemptions_total"),
        prompt_tokens=total("vllm:prompt_tokens_total"),
        generation_tokens=total("vllm:generation_tokens_total"),
        prompt_tokens_by_source=_ints(
            m.by_label("vllm:prompt_tokens_by_source_total", "source", **labels)
        ),
        prompt_tokens_cached_by_source=_ints(
            m.by_label("vllm:prompt_tokens_cached_by_source_total", "source", **labels)
        ),
        ttft_sum_s=m.total("vllm:time_to_first_token_seconds_sum", **labels),
        ttft_count=total("vllm:time_to_first_token_seconds_count"),
        prefill_sum_s=m.total("vllm:request_prefill_time_seconds_sum", **labels),
        prefill_count=total("vllm:request_prefill_time_seconds_count"),
        prefill_fresh_tokens=total("vllm:request_prefill_kv_computed_tokens_sum"),
        prefill_prompt_tokens=total("vllm:request_prompt_tokens_sum"),
        kv_capacity_tokens=kv_capacity_tokens(m),
    )


def kv_capacity_tokens(m: Metrics) -> int | None:
    """Tokens the server's KV pool holds, from `vllm:cache_config_info`: num_gpu_blocks less
    vLLM's null block, times block_size, summed over its engines; None when it does not say
    (an older server, or labels that are not numbers)."""
    tokens = 0
    found = m.select("vllm:cache_config_info")
    for sample in found:
        blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
        if blocks is None or size is None or not blocks.isdigit() or not size.isdigit():
            return None
        tokens += max(int(blocks) - 1, 0) * int(size)
    return tokens if found else None


def cache_config(metrics: Metrics | str) -> dict[str, str]:
    """The engine's CacheConfig as `vllm:cache_config_info` labels it (block_size,
    prefix_caching_hash_algo, num_gpu_blocks, ...); {} when the server does not expose it."""
    m = parse(metrics) if isinstance(metrics, str) else metrics
    found = m.select("vllm:cache_config_info")
    return dict(found[0].labels) if found else {}


def names(metrics: Metrics) -> Iterable[str]:
    return sorted({s.name for s in metrics.samples})
