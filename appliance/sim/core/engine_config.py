"""The vLLM settings a simulated engine honours (`engine.py` says how each is used)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.sim.core.waiting_queue import SchedulingPolicy


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's vLLM settings (ValueError unless max_model_len fits in the cache,
    1 <= max_num_seqs <= max_num_batched_tokens and 0 <= long_prefill_token_threshold <=
    max_model_len, as vLLM checks)."""

    num_blocks: int
    """KV blocks, the null block included (vLLM's `num_gpu_blocks`)."""
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    """The most tokens one request computes in a step while others wait or run (0: no cap)."""
    prompt_a_step: bool = False
    """One prompt computes a step while two or more are in flight, the first in the queue's
    order (the appliance's `--scheduler-cls`, `appliance/engines/scheduling/`)."""
    enable_prefix_caching: bool = True
    policy: SchedulingPolicy = "fcfs"
    enable_kv_events: bool = True

    def __post_init__(self) -> None:
        blocks = -(-self.max_model_len // self.block_size)
        if blocks > self.num_blocks - 1:
            raise ValueError(
                f"max_model_len {self.max_model_len} needs {blocks} blocks "
                f"of {self.block_size}; the cache has {self.num_blocks - 1}: lower "
                "max_model_len or give the cache more blocks"
            )
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise ValueError(
                f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), as vLLM does"
            )
        if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"from 0 to max_model_len ({self.max_model_len}), as vLLM checks"
            )
