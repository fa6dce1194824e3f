"""Each worker's GPU-seconds, and each attempt's share of them (`gpu_seconds` pricing).

A worker is busy while the router has an attempt in flight there. Its busy time, times its
GPUs, is divided among the attempts it served in proportion to their modelled compute: the
fresh prefill at the cost model's prefill curve (scaled by the worker's measured slowdown),
plus one decode step per output token. The division happens as attempts end: the busy time
since the last one is a pool, and the attempt that ends takes the share its compute bears to
its own plus what the attempts still in flight have done so far (their estimated prefill and
the chunks a stream has relayed, one token each); the rest stays in the pool for them. So
the attempts' `gpu_s` add up to the worker's busy time exactly, however they overlap, and
its idle time (awake, nothing in flight) is overhead: services/workers/box_usage.py records it per
period and policy/overhead.py spreads it over the work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from appliance.domain.records import TurnId, WorkerId
from appliance.policy.routing import PrefillCost
from appliance.ports import Clock
from appliance.services.turns.turn import Attempt, cached_tokens


class ComputeCost(PrefillCost, Protocol):
    """The GPU profile's prefill and decode timing (perf.latency.LatencyModel)."""

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class GpuTime:
    """One worker's GPU-seconds since the meter started."""

    awake_s: float
    busy_s: float
    resting_s: float = 0.0
    """Asleep or stopped by the worker reaper: not awake, nothing to charge."""

    @property
    def idle_s(self) -> float:
        return max(0.0, self.awake_s - self.busy_s)


@dataclass(slots=True)
class _Running:
    attempt: Attempt
    step_s: float
    """The cost model's decode step for this attempt's context, alone in the batch."""

    def done_s(self) -> float:
        """The compute it has done so far, as far as the router has seen."""
        return self.attempt.estimated_prefill_s + self.step_s * self.attempt.chunks


@dataclass(slots=True)
class _Worker:
    since: float
    """When the busy time not yet divided began (the last change while busy)."""
    pool_s: float = 0.0
    busy_s: float = 0.0
    running: dict[TurnId, _Running] = field(default_factory=dict)


class GpuMeter:
    def __init__(
        self,
        clock: Clock,
        cost: ComputeCost,
        slowdown: Callable[[WorkerId], float],
        gpus_per_worker: int = 1,
    ) -> None:
        self._clock = clock
        self._cost = cost
        self._slowdown = slowdown
        self._gpus = self.gpus_per_worker = gpus_per_worker
        self._started = clock.now()
        self._workers: dict[WorkerId, _Worker] = {}
        self._rested: dict[WorkerId, float] = {}  # resting seconds, before `_resting_since`
        self._resting_since: dict[WorkerId, float] = {}
        self.charged_s = 0.0
        """GPU-seconds divided among the attempts that ended so far (all workers)."""

    def rests(self, worker: WorkerId, resting: bool, now: float) -> None:
        """The worker went to sleep or stopped (`resting`), or is awake again (its wake
        counts as awake): its awake time stops, or goes on."""
        since = self._resting_since.pop(worker, None)
        if since is not None:
            self._rested[worker] = self._rested.get(worker, 0.0) + now - since
        if resting:
            self._resting_since[worker] = now

    def began(self, attempt: Attempt, prompt_tokens: int) -> None:
        worker = self._advance(attempt.worker, attempt.started_at)
        step = self._cost.decode_step_s(1, prompt_tokens)
        worker.running[attempt.turn_id] = _Running(attempt, step)

    def ended(self, attempt: Attempt) -> float:
        """The attempt ended now: its GPU-seconds (the module docstring)."""
        worker = self._advance(attempt.worker, self._clock.now())
        mine = worker.running.pop(attempt.turn_id, None)
        if mine is None:
            return 0.0
        compute = self._compute_s(mine)
        others = sum(r.done_s() for r in worker.running.values())
        if not worker.running:
            share = worker.pool_s
        elif compute + others > 0:
            share = worker.pool_s * compute / (compute + others)
        else:
            share = worker.pool_s / (len(worker.running) + 1)
        worker.pool_s -= share
        self.charged_s += share
        return share

    def in_flight(self, worker: WorkerId) -> int:
        """The router's attempts in flight at the worker."""
        state = self._workers.get(worker)
        return len(state.running) if state is not None else 0

    def reading(self, worker: WorkerId) -> GpuTime:
        """`worker`'s awake and busy GPU-seconds, up to now."""
        now = self._clock.now()
        state = self._workers.get(worker)
        busy = 0.0
        if state is not None:
            busy = state.busy_s + (self._gpus * (now - state.since) if state.running else 0.0)
        since = self._resting_since.get(worker)
        rested = self._rested.get(worker, 0.0) + (now - since if since is not None else 0.0)
        resting, up = self._gpus * rested, self._gpus * (now - self._started)
        return GpuTime(awake_s=up - resting, busy_s=busy, resting_s=resting)

    def _advance(self, worker_id: WorkerId, now: float) -> _Worker:
        worker = self._workers.setdefault(worker_id, _Worker(since=now))
        if worker.running and now > worker.since:
            gpu_s = self._gpus * (now - worker.since)
            worker.pool_s += gpu_s
            worker.busy_s += gpu_s
        worker.since = max(worker.since, now)
        return worker

    def _compute_s(self, mine: _Running) -> float:
        """The ended attempt's modelled compute: from the worker's own counts when it gave
        them, else what the router saw it do."""
        usage = mine.attempt.usage
        if not usage.get("prompt_tokens"):
            return mine.done_s()
        prompt = int(usage["prompt_tokens"])
        cached = min(cached_tokens(usage) or 0, prompt)
        prefill = self._cost.prefill_s(prompt - cached, cached) * self._slowdown(
            mine.attempt.worker
        )
        return prefill + int(usage.get("completion_tokens") or 0) * mine.step_s
