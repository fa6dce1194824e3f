"""Replay the Mooncake conversation trace on N simulated vLLM engines in virtual time.

    .venv/bin/python benchmarks/sim_replay_bench.py [--limit N] [--workers 8] [--route rr]
        [--block-size 512] [--kv-gib 60] [--profile]

Each worker: the bundled H200 profile, max_model_len 131072, a KV cache of `--kv-gib` GiB
(kv_bytes_per_token from the profile), block size 512 by default: the trace's own block
granularity, so prefix sharing is nearly what 16-token blocks give (those also hit inside
a turn's trimmed last block) while hashing and decode bookkeeping see 32x fewer blocks.
Prints the wall (and CPU) time of the replay itself, the simulated span, prompt, cached
and generated tokens, preemptions and TTFT p50/p95.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.perf.latency import LatencyModel
from appliance.perf.profile import bundled_profile
from appliance.sim.core.engine import EngineConfig, SimEngine
from appliance.sim.runtime.engine_views import round_robin, session_hash
from appliance.sim.runtime.trace import (
    BlockTokens,
    conversation_ids,
    load_mooncake,
    trace_arrivals,
)
from appliance.sim.runtime.virtual import ReplayResult, replay

TRACE = (
    Path(__file__).resolve().parents[2] / "shared/traces/mooncake_fast25/conversation_trace.jsonl"
)
GIB = 1 << 30


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def run(args: argparse.Namespace) -> tuple[ReplayResult, float, float]:
    latency = LatencyModel.from_profile(bundled_profile())
    num_blocks = int(args.kv_gib * GIB) // (args.block_size * latency.kv_bytes_per_token) + 1
    hasher = BlockHasher(HashAlgo.SHA256, args.block_size)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_kv_events=not args.no_events,
    )
    engines = [SimEngine(config, hasher=hasher, latency=latency) for _ in range(args.workers)]
    records = load_mooncake(args.trace, limit=args.limit)
    sessions = conversation_ids(records)
    route = session_hash() if args.route == "session" else round_robin()
    arrivals = trace_arrivals(records, BlockTokens(seed=args.seed), sessions=sessions)
    t0, c0 = time.perf_counter(), time.process_time()
    result = replay(engines, arrivals, route)
    return result, time.perf_counter() - t0, time.process_time() - c0


def report(result: ReplayResult, wall_s: float, cpu_s: float, args: argparse.Namespace) -> None:
    stats = result.engine_stats
    ttft = [r.ttft_s for r in result.records if r.ttft_s is not None]
    prompt = sum(s.prompt_tokens_total for s in stats)
    cached = sum(s.prompt_tokens_by_source["local_cache_hit"] for s in stats)
    print(f"requests            {len(result.records)} on {args.workers} workers ({args.route})")
    print(f"wall time           {wall_s:.1f} s (CPU {cpu_s:.1f} s)")
    print(f"simulated span      {result.end_s:.1f} s ({result.end_s / wall_s:.0f}x real time)")
    print(f"engine steps        {result.num_steps}")
    print(f"prompt tokens       {prompt}")
    print(f"cached tokens       {cached} ({cached / max(prompt, 1):.1%})")
    print(f"generated tokens    {sum(s.generation_tokens_total for s in stats)}")
    print(f"preemptions         {sum(s.num_preemptions_total for s in stats)}")
    print(f"TTFT p50 / p95      {_pct(ttft, 0.5):.3f} s / {_pct(ttft, 0.95):.3f} s")
    print(f"TTFT mean           {statistics.fmean(ttft) if ttft else float('nan'):.3f} s")
    busy = [s.busy_s_total / result.end_s for s in stats] if result.end_s else []
    lo, hi = min(busy, default=0.0), max(busy, default=0.0)
    print(f"engines stepping    {lo:.0%} .. {hi:.0%} of the span")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--route", choices=("rr", "session"), default="rr")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--kv-gib", type=float, default=60.0)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-events", action="store_true", help="do not record KV events")
    p.add_argument("--profile", action="store_true", help="cProfile the replay")
    args = p.parse_args()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        result, wall_s, cpu_s = run(args)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        result, wall_s, cpu_s = run(args)
    report(result, wall_s, cpu_s, args)


if __name__ == "__main__":
    main()
