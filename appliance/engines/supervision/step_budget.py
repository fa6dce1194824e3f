"""What a worker's command line says about its scheduler: the step budget, the long prefill
threshold, and with the threshold the appliance's scheduler (docs/engines.md, "The step
budget for agent turns"; pure)."""

from __future__ import annotations

from typing import Any

from appliance.engines.scheduling import SCHEDULER_CLS


def scheduler_argv(
    max_num_batched_tokens: int | None, long_prefill_token_threshold: int, plugins: bool
) -> list[str]:
    """vLLM's flags for them; `plugins`: the worker's PYTHONPATH has the appliance's plugin
    directory (the retention connector's), from which it loads the appliance's scheduler."""
    args: list[str] = []
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if long_prefill_token_threshold:
        args += ["--long-prefill-token-threshold", str(long_prefill_token_threshold)]
        if plugins:
            args += ["--scheduler-cls", SCHEDULER_CLS]
    return args


def cpu_step_budget(fields: dict[str, Any]) -> dict[str, Any]:
    """The CPU build keeps vLLM's own step budget: its steps run on the cores, where a
    larger one only makes every step longer."""
    return fields | {"max_num_batched_tokens": None, "long_prefill_token_threshold": 0}
