"""The cache-blind anchors: round robin and least loaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from appliance.policy.routing.anchors.base import (
    AnchorDecision,
    AnchorPolicy,
    AnchorRequest,
    AnchorWorker,
    Stateless,
    healthy_workers,
)


@dataclass(slots=True)
class Counter:
    value: int = 0


class RoundRobin(AnchorPolicy[Counter]):
    """SGLang sgl-router / vllm-router `round_robin.rs`: a shared counter, `counter %
    healthy workers`, incremented on every request, whatever the workers' state."""

    name = "round-robin"

    def initial_state(self, worker_urls: Sequence[str]) -> Counter:
        return Counter()

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: Counter
    ) -> AnchorDecision:
        alive = healthy_workers(workers)
        return AnchorDecision(alive[state.value % len(alive)].index, "next in turn")

    def record(
        self, state: Counter, req: AnchorRequest, decision: AnchorDecision, now: float
    ) -> None:
        state.value += 1


# --- least loaded ---------------------------------------------------------------------


class LeastLoaded(Stateless):
    """The shortest-queue branch of SGLang's `cache_aware.rs` (also vllm-router's): the
    healthy worker with the fewest requests in flight from this router
    (`min_by_key(load)`, the first such worker on ties)."""

    name = "least-loaded"

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: None
    ) -> AnchorDecision:
        best = min(healthy_workers(workers), key=lambda w: w.in_flight)
        return AnchorDecision(best.index, f"fewest in flight ({best.in_flight})")
