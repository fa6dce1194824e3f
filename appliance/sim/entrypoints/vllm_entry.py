"""A simulated worker started the way vLLM is: `python -m appliance.sim.entrypoints.vllm_entry`
takes `vllm.entrypoints.openai.api_server`'s command line (the flags
appliance/engines/supervision/launch.py writes) and environment, so the supervisor can start, watch,
sleep, stop and wake a simulated worker exactly as it does a vLLM one (`LaunchSpec.entrypoint`).

Read from vLLM's flags: --model (a directory: its tokenizer; else only a name),
--served-model-name, --host, --port, --block-size, --prefix-caching-hash-algo,
--scheduling-policy, --max-model-len, --max-num-batched-tokens (default vLLM's on an H200,
8192), --long-prefill-token-threshold, --kv-cache-memory-bytes (the pool in blocks of the
GPU profile's bytes per token), --kv-offloading-size (GiB of host tier, vLLM's native
offloading, in the same blocks), --enable-auto-tool-choice, --kv-events-config (endpoint
and topic), --kv-transfer-config (the retention connector's settings: the simulated worker
speaks its control protocol, `sim/kv/retention.py`). From the
environment: VLLM_SERVER_DEV_MODE=1 (the dev routes, sleep mode's among them) and
PYTHONHASHSEED. Every other vLLM flag is accepted and ignored (--enable-sleep-mode
included: the routes come with dev mode, as in vLLM). The simulator's own knobs follow
with a `--sim-` prefix: --sim-time-scale, --sim-wake-s L1,L2 (seconds, see sleep_mode.py),
--sim-startup-s (the model load before /health answers), --sim-gpu-profile.
`appliance up --engine sim` starts its workers this way
(appliance/engines/supervision/sim_launch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance import eventloop
from appliance.engines.retention.plugin import CONNECTOR_CLASS, RetentionTuning
from appliance.engines.scheduling import SCHEDULER_CLS
from appliance.perf.profile import bundled_profile, load_profile
from appliance.sim.entrypoints.serving import serve_worker
from appliance.sim.runtime.sleep_mode import SIM_WAKE_S
from appliance.sim.runtime.worker import SimWorker, WorkerConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance.sim.entrypoints.vllm_entry", allow_abbrev=False)
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-caching-hash-algo", default="sha256_cbor")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--scheduler-cls", default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--kv-offloading-size", type=float, default=None)
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--kv-events-config", default=None)
    p.add_argument("--kv-transfer-config", default=None)
    p.add_argument("--sim-time-scale", type=float, default=1.0)
    p.add_argument("--sim-wake-s", default=",".join(str(s) for s in SIM_WAKE_S))
    p.add_argument("--sim-startup-s", type=float, default=0.0)
    p.add_argument("--sim-gpu-profile", default=None)
    return p


def worker_config(argv: Sequence[str], env: dict[str, str]) -> WorkerConfig:
    """The simulated worker vLLM's command line (and environment) describes."""
    args, _ = _parser().parse_known_args(list(argv))
    wake = tuple(float(s) for s in args.sim_wake_s.split(","))
    if len(wake) != 2:
        raise SystemExit(f"--sim-wake-s takes two seconds, L1,L2; got {args.sim_wake_s!r}")
    if args.scheduler_cls not in (None, SCHEDULER_CLS):
        raise SystemExit(
            f"--scheduler-cls: the simulated worker runs vLLM's scheduler or {SCHEDULER_CLS}; "
            f"got {args.scheduler_cls!r}"
        )
    events: dict[str, Any] = json.loads(args.kv_events_config or "{}")
    model_dir = args.model if args.model and Path(args.model).is_dir() else None
    config = WorkerConfig(
        served_model_name=args.served_model_name or args.model or "sim",
        model=model_dir,
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        hash_algo=args.prefix_caching_hash_algo,
        python_hash_seed=env.get("PYTHONHASHSEED"),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        prompt_a_step=args.scheduler_cls == SCHEDULER_CLS,
        scheduling_policy=args.scheduling_policy,
        kv_events_endpoint=events.get("endpoint") if events.get("enable_kv_cache_events") else None,
        kv_events_topic=events.get("topic", ""),
        gpu_profile=args.sim_gpu_profile,
        time_scale=args.sim_time_scale,
        dev_mode=env.get("VLLM_SERVER_DEV_MODE") == "1",
        wake_s=(wake[0], wake[1]),
        startup_s=args.sim_startup_s,
    )
    profile = load_profile(args.sim_gpu_profile) if args.sim_gpu_profile else bundled_profile()
    per_block = args.block_size * profile.kv_bytes_per_token
    if args.kv_cache_memory_bytes is not None:
        blocks = max(2, args.kv_cache_memory_bytes // per_block)
        config = replace(config, num_gpu_blocks=blocks)
    if args.kv_offloading_size:  # GiB, as vLLM's flag
        host = max(1, int(args.kv_offloading_size * 2**30) // per_block)
        config = replace(config, num_host_blocks=host)
    return replace(config, enable_auto_tool_choice=args.enable_auto_tool_choice)


def retention_tuning(argv: Sequence[str]) -> RetentionTuning | None:
    """The retention connector's settings in --kv-transfer-config; None: it loads none."""
    args, _ = _parser().parse_known_args(list(argv))
    transfer: dict[str, Any] = json.loads(args.kv_transfer_config or "{}")
    if transfer.get("kv_connector") != CONNECTOR_CLASS:
        return None
    return RetentionTuning.from_extra(transfer.get("kv_connector_extra_config"))


def run_vllm_entry(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    config = worker_config(args, dict(os.environ))
    print(f"INFO simulated vLLM worker {config.served_model_name!r} starting", flush=True)
    time.sleep(config.startup_s * config.time_scale)  # loading the model: no port yet
    eventloop.run(serve_worker(SimWorker(config, retention=retention_tuning(args))))


if __name__ == "__main__":
    run_vllm_entry()
