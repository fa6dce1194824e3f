"""The Prometheus text parser and the LoadSnapshot it feeds, on real vLLM 0.32 output.

tests/unit/data/vllm_metrics.txt is a real /metrics of the CPU build serving the tiny model
(block size 32) after three chat turns of one growing conversation.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from appliance.domain.worker import LoadSnapshot
from appliance.engines.clients.metrics import LOAD_FAMILIES, cache_config, load_snapshot, parse
from appliance.sim.core.engine_stats import EngineStats
from appliance.sim.entrypoints.metrics import SimMetrics, cache_config_labels

REAL = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def test_real_vllm_metrics_parse_without_skipping_lines() -> None:
    m = parse(REAL)
    assert m.skipped == 0
    assert len(m.samples) > 400
    assert m.types["vllm:prefix_cache_queries_total"] == "counter"
    assert m.types["vllm:time_to_first_token_seconds"] == "histogram"


def test_real_vllm_metrics_to_load_snapshot() -> None:
    snap = load_snapshot(REAL, now=123.0, model_name="tiny")
    assert snap == LoadSnapshot(
        time=123.0,
        running=0,
        waiting=0,
        kv_cache_usage_perc=0.0,
        prefix_cache_queries_tokens=3720,
        prefix_cache_hits_tokens=2336,
        preemptions=0,
        prompt_tokens=3720,
        generation_tokens=48,
        prompt_tokens_by_source={
            "local_compute": 1384,
            "local_cache_hit": 2336,
            "external_kv_transfer": 0,
        },
        prompt_tokens_cached_by_source={
            "device": 2336,
            "host": 0,
            "p2p": 0,
            "disk": 0,
            "external_unspecified": 0,
        },
        ttft_sum_s=pytest.approx(0.10155034065246582),
        ttft_count=3,
        prefill_sum_s=pytest.approx(0.08179840899970259),
        prefill_count=3,
        prefill_fresh_tokens=1384,
        prefill_prompt_tokens=3720,
        kv_capacity_tokens=127 * 32,  # 128 blocks of 32 tokens, less vLLM's null block
    )
    assert snap.prefix_hit_rate == pytest.approx(2336 / 3720)
    assert not snap.busy


def test_a_scrape_reads_only_the_load_families_and_loses_nothing_of_the_snapshot() -> None:
    only = parse(REAL, LOAD_FAMILIES)
    assert {s.name for s in only.samples} <= LOAD_FAMILIES
    assert len(only.samples) < len(parse(REAL).samples) // 4
    assert load_snapshot(only, now=1.0, model_name="tiny") == load_snapshot(
        parse(REAL), now=1.0, model_name="tiny"
    )
    broken = "vllm:num_requests_running{bad 1\nvllm:num_requests_waiting 3\nother{a} x\n"
    picked = parse(broken, LOAD_FAMILIES)
    assert picked.skipped == 1 and [s.value for s in picked.samples] == [3.0]


def test_other_model_name_reads_nothing() -> None:
    snap = load_snapshot(REAL, now=0.0, model_name="other")
    assert snap.prefix_cache_queries_tokens == 0 and snap.prefix_hit_rate is None


def test_cache_config_names_the_block_size() -> None:
    config = cache_config(REAL)
    assert config["block_size"] == "32"
    assert config["enable_prefix_caching"] == "True"
    assert config["prefix_caching_hash_algo"] == "sha256_cbor"


def test_the_kv_pools_size_is_read_from_the_cache_config_the_simulator_exposes_too() -> None:
    labels = cache_config_labels(
        block_size=16,
        num_gpu_blocks=1001,
        max_model_len=4096,
        hash_algo="sha256_cbor",
        kv_cache_memory_bytes=None,
    )
    sim = SimMetrics(model_name="m", max_model_len=4096, cache_config=labels)
    stats = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        prompt_tokens_total=0,
        prompt_tokens_by_source={},
        generation_tokens_total=0,
        num_preemptions_total=0,
        request_success_total={},
    )
    assert load_snapshot(sim.render(stats), now=0.0).kv_capacity_tokens == 1000 * 16
    assert load_snapshot(DP2, now=0.0).kv_capacity_tokens is None  # not said: not known
    odd = 'vllm:cache_config_info{block_size="None",num_gpu_blocks="8"} 1.0\n'
    assert load_snapshot(odd, now=0.0).kv_capacity_tokens is None


DP2 = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 150
vllm:prefix_cache_hits_created{engine="1",model_name="m"} 1.79e9
vllm:num_preemptions_total{engine="0",model_name="m"} 4
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7
"""


def test_data_parallel_engines_are_summed_and_kv_is_the_fullest() -> None:
    snap = load_snapshot(DP2, now=1.0)
    assert (snap.running, snap.waiting, snap.preemptions) == (5, 1, 4)
    assert snap.kv_cache_usage_perc == 0.75
    assert snap.prefix_hit_rate == 0.5
    assert snap.busy


def test_older_names_are_fallbacks() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 4\n'
    )
    snap = load_snapshot(text, now=0.0, model_name="m")
    assert snap.kv_cache_usage_perc == 0.5
    assert snap.prefix_hit_rate == 0.4


@pytest.mark.parametrize(
    ("line", "name", "labels", "value"),
    [
        ("a 1", "a", {}, 1.0),
        ("a_total 2.5e3 1700000000000", "a_total", {}, 2500.0),
        ('m{x="1"} +Inf', "m", {"x": "1"}, math.inf),
        ('m{x="a,b",y="c d"} 3', "m", {"x": "a,b", "y": "c d"}, 3.0),
        (r'm{p="say \"hi\"\n",q="back\\slash"} 1', "m", {"p": 'say "hi"\n', "q": "back\\slash"}, 1),
        ('m{x="1",} 4', "m", {"x": "1"}, 4.0),
        ("vllm:x{} 5", "vllm:x", {}, 5.0),
        ('m{a="}"} 6', "m", {"a": "}"}, 6.0),
    ],
)
def test_sample_lines(line: str, name: str, labels: dict[str, str], value: float) -> None:
    m = parse(line)
    assert m.skipped == 0
    [sample] = m.samples
    assert (sample.name, dict(sample.labels), sample.value) == (name, labels, value)


def test_nan_is_parsed_and_ignored_in_sums() -> None:
    m = parse("g NaN\ng 2\n")
    assert math.isnan(m.samples[0].value)
    assert m.total("g") == 2.0


@pytest.mark.parametrize(
    "line",
    ["just_a_name", 'm{x="unterminated} 1', "m{x=1} 2", "m one", "1bad 2", 'm{="v"} 1'],
)
def test_bad_lines_are_skipped_not_fatal(line: str) -> None:
    m = parse(f"good 1\n{line}\nalso_good 2\n")
    assert m.skipped == 1
    assert [s.name for s in m.samples] == ["good", "also_good"]


def test_empty_and_comment_only_text() -> None:
    assert parse("").samples == []
    snap = load_snapshot("# HELP x y\n# TYPE x gauge\n\n", now=5.0)
    assert snap == LoadSnapshot(time=5.0, running=0, waiting=0, kv_cache_usage_perc=0.0)
