"""The measuring run of `appliance profile`, inside the interpreter that has vLLM.

Run as a script (`python box_measure.py PLAN_JSON OUT_JSON`), so it imports nothing of the
appliance: vLLM's offline engine (`vllm.LLM`) on the worker's own device, with the flags a
worker gets (block size, prefix caching, eager on the CPU build, the KV cache dtype), times:

- full prefills: random prompts of each length, one output token, nothing cached;
- prefills on a cached context: the context once, then `fresh` new tokens after it;
- decode steps: B cached prompts of a context length, timed with 1 and with 1 + K output
  tokens; a step is the difference over K;
- copies between host memory and the device: pinned host <-> CUDA on a GPU; on the CPU
  build, whose KV lives in host memory, one host buffer into another (`copy_kind` says so).

Each figure is the median of `reps` runs after one unmeasured run. Progress lines go to
stderr with the prefix `profile:`; the result is one JSON object written to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any


def _median(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _say(text: str) -> None:
    print(f"profile: {text}", file=sys.stderr, flush=True)


class _Engine:
    """vLLM's offline engine and random prompts that never share a first block."""

    def __init__(self, plan: dict[str, Any]) -> None:
        from vllm import LLM

        kw: dict[str, Any] = {
            "model": plan["model"],
            "block_size": plan["block_size"],
            "enable_prefix_caching": True,
            "enforce_eager": plan["device"] == "cpu",
            "max_model_len": plan["max_model_len"],
            "kv_cache_dtype": plan["kv_cache_dtype"],
            "seed": 0,
        }
        if plan.get("kv_cache_memory_bytes"):
            kw["kv_cache_memory_bytes"] = plan["kv_cache_memory_bytes"]
        self.llm = LLM(**kw)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.rng = random.Random(0)

    def tokens(self, n: int) -> list[int]:
        top = max(self.vocab - 1, 11)
        return [self.rng.randrange(10, top) for _ in range(n)]

    def run(self, prompts: list[list[int]], out_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=out_tokens, min_tokens=out_tokens, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        self.llm.generate(batch, params, use_tqdm=False)

    def prefill(self, n: int) -> None:
        """A prompt of `n` tokens no other shares a block with."""
        self.run([self.tokens(n)])

    def extend(self, context: list[int], fresh: int) -> None:
        """`fresh` new tokens after a (cached) context."""
        self.run([context + self.tokens(fresh)])


def _prefills(engine: _Engine, plan: dict[str, Any], out: dict[str, Any]) -> None:
    reps = plan["reps"]
    out["full_prefill_s"] = {}
    for n in plan["prefill_tokens"]:
        s = _median(partial(engine.prefill, n), reps)
        out["full_prefill_s"][str(n)] = s
        _say(f"prefill of {n} tokens: {s * 1e3:.1f} ms")
    fresh = plan["fresh_tokens"]
    out["incremental_prefill_fresh_tokens"] = fresh
    out["incremental_prefill_s"] = {}
    for ctx in plan["reused_tokens"]:
        context = engine.tokens(ctx)
        engine.run([context])  # cached from now on
        s = _median(partial(engine.extend, context, fresh), reps)
        out["incremental_prefill_s"][str(ctx)] = s
        _say(f"prefill of {fresh} tokens on {ctx} cached: {s * 1e3:.1f} ms")


def _decode_step(engine: _Engine, batch: int, context: int, steps: int, reps: int) -> float:
    prompts = [engine.tokens(context) for _ in range(batch)]
    engine.run(prompts)  # cached: both timed runs prefill only the last partial block
    one = _median(partial(engine.run, prompts), reps)
    more = _median(partial(engine.run, prompts, 1 + steps), reps)
    return max(more - one, 1e-9) / steps


def _decodes(engine: _Engine, plan: dict[str, Any], out: dict[str, Any]) -> None:
    steps, reps = plan["decode_tokens"], plan["reps"]
    out["decode_step_s"] = {}
    for ctx in plan["decode_contexts"]:
        s = _decode_step(engine, 1, ctx, steps, reps)
        out["decode_step_s"][str(ctx)] = s
        _say(f"decode step, batch 1, {ctx} tokens of context: {s * 1e3:.2f} ms")
    out["batched_decode_step_s"] = {}
    ctx = plan["decode_contexts"][0]
    for batch in plan["batch_sizes"]:
        s = _decode_step(engine, batch, ctx, steps, reps)
        out["batched_decode_step_s"][f"B{batch}_ctx{ctx}"] = s
        _say(f"decode step, batch {batch}, {ctx} tokens of context each: {s * 1e3:.2f} ms")


def _copies(plan: dict[str, Any], out: dict[str, Any]) -> None:
    import torch

    cuda = plan["device"] == "cuda"
    out["copy_kind"] = (
        "pinned host memory <-> CUDA device memory"
        if cuda
        else "host buffer -> host buffer (vLLM's CPU build keeps KV in host memory: no device)"
    )
    out["copy_gbps"] = {}
    for nbytes in plan["copy_bytes"]:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
        reps = max(plan["reps"], 5)
        h2d = _median(partial(_copy, dev, host, cuda), reps)
        d2h = _median(partial(_copy, host, dev, cuda), reps)
        out["copy_gbps"][f"b{nbytes}"] = {
            "bytes": nbytes,
            "h2d": nbytes / h2d / 1e9,
            "d2h": nbytes / d2h / 1e9,
        }
        _say(f"copy of {nbytes / 2**20:.2f} MiB: {nbytes / h2d / 1e9:.1f} GB/s in")
        del host, dev


def _copy(into: Any, source: Any, cuda: bool) -> None:
    import torch

    into.copy_(source, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()


def _device_facts(engine: _Engine, plan: dict[str, Any], out: dict[str, Any]) -> None:
    import torch
    import vllm

    out["device"] = plan["device"]
    out["torch"] = torch.__version__
    out["vllm"] = getattr(vllm, "__version__", None)
    out["kv_cache_dtype"] = plan["kv_cache_dtype"]
    out["model_dtype"] = str(engine.llm.llm_engine.model_config.dtype)
    if plan["device"] == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["memory_bytes"] = torch.cuda.mem_get_info()[1]
    else:
        out["gpu"] = f"CPU ({_cpu_name()}, vLLM's CPU build)"
        out["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _main(argv: list[str]) -> int:
    plan = json.loads(argv[1])
    engine = _Engine(plan)
    _say(f"vLLM started on {plan['device']}")
    out: dict[str, Any] = {}
    _device_facts(engine, plan, out)
    _prefills(engine, plan, out)
    _decodes(engine, plan, out)
    _copies(plan, out)
    with open(argv[2], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":  # the CPU build spawns processes that import the main module
    sys.exit(_main(sys.argv))
