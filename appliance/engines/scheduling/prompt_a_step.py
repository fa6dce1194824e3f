"""vLLM's scheduler with one change: while two or more prompts are in flight on the worker,
one prompt computes a step, the first in the queue's order, with the whole step.

Under agent traffic a worker runs decoding turns beside a few prompts: short turns that
append a few thousand tokens to a long cached prefix, and now and then a long first turn or
a miss. vLLM 0.32 computes every prompt in flight in the same step, each cut to the long
prefill threshold beside others, so a short turn's step also carries a long prompt's chunk
(at 100k tokens of context a 4096-token chunk costs about what the turn itself does). Here
the prompts go one after another, the first in the queue's order (under the appliance's
`priority` policy: the turn's priority, then its arrival; the router ranks turns by their
estimated prefill, so the shortest goes first), which brings every turn's first token
earlier but the last one's, and none later than computing them side by side would (a
step's prefill cost is about the sum of its chunks'). Decodes run in every step as before.

How, on vLLM's own `schedule`: for the step, the other running prompts are taken out of
`running` (they keep their blocks and are put back after, in their places) and admissions
are limited (`max_num_active_reqs`): none while the first prompt runs, at most one (it)
while it waits at the head of the queue. A first prompt left out of its step (it did not fit
beside the paused prompts' blocks) gives the next step to vLLM's own rule, so that they go
on and free their blocks. The long prefill threshold is never applied.

vLLM imports this module in each worker's engine core (`--scheduler-cls` names
`one_prompt_a_step`, which vLLM calls as it would the class); the appliance never does. The
worker finds it on the PYTHONPATH the retention connector's plugin directory gives it.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


class PromptAStepScheduler(Scheduler):
    """vLLM's `Scheduler`, one prompt a step (the module says how)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Its own copy: no prompt shares a step, so there is nothing to cut for.
        self.scheduler_config = copy.copy(self.scheduler_config)
        self.scheduler_config.long_prefill_token_threshold = 0
        self._first_stalled = False

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        first = None if self._first_stalled else self._first_prompt()
        self._first_stalled = False
        if first is None:
            return super().schedule(throttle_prefills)
        everyone = self.running
        paused = {id(r) for r in everyone if r is not first and _in_prompt(r)}
        self.running = [r for r in everyone if id(r) not in paused]
        limit = self.max_num_active_reqs
        if self._waiting_head() is first:
            busy = len(self.running) + self.num_waiting_for_streaming_input
            self.max_num_active_reqs = min(limit - len(paused), busy + 1)
        else:
            self.max_num_active_reqs = 0
        try:
            out = super().schedule(throttle_prefills)
            # Left out (it did not fit beside the paused prompts' blocks): for one step
            # they go on, or it would wait for them forever.
            self._first_stalled = first.request_id not in out.num_scheduled_tokens
            return out
        finally:
            self.max_num_active_reqs = limit
            before = {id(r) for r in everyone}
            kept = {id(r) for r in self.running} | paused
            admitted = [r for r in self.running if id(r) not in before]
            self.running = [r for r in everyone if id(r) in kept] + admitted

    def _first_prompt(self) -> Request | None:
        """While two or more prompts are in flight (running requests short of their
        prompt, waiting ones), the first of them in the queue's order; else None."""
        prompts = [r for r in self.running if _in_prompt(r)]
        _, waiting = self.get_request_counts()
        if len(prompts) + waiting < 2:
            return None
        head = self._waiting_head()
        if head is not None:
            prompts.append(head)
        if not prompts:
            return None
        if self.policy.value == "priority":
            return min(prompts)  # Request.__lt__: priority, arrival, request id
        return min(prompts, key=lambda r: (r.arrival_time, r.request_id))

    def _waiting_head(self) -> Request | None:
        """The request the next admission looks at first (vLLM drains the requests that
        hold KV blocks first)."""
        for queue in (self.kv_holding_waiting, self.waiting):
            if queue:
                return queue.peek_request()
        return None


class AsyncPromptAStepScheduler(PromptAStepScheduler, AsyncScheduler):
    """The same over vLLM's `AsyncScheduler` (async scheduling, the default on CUDA)."""


def one_prompt_a_step(**kwargs: Any) -> Scheduler:
    """What `--scheduler-cls` names: the scheduler vLLM would build (async or not, as the
    engine's config says), one prompt a step."""
    if kwargs["vllm_config"].scheduler_config.async_scheduling:
        return AsyncPromptAStepScheduler(**kwargs)
    return PromptAStepScheduler(**kwargs)


def _in_prompt(request: Request) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens
