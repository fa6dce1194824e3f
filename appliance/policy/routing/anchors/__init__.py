"""The anchors' routing policies: what users run today, as pure policy objects.

Model of the world. A router in front of N engines sees, per request, its prompt (as a chain
of block keys: one key per block of `block_tokens` tokens, each naming its whole prefix, the
last block possibly partial) and, per worker, what that router's own source reads: requests
it sent there and not yet saw finish (`in_flight`), the engine's waiting queue and KV-cache
usage (vLLM's /metrics), how many leading blocks of this prompt the worker holds (an index
fed by the engines' KV events), and the prefill and decode work the router itself has routed
there (Dynamo's slot manager). Each policy (one module each) reproduces one system's decision
from those readings; its docstring names the source. Policies never read a clock or do I/O:
the caller passes `now`, and a stateful policy keeps its state in an explicit object the
caller owns:

    state = policy.initial_state(worker_urls)
    policy.advance(state, now)                        # periodic upkeep due by `now`
    decision = policy.route(request, workers, state)  # pure: the state is only read
    policy.record(state, request, decision, now)      # what the source updates on routing

Where a source breaks ties at random, the tie is broken by a hash of the request id, so a
replay is repeatable and the choice is still spread evenly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appliance.policy.routing.anchors.base import (
    AnchorDecision,
    AnchorPolicy,
    AnchorRequest,
    AnchorWorker,
    Stateless,
)
from appliance.policy.routing.anchors.consistent_hash import (
    VIRTUAL_NODES_PER_WORKER,
    HashRing,
    SessionHash,
    fbi_hash,
    furc_hash,
    murmur_hash_64a,
)
from appliance.policy.routing.anchors.dynamo import DynamoConfig, DynamoKv
from appliance.policy.routing.anchors.llmd import (
    LlmdConfig,
    LlmdPrecisePrefix,
    llmd_load_aware_score,
    llmd_prefix_scores,
    llmd_queue_scores,
)
from appliance.policy.routing.anchors.sglang import (
    ApproxTree,
    CacheAwareConfig,
    CacheAwareState,
    SglangCacheAware,
)
from appliance.policy.routing.anchors.simple import Counter, LeastLoaded, RoundRobin

ANCHORS: dict[str, Callable[[], AnchorPolicy[Any]]] = {
    p.name: p
    for p in (RoundRobin, LeastLoaded, SessionHash, SglangCacheAware, LlmdPrecisePrefix, DynamoKv)
}
"""Policy name -> constructor (no arguments: the source's defaults)."""

__all__ = [
    "ANCHORS",
    "VIRTUAL_NODES_PER_WORKER",
    "AnchorDecision",
    "AnchorPolicy",
    "AnchorRequest",
    "AnchorWorker",
    "ApproxTree",
    "CacheAwareConfig",
    "CacheAwareState",
    "Counter",
    "DynamoConfig",
    "DynamoKv",
    "HashRing",
    "LeastLoaded",
    "LlmdConfig",
    "LlmdPrecisePrefix",
    "RoundRobin",
    "SessionHash",
    "SglangCacheAware",
    "Stateless",
    "fbi_hash",
    "furc_hash",
    "llmd_load_aware_score",
    "llmd_prefix_scores",
    "llmd_queue_scores",
    "murmur_hash_64a",
]
