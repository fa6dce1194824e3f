"""SGLang's cache-aware router: the approximate radix tree and the switch to balancing."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from appliance.policy.routing.anchors.base import (
    AnchorDecision,
    AnchorPolicy,
    AnchorRequest,
    AnchorWorker,
    healthy_workers,
)


class _Node:
    __slots__ = ("access", "children", "key", "parent", "tokens")

    def __init__(self, key: int, tokens: int, parent: _Node | None) -> None:
        self.key = key
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.access: dict[int, float] = {}
        """Tenant (worker index) -> last access time."""


class ApproxTree:
    """SGLang sgl-router `tree.rs`: one radix tree shared by all workers ("tenants"), each
    node marking which tenants were sent it and when. Here a node is one block of tokens
    (SGLang compares characters; a block is the unit a KV cache reuses) and sizes count
    tokens."""

    def __init__(self, tenants: int) -> None:
        self.root = _Node(0, 0, None)  # pragma: no mutate (equivalent: root key, tokens unread)
        self.size = [0] * tenants

    def match(self, req: AnchorRequest) -> tuple[int, _Node]:
        """Tokens of the longest prefix present under any tenant, and its deepest node."""
        node, matched = self.root, 0
        for i, key in enumerate(req.blocks):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            matched += req.block_len(i)
        return matched, node

    def insert(self, req: AnchorRequest, tenant: int, now: float) -> None:
        node = self.root
        node.access[tenant] = now
        for i, key in enumerate(req.blocks):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, req.block_len(i), node)
            if tenant not in child.access:
                self.size[tenant] += child.tokens
            child.access[tenant] = now
            node = child

    def smallest_tenant(self) -> int:
        """`get_smallest_tenant`: the fewest tokens (the first such tenant on ties)."""
        return min(range(len(self.size)), key=lambda t: self.size[t])

    def _nodes(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: int) -> bool:
        return tenant in node.access and not any(tenant in c.access for c in node.children.values())

    def evict(self, max_tokens: int) -> None:
        """`evict_tenant_by_size`: drop each over-size tenant's least recently used leaves
        (a parent left as its leaf queues next) until it fits."""
        if max(self.size, default=0) <= max_tokens:
            return
        heap: list[tuple[float, int, int, _Node]] = []
        seq = 0  # pragma: no mutate (equivalent: any start keeps the order of ties)
        for node in self._nodes():
            if node is self.root:
                continue
            for tenant, t in node.access.items():
                if self.size[tenant] > max_tokens and self._is_leaf_of(node, tenant):
                    heap.append((t, seq, tenant, node))
                    seq += 1
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.size[tenant] <= max_tokens or tenant not in node.access:
                continue
            self.size[tenant] -= node.tokens
            del node.access[tenant]
            parent = node.parent
            assert parent is not None
            if not node.children and not node.access:
                del parent.children[node.key]
            if parent is not self.root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.access[tenant], seq, tenant, parent))
                seq += 1


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """Defaults of SGLang's router launcher (`sglang_router/router_args.py`).
    `max_tree_tokens`: its `max_tree_size` is 2^26 characters, about 4 characters a token."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_tokens: int = 2**26 // 4


@dataclass(slots=True)
class CacheAwareState:
    tree: ApproxTree
    next_eviction_s: float


class SglangCacheAware(AnchorPolicy[CacheAwareState]):
    """SGLang sgl-router `policies/cache_aware.rs`. With loads = requests in flight per
    worker, the system is imbalanced when BOTH `max - min > balance_abs_threshold` AND
    `max > min * balance_rel_threshold`; then the least-loaded healthy worker takes the
    request. Otherwise the approximate tree (what was sent where, not what is cached)
    finds the longest matching prefix: if it covers more than `cache_threshold` of the
    prompt, the request goes to a tenant of the deepest matched node (the most recently
    used one; SGLang takes the first in an unordered map), else to the tenant with the
    smallest tree. Either way the prompt is then inserted under the chosen worker; every
    `eviction_interval_s` each tenant is trimmed to `max_tree_tokens` by LRU leaves."""

    name = "sglang-cache-aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()

    def initial_state(self, worker_urls: Sequence[str]) -> CacheAwareState:
        return CacheAwareState(ApproxTree(len(worker_urls)), self.config.eviction_interval_s)

    def advance(self, state: CacheAwareState, now: float) -> None:
        if now < state.next_eviction_s:
            return
        state.tree.evict(self.config.max_tree_tokens)
        interval = self.config.eviction_interval_s
        state.next_eviction_s += interval * ((now - state.next_eviction_s) // interval + 1)

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        c = self.config
        return hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: CacheAwareState
    ) -> AnchorDecision:
        alive = healthy_workers(workers)
        if self.imbalanced([w.in_flight for w in workers]):
            best = min(alive, key=lambda w: w.in_flight)
            return AnchorDecision(best.index, "imbalanced: shortest queue")
        matched, node = state.tree.match(req)
        rate = matched / req.prompt_tokens if req.prompt_tokens else 0.0
        by_index = {w.index: w for w in alive}
        if rate > self.config.cache_threshold and node.access:
            tenant = max(node.access, key=lambda t: (node.access[t], -t))
            reason = f"prefix match {rate:.0%}"
        else:
            tenant = state.tree.smallest_tenant()
            reason = f"prefix match {rate:.0%}: smallest tree"
        if tenant not in by_index:
            return AnchorDecision(alive[0].index, "chosen worker unhealthy: first healthy")
        return AnchorDecision(tenant, reason, {tenant: rate})

    def record(
        self, state: CacheAwareState, req: AnchorRequest, decision: AnchorDecision, now: float
    ) -> None:
        state.tree.insert(req, decision.worker, now)
