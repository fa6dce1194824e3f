"""Plain decode steps, run one by one with their outputs held back (the virtual driver's
fast path: `SimEngine.decode_step`, `virtual.replay`).

Model of the world: a step is plain when the engine has nothing to do but decode its
running batch (nothing waits, loads, is pending, prefetches or falls due: `engine.py`
checks that), nobody in the batch finishes with it, and the blocks its tokens start are
free now (no pin gives way, nobody is preempted). Such a step does what `SimEngine.step`
does, in the same order: each request computes its last token (allocating a block when
it starts one, caching the block it fills, KV events and all), then samples the next (a
block it completes is hashed); the same counters, the same duration
(`latency.decode_step_s` of the batch and its context). It calls no hook and finishes
nobody, so what it changes is the engine's own.

`plan` finds how many steps lie ahead before someone would finish; `advance` runs one, or
nothing when its new blocks are short; `take` hands over the outputs of the oldest held
steps as one `StepResult` (each request's tokens of those steps, their KV events in order,
their durations summed). A step in which no request is near a block edge (none starts,
fills or completes a block) touches no block: its tokens are only counted, and written to
the requests (`settle`) before anything else reads them (the next other step, `take`, an
abort), each the token `step` would have sampled.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.domain.kv_events import KvEvent
from appliance.perf.latency import LatencyModel
from appliance.sim.core.engine_stats import EngineCounters
from appliance.sim.core.waiting_queue import RequestState, request_output
from appliance.sim.engine_io import SimRequest, StepResult, default_output_token, output_tokens
from appliance.sim.kv.cache_request import CacheRequest
from appliance.sim.kv.prefix_cache import PrefixCache


class DecodeRun:
    """One engine's plain decode steps ahead (`left`) and those whose outputs it holds."""

    def __init__(
        self,
        cache: PrefixCache,
        latency: LatencyModel,
        token: Callable[[SimRequest, int], int],
        counters: EngineCounters,
        max_model_len: int,
    ) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        self.latency = latency
        self._token = token
        self._n = counters
        self.left = 0
        """Steps before someone in the batch would finish, as planned (0: plan again)."""
        self._batch: list[RequestState] = []  # the batch planned for
        self._quiet = 0  # steps before some request of the batch nears a block edge
        self._lag = 0  # quiet steps run but not yet written to the requests
        self._context = 0  # the next step's context: each request's computed tokens + 1
        self._batch_s: dict[int, float] = {}  # the decode step's time at no context, by batch
        self._durations: list[float] = []  # each held step's, oldest first
        self._events: list[tuple[int, list[KvEvent]]] = []  # (held step, its events)

    @property
    def held(self) -> int:
        """Steps run whose outputs have not been taken."""
        return len(self._durations)

    def plan(self, running: list[RequestState], budget: int) -> int:
        """How many steps lie ahead of `running` before one would finish a request (0: the
        next step is not a plain decode step of all of them)."""
        self.settle()
        if not running or len(running) > budget or (self._durations and running != self._batch):
            return 0
        limit = self.max_model_len - 1
        left, context = limit, 0
        for entry in running:
            creq, req = entry.cache, entry.req
            c, p = creq.num_computed_tokens, creq.num_prompt_tokens
            n = c + 1
            if n != len(creq.all_token_ids) or c < p:
                return 0
            # Steps before one finishes it: max_tokens, the model's length, its stop.
            output = n + 1 - p  # tokens generated after the next step
            left = min(left, req.max_tokens - output, limit - n)
            if not req.ignore_eos and req.eos_after is not None:
                left = min(left, req.eos_after - output)
            if left <= 0:
                return 0
            context += n
        self.left, self._context = left, context
        self._batch = list(running)
        self._quiet = self._quiet_steps()
        return left

    def advance(self) -> float | None:
        """Run one planned step and return its duration; None, nothing done, when the
        blocks it would start are not all free now."""
        edge = self._quiet <= 0
        if edge:
            self.settle()
            if not self._edge_step():
                return None
            self._quiet = self._quiet_steps()
        else:
            self._lag += 1
            self._quiet -= 1
        batch = len(self._batch)
        context, self._context = self._context, self._context + batch
        # `latency.decode_step_s(batch, context)`, the same sum: G(batch) kept per batch size.
        duration = self._batch_g(batch) + self.latency.decode.per_context_token_s * context
        n = self._n
        n.generation_tokens += batch
        n.steps += 1
        n.busy_s += duration
        if self.cache.has_events:  # the step's, or any since the engine's last step
            self._events.append((len(self._durations), self.cache.take_events()))
        self._durations.append(duration)
        self.left -= 1
        return duration

    def quiet_durations(self, now: float, due: float | None) -> list[float]:
        """The durations of the planned steps ahead, from `now`, in which no request nears a
        block edge and that start before `due` (a pin falling due), as `advance` would run
        them; nothing is run (`run_quiet` runs them)."""
        steps = min(self._quiet, self.left)
        batch = len(self._batch)
        if steps <= 0 or not batch:
            return []
        g, per_token = self._batch_g(batch), self.latency.decode.per_context_token_s
        context = self._context
        out = [g + per_token * (context + j * batch) for j in range(steps)]
        if due is None:
            return out
        start = now
        for j, duration in enumerate(out):
            if start >= due:
                return out[:j]
            start += duration
        return out

    def run_quiet(self, durations: list[float]) -> None:
        """Run the first `len(durations)` of the `quiet_durations` ahead, as as many calls
        of `advance` would: only counted, their tokens written when `settle` is due."""
        steps, batch = len(durations), len(self._batch)
        if not 0 < steps <= min(self._quiet, self.left):
            raise ValueError(f"{steps} quiet steps asked, {min(self._quiet, self.left)} ahead")
        n = self._n
        n.generation_tokens += steps * batch
        n.steps += steps
        busy = n.busy_s
        for duration in durations:  # added one by one, as `advance` adds them
            busy += duration
        n.busy_s = busy
        if self.cache.has_events:  # any since the engine's last step
            self._events.append((len(self._durations), self.cache.take_events()))
        self._durations += durations
        self._lag += steps
        self._quiet -= steps
        self.left -= steps
        self._context += steps * batch

    def _batch_g(self, batch: int) -> float:
        """`latency.decode_step_s(batch, 0)`, kept per batch size."""
        g = self._batch_s.get(batch)
        if g is None:
            g = self._batch_s[batch] = self.latency.decode.step_s(batch, 0)
        return g

    def _edge_step(self) -> bool:
        """A step near a block edge, request by request as `SimEngine.step` runs it."""
        bs, cache, batch = self.block_size, self.cache, self._batch
        if sum(e.cache.num_computed_tokens % bs == 0 for e in batch) > cache.num_free_blocks:
            return False
        for entry in batch:  # the schedule: each its one token, as `_schedule_running`
            creq = entry.cache
            c = creq.num_computed_tokens
            if c % bs and (c + 1) % bs:
                creq.num_computed_tokens = c + 1
            else:
                cache.allocate(creq, 1)  # starts a block (there is room) or fills one
        for entry in batch:  # the samples, as `SimEngine._sample`
            creq = entry.cache
            tokens = creq.all_token_ids
            t = self._token(entry.req, len(tokens) - creq.num_prompt_tokens)
            if (len(tokens) + 1) % bs:
                tokens.append(t)
            else:
                creq.append_output((t,))
        return True

    def _quiet_steps(self) -> int:
        """Steps before some request of the batch starts (computed % bs == 0), fills
        (== bs - 1) or, sampling, completes (== bs - 2) a block."""
        bs = self.block_size
        return max(min((bs - 2 - c % bs if c % bs else 0) for c in self._computed()), 0)

    def _computed(self) -> list[int]:
        return [e.cache.num_computed_tokens for e in self._batch]

    def settle(self) -> None:
        """Write the quiet steps run so far to the requests: each its computed tokens and
        the tokens it sampled."""
        lag, self._lag = self._lag, 0
        if not lag:
            return
        for entry in self._batch:
            creq = entry.cache
            creq.num_computed_tokens += lag
            creq.all_token_ids += self._sampled(entry.req, creq, lag)

    def _sampled(self, req: SimRequest, creq: CacheRequest, lag: int) -> list[int]:
        first = len(creq.all_token_ids) - creq.num_prompt_tokens
        if self._token is default_output_token:
            return output_tokens(req, first, lag)
        return [self._token(req, i) for i in range(first, first + lag)]

    def take(self, steps: int) -> StepResult:
        """The outputs of the `steps` oldest held steps, as one step's."""
        held = self._durations
        if not 0 < steps <= len(held):
            raise ValueError(f"cannot take {steps} of {len(held)} held decode steps")
        self.settle()
        duration = 0.0
        for d in held[:steps]:
            duration += d
        result = StepResult(duration, [], [], steps * len(self._batch))
        for entry in self._batch:
            tokens = entry.cache.all_token_ids
            start = len(tokens) - len(held)
            result.outputs.append(request_output(entry, tokens[start : start + steps], None))
            result.scheduled[entry.req.request_id] = steps
        while self._events and self._events[0][0] < steps:
            result.events += self._events.pop(0)[1]
        self._events = [(i - steps, events) for i, events in self._events]
        del held[:steps]
        return result
