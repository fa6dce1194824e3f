"""vLLM 0.32's metric families, in its exposition order: name, kind, HELP text, the extra
label and its values, and which bucket boundaries a histogram uses (vLLM `buckets.py`; the
token-count ones go up a 1-2-5 series to max_model_len). `metrics.py` fills and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

Buckets = tuple[float, ...]
TTFT_BUCKETS: Buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: Buckets = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITL_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS: Buckets = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = tuple(float(2**i) for i in (0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14))
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            if m * 10**exp > max_model_len:
                return tuple(out)
            out.append(float(m * 10**exp))
        exp += 1


def bucket_sets(max_model_len: int) -> dict[str, Buckets]:
    """Each histogram bucket set by the name the table below gives it."""
    return {
        "tokens": token_buckets(max_model_len),
        "iteration": ITERATION_BUCKETS,
        "n": PARAMS_N_BUCKETS,
        "ttft": TTFT_BUCKETS,
        "itl": ITL_BUCKETS,
        "latency": LATENCY_BUCKETS,
        "preemptions": PREEMPTION_BUCKETS,
    }


@dataclass(frozen=True, slots=True)
class MetricFamily:
    name: str
    kind: str
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()
    buckets: str = ""  # histograms: which boundary set


# One family per entry, in vLLM's exposition order: "kind name [buckets] [label=v1,v2]",
# then its HELP text on the indented lines below.
_TABLE = """
counter vllm:estimated_flops_per_gpu
    Estimated number of floating point operations per GPU (for Model Flops Utilization
    calculations).
counter vllm:estimated_read_bytes_per_gpu
    Estimated number of bytes read from memory per GPU (for Model Flops Utilization
    calculations).
counter vllm:estimated_write_bytes_per_gpu
    Estimated number of bytes written to memory per GPU (for Model Flops Utilization
    calculations).
gauge vllm:num_requests_running
    Number of requests in model execution batches.
gauge vllm:num_requests_waiting
    Number of requests waiting to be processed.
gauge vllm:num_requests_waiting_by_reason reason=capacity,deferred
    Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling
    capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer,
    blocked status). Sum of all reasons equals vllm:num_requests_waiting.
gauge vllm:engine_sleep_state sleep_state=awake,weights_offloaded,discard_all
    Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake;
    weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
gauge vllm:kv_cache_usage_perc
    KV-cache usage. 1 means 100 percent usage.
counter vllm:prefix_cache_queries
    Prefix cache queries, in terms of number of queried tokens.
counter vllm:prefix_cache_hits
    Prefix cache hits, in terms of number of cached tokens.
counter vllm:external_prefix_cache_queries
    External prefix cache queries from KV connector cross-instance cache sharing, in terms of
    number of queried tokens.
counter vllm:external_prefix_cache_hits
    External prefix cache hits from KV connector cross-instance cache sharing, in terms of
    number of cached tokens.
counter vllm:mm_cache_queries
    Multi-modal cache queries, in terms of number of queried items.
counter vllm:mm_cache_hits
    Multi-modal cache hits, in terms of number of cached items.
counter vllm:num_preemptions
    Cumulative number of preemption from the engine.
counter vllm:prompt_tokens
    Number of prefill tokens processed.
counter vllm:prompt_tokens_by_source source=local_compute,local_cache_hit,external_kv_transfer
    Number of prompt tokens by source.
counter vllm:prompt_tokens_cached
    Number of cached prompt tokens (local + external).
counter vllm:prompt_tokens_cached_by_source source=device,host,p2p,disk,external_unspecified
    Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host
    (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or
    external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits +
    vllm:external_prefix_cache_hits.
counter vllm:generation_tokens
    Number of generation tokens processed.
counter vllm:request_success finished_reason=stop,length,abort,error,repetition
    Count of successfully processed requests.
counter vllm:admission_rejections reason=max_num_queued_reqs,max_num_queued_tokens
    Number of admission attempts rejected by a queue limit, by reason.
histogram vllm:request_prompt_tokens tokens
    Number of prefill tokens processed.
histogram vllm:request_generation_tokens tokens
    Number of generation tokens processed.
histogram vllm:iteration_tokens_total iteration
    Histogram of number of tokens per engine_step.
histogram vllm:request_max_num_generation_tokens tokens
    Histogram of maximum number of requested generation tokens.
histogram vllm:request_params_n n
    Histogram of the n request parameter.
histogram vllm:request_params_max_tokens tokens
    Histogram of the max_tokens request parameter.
histogram vllm:time_to_first_token_seconds ttft
    Histogram of time to first token in seconds.
histogram vllm:inter_token_latency_seconds itl
    Histogram of inter-token latency in seconds.
histogram vllm:request_time_per_output_token_seconds itl
    Histogram of time_per_output_token_seconds per request.
histogram vllm:e2e_request_latency_seconds latency
    Histogram of e2e request latency in seconds.
histogram vllm:request_queue_time_seconds latency
    Histogram of time spent in WAITING phase for request.
histogram vllm:request_inference_time_seconds latency
    Histogram of time spent in RUNNING phase for request.
histogram vllm:request_prefill_time_seconds latency
    Histogram of time spent in PREFILL phase for request.
histogram vllm:request_decode_time_seconds latency
    Histogram of time spent in DECODE phase for request.
histogram vllm:request_num_preemptions preemptions
    Histogram of the number of times a request was preempted.
histogram vllm:request_prefill_kv_computed_tokens tokens
    Histogram of new KV tokens computed during prefill (excluding cached tokens).
"""


def _parse_table(table: str) -> tuple[MetricFamily, ...]:
    families: list[MetricFamily] = []
    head: list[str] = []
    help_lines: list[str] = []

    def flush() -> None:
        if not head:
            return
        kind, name, *rest = head
        label: str | None = None
        values: tuple[str, ...] = ()
        buckets = ""
        for item in rest:
            if "=" in item:
                label, _, joined = item.partition("=")
                values = tuple(joined.split(","))
            else:
                buckets = item
        families.append(MetricFamily(name, kind, " ".join(help_lines), label, values, buckets))

    for line in table.strip().splitlines():
        if line.startswith(" "):
            help_lines.append(line.strip())
        else:
            flush()
            head, help_lines = line.split(), []
    flush()
    return tuple(families)


FAMILIES = _parse_table(_TABLE)
CACHE_CONFIG_INFO = MetricFamily(
    "vllm:cache_config_info", GAUGE, "Information of the LLMEngine CacheConfig"
)
