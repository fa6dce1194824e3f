"""llm-d's inference scheduler: the precise prefix-cache scorer plus load scorers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from appliance.policy.routing.anchors.base import (
    AnchorDecision,
    AnchorRequest,
    AnchorWorker,
    Stateless,
    healthy_workers,
    tie_break,
)


@dataclass(frozen=True, slots=True)
class LlmdConfig:
    """Weights of llm-d's precise-prefix-cache-aware guide (`gaie-kv-events/values.yaml`):
    precise-prefix-cache-scorer 3, kv-cache-utilization-scorer 2, queue-scorer 2.
    `load_aware_weight` adds llm-d's load-aware-scorer (threshold 128), off there."""

    prefix_weight: float = 3.0
    kv_utilization_weight: float = 2.0
    queue_weight: float = 2.0
    load_aware_weight: float = 0.0
    queue_threshold: int = 128


def llmd_prefix_scores(workers: Sequence[AnchorWorker]) -> dict[int, float]:
    """precise-prefix-cache-scorer: longest run of leading blocks resident per pod
    (kv-cache-manager `LongestPrefixScorer`; only pods holding block 0 get a score), then
    min-max normalised over those pods (`indexedScoresToNormalizedScoredPods`): one such
    pod scores 1, the pod with the shortest run 0, pods with no run 0."""
    hits = {w.index: w.cached_blocks for w in workers if w.cached_blocks > 0}
    lo, hi = min(hits.values(), default=0), max(hits.values(), default=0)
    return {
        w.index: (1.0 if hi == lo else (hits[w.index] - lo) / (hi - lo)) if w.index in hits else 0.0
        for w in workers
    }


def llmd_queue_scores(workers: Sequence[AnchorWorker]) -> dict[int, float]:
    """GIE queue-scorer: `(max - waiting) / (max - min)` over the candidates, 1 if equal."""
    lo = min(w.waiting for w in workers)
    hi = max(w.waiting for w in workers)
    return {w.index: 1.0 if hi == lo else (hi - w.waiting) / (hi - lo) for w in workers}


def llmd_load_aware_score(w: AnchorWorker, threshold: int) -> float:
    """llm-d load-aware-scorer: 0.5 with an empty queue, falling to 0 at `threshold`."""
    if w.waiting == 0:
        return 0.5
    return 0.5 * (1.0 - min(w.waiting, threshold) / threshold)


class LlmdPrecisePrefix(Stateless):
    """llm-d inference scheduler: filters (healthy pods), weighted scorers, max-score-picker
    (random among equal scores). Scorers: `precise-prefix-cache-scorer`
    (pkg/plugins/scorer/precise_prefix_cache.go, the index fed by vLLM KV events),
    `kv-cache-utilization-scorer` (1 - usage) and `queue-scorer` (GIE), optionally
    `load-aware-scorer` (pkg/plugins/scorer/load_aware.go)."""

    name = "llm-d-precise"

    def __init__(self, config: LlmdConfig | None = None) -> None:
        self.config = config or LlmdConfig()

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: None
    ) -> AnchorDecision:
        alive = healthy_workers(workers)
        c = self.config
        prefix, queue = llmd_prefix_scores(alive), llmd_queue_scores(alive)
        total = {
            w.index: c.prefix_weight * prefix[w.index]
            + c.kv_utilization_weight * (1.0 - w.kv_usage)
            + c.queue_weight * queue[w.index]
            + c.load_aware_weight * llmd_load_aware_score(w, c.queue_threshold)
            for w in alive
        }
        top = max(total.values())
        best = tie_break(req, [w for w in alive if total[w.index] == top])
        return AnchorDecision(best.index, f"max score ({best.cached_blocks} blocks hit)", total)
