"""vLLM's scheduler with one change: the long prefill threshold (`--long-prefill-token-
threshold`) cuts a prompt only while another prompt is prefilling, waiting or loading.

vLLM 0.32 cuts whenever any other request runs or waits (`Scheduler.schedule`: "when it is
the only request there is nobody to starve"). Under agent traffic some turn is nearly always
decoding on a worker, so a lone 100k-token prefill was cut into 4k chunks that starved
nobody: each chunk a step of its own, the decodes riding along, the turn's TTFT paying for
every step. The threshold exists to let other prompts in beside a long one; a decode needs
one token a step, which the step budget leaves it anyway. Measured on the recorded Claude
Code sessions (docs/benchmarks.md, "Where the TTFT p95 goes").

vLLM imports this module in each worker's engine core (`--scheduler-cls` names
`cap_beside_prefill`, which vLLM calls as it would the class); the appliance never does. The
worker finds it on the PYTHONPATH the retention connector's plugin directory gives it.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler


class PrefillCapScheduler(Scheduler):
    """vLLM's `Scheduler`, its long prefill threshold set each step from the prompts in
    flight: the configured cap beside another prompt, none (0) otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Its own copy: the threshold changes each step, the engine's config does not.
        self.scheduler_config = copy.copy(self.scheduler_config)
        self._prefill_cap = self.scheduler_config.long_prefill_token_threshold

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        beside = self._prompts_in_flight() > 1
        self.scheduler_config.long_prefill_token_threshold = self._prefill_cap if beside else 0
        return super().schedule(throttle_prefills)

    def _prompts_in_flight(self) -> int:
        """Waiting requests (loading ones among them) and running ones not past their
        prompt; counted up to 2, all the rule needs."""
        _, count = self.get_request_counts()
        for request in self.running:
            if count > 1:
                break
            if request.num_computed_tokens < request.num_prompt_tokens:
                count += 1
        return count


class AsyncPrefillCapScheduler(PrefillCapScheduler, AsyncScheduler):
    """The same over vLLM's `AsyncScheduler` (async scheduling, the default on CUDA)."""


def cap_beside_prefill(**kwargs: Any) -> Scheduler:
    """What `--scheduler-cls` names: the scheduler vLLM would build (async or not, as the
    engine's config says), with the rule above."""
    if kwargs["vllm_config"].scheduler_config.async_scheduling:
        return AsyncPrefillCapScheduler(**kwargs)
    return PrefillCapScheduler(**kwargs)
