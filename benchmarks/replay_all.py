"""Replay the Mooncake conversation trace through every routing policy under every residency
baseline, and the bounds.

    .venv/bin/python benchmarks/replay_all.py [--trace FILE] [--workers 8] [--hbm-gib X]
        [--host-gib X] [--gpu-profile FILE] [--policy NAME ...] [--residency NAME ...] [--jobs 2]
        [--limit N] [--report FILE] [--replay-bounds] [--quiet]

Every routing policy (the appliance's own and the anchors': round-robin, least-loaded,
session-hash, sglang-cache-aware, llm-d-precise, dynamo-kv) under every residency policy
(default: `lru`, vLLM's own eviction, and `ttl-pin`, Continuum's pin with a fixed 60 s TTL;
`ttl-pin:SECONDS` for another TTL) replays the same 12,031 requests on the same simulated
H200s (`appliance/replay/runner.py`); a row is `ROUTING` under `lru`, `ROUTING+RESIDENCY`
otherwise. `--jobs` replays run side by side (results do not depend on it). Prints the
comparison table, the bounds and the check of the replayed no-cache and unbounded-cache
prefill against the trace's `*.stats.json` (exit status 1 when either is off by more than
1%), and writes the JSON report and the plot beside it.
`--replay-bounds` also replays the trace on one simulated worker whose KV cache never fills
and checks its fresh prefill against the same statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from appliance.replay import POLICY_NAMES, RESIDENCY_NAMES, render_table, run_replay
from appliance.replay.bounds import compute_bounds
from appliance.replay.runner import make_setup, replay_policy
from appliance.replay.traces import load_trace, trace_stats_file

ROOT = Path(__file__).resolve().parents[1]
TRACE_REL = Path("traces/mooncake_fast25/conversation_trace.jsonl")


def default_trace() -> Path:
    for shared in (ROOT / "shared", ROOT.parent / "shared", Path("/work/shared")):
        if (shared / TRACE_REL).is_file():
            return shared / TRACE_REL
    return ROOT.parent / "shared" / TRACE_REL


def replay_unbounded(trace_path: Path, gpu_profile: Path | None) -> dict[str, object]:
    """One worker with room for every block the trace ever computes: its fresh prefill is
    the unbounded-cache figure, replayed through the engine rather than counted."""
    trace = load_trace(trace_path)
    setup, latency = make_setup(workers=1, gpu_profile=gpu_profile, hbm_gib=16_000.0)
    bound = compute_bounds(trace, setup.block_size, setup.pooled_blocks)["unbounded"]
    t0 = time.perf_counter()
    m = replay_policy(trace, "round-robin", setup, latency)
    out: dict[str, object] = {
        "replayed_fresh_tokens": m["fresh_prefill_tokens"],
        "bound_fresh_tokens": bound.fresh_prefill_tokens,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    stats = trace_stats_file(trace_path)
    if stats is not None:
        s = json.loads(stats.read_text())
        expected = round(s["total_input_tokens"] * (1 - s["prefix_hit_token_ratio_infinite_cache"]))
        fresh = int(m["fresh_prefill_tokens"])  # type: ignore[call-overload]
        out["expected_fresh_tokens"] = expected
        out["relative_error"] = round((fresh - expected) / expected, 6)
        out["within_1pct"] = abs(fresh - expected) <= 0.01 * expected
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=default_trace())
    p.add_argument("--policy", action="append", choices=POLICY_NAMES, help="default: all")
    p.add_argument(
        "--residency", action="append", help="lru, ttl-pin, ttl-pin:S (default: lru, ttl-pin)"
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--hbm-gib", type=float, default=None, help="KV cache per worker")
    p.add_argument("--host-gib", type=float, default=0.0, help="host memory for KV per worker")
    p.add_argument("--gpu-profile", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 4))
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument(
        "--report", type=Path, default=Path(tempfile.gettempdir()) / "replay-report.json"
    )
    p.add_argument("--replay-bounds", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    args = p.parse_args()
    t0 = time.perf_counter()
    report = run_replay(
        args.trace,
        policies=args.policy,
        residencies=args.residency or list(RESIDENCY_NAMES),
        workers=args.workers,
        gpu_profile=args.gpu_profile,
        hbm_gib=args.hbm_gib,
        host_gib=args.host_gib,
        report=args.report,
        progress=not args.quiet,
        jobs=args.jobs,
        limit=args.limit,
    )
    print(render_table(report))
    print(f"wall time {time.perf_counter() - t0:.0f} s with --jobs {args.jobs}")
    print("written:", ", ".join(report.get("files", [])))
    ok = all(
        c.get("within_1pct", True)
        for c in report.get("trace_stats_check", {}).values()
        if isinstance(c, dict)
    )
    if args.replay_bounds:
        check = replay_unbounded(args.trace, args.gpu_profile)
        print("unbounded cache replayed on one worker:", json.dumps(check))
        ok = ok and bool(check.get("within_1pct", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
