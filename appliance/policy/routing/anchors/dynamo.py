"""NVIDIA Dynamo's KV router: prefill blocks with the cache overlap credited, plus decode blocks."""

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
class DynamoConfig:
    """Dynamo's defaults: `--kv-overlap-score-weight 1`, `--router-temperature 0`."""

    overlap_score_weight: float = 1.0


class DynamoKv(Stateless):
    """NVIDIA Dynamo KV router (`DefaultWorkerSelector` in lib/llm/src/kv_router/scheduler.rs,
    now lib/kv-router/src/scheduling/selector/default.rs; docs/design_docs/router_design.md):
    per worker,
    `logit = overlap_score_weight * prefill_blocks + decode_blocks` where
    `prefill_blocks = (prefill tokens already routed there and not yet started
    + this prompt's tokens - cached blocks * block size) / block size` (overlap from the
    KV-event indexer) and `decode_blocks` = the blocks its active sequences would hold with
    this request added (blocks they already share are not counted twice). Temperature 0:
    the lowest logit wins, ties at random."""

    name = "dynamo-kv"

    def __init__(self, config: DynamoConfig | None = None) -> None:
        self.config = config or DynamoConfig()

    def logit(self, req: AnchorRequest, w: AnchorWorker) -> float:
        bs = req.block_tokens
        new_tokens = max(req.prompt_tokens - w.cached_blocks * bs, 0)
        prefill_blocks = (w.prefill_tokens + new_tokens) / bs
        request_blocks = -(-req.prompt_tokens // bs)
        decode_blocks = w.active_blocks + request_blocks - w.shared_active_blocks
        return self.config.overlap_score_weight * prefill_blocks + decode_blocks

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: None
    ) -> AnchorDecision:
        alive = healthy_workers(workers)
        logits = {w.index: self.logit(req, w) for w in alive}
        low = min(logits.values())
        best = tie_break(req, [w for w in alive if logits[w.index] == low])
        return AnchorDecision(best.index, f"lowest cost {low:.1f} blocks", logits)
