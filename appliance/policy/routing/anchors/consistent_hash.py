"""vllm-router's consistent hashing: MurmurHash64A, furc_hash and the ring of virtual nodes."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.policy.routing.anchors.base import (
    AnchorDecision,
    AnchorPolicy,
    AnchorRequest,
    AnchorWorker,
    healthy_workers,
)

_M64 = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1
_FURC_SEED = 4193360111
_FURC_SHIFT = 23
_FURC_MAX_TRIES = 32
VIRTUAL_NODES_PER_WORKER = 160


def murmur_hash_64a(key: bytes, seed: int) -> int:
    """MurmurHash64A (mcrouter lib/fbi/hash.c), as vllm-router's consistent_hash.rs has it."""
    h = (seed ^ (len(key) * _M64)) & _MASK
    full = len(key) - len(key) % 8
    for i in range(0, full, 8):
        k = (int.from_bytes(key[i : i + 8], "little") * _M64) & _MASK
        k ^= k >> 47
        h ^= (k * _M64) & _MASK
        h = (h * _M64) & _MASK
    rest = key[full:]
    if rest:
        h ^= int.from_bytes(rest, "little")
        h = (h * _M64) & _MASK
    h ^= h >> 47
    h = (h * _M64) & _MASK
    return h ^ (h >> 47)


def _murmur_rehash_64a(k: int) -> int:
    h = (_FURC_SEED ^ (8 * _M64)) & _MASK
    k = (k * _M64) & _MASK
    k ^= k >> 47
    h ^= (k * _M64) & _MASK
    h = (h * _M64) & _MASK
    h ^= h >> 47
    h = (h * _M64) & _MASK
    return h ^ (h >> 47)


def furc_hash(key: bytes, m: int) -> int:
    """vllm-router's port of Facebook's furc_hash (mcrouter), a consistent hash of `key` into
    [0, m). The port tests its depth before decrementing it (`if d == 0 return 0; d -= 1`,
    where mcrouter's C has `if (--d == 0) return 0`), so some keys land one bucket higher;
    this anchor follows the port, bit for bit (for the ring's 2^23-1 buckets about 2^-22 of
    keys differ)."""
    if m <= 1:
        return 0
    cache: list[int] = []

    def bit(idx: int) -> int:
        ord_ = idx >> 6
        while len(cache) <= ord_:
            prev = cache[-1] if cache else None
            cache.append(
                murmur_hash_64a(key, _FURC_SEED) if prev is None else _murmur_rehash_64a(prev)
            )
        return (cache[ord_] >> (idx & 63)) & 1

    d = 0  # pragma: no mutate (equivalent: m >= 2 here, so d ends at ceil(log2 m) from 0 or 1)
    while m > (1 << d):
        d += 1
    a = d
    for _ in range(_FURC_MAX_TRIES):
        while not bit(a):
            if d == 0:
                return 0
            d -= 1
            a = d
        a += _FURC_SHIFT
        num = 1
        for _ in range(max(d - 1, 0)):
            num = (num << 1) | bit(a)
            a += _FURC_SHIFT
        if num < m:
            return num
    return 0


def fbi_hash(key: str) -> int:
    """vllm-router's ring hash: furc_hash into 2^23-1 buckets, spread to 64 bits."""
    bucket = furc_hash(key.encode(), (1 << 23) - 1)
    return murmur_hash_64a(bucket.to_bytes(4, "little"), _FURC_SEED)


@dataclass(slots=True)
class HashRing:
    points: list[int]
    urls: list[str]


class SessionHash(AnchorPolicy[HashRing]):
    """vllm-router `consistent_hash.rs`: 160 virtual nodes per worker (`"{url}:{i}"`) on a
    ring of `fbi_hash` values; a request goes to the first node at or after the hash of its
    key, wrapping round. The key is the session (`header:x-session-id:{id}`, what the
    router reads first), else the request itself. An unhealthy target falls back to the
    first healthy worker."""

    name = "session-hash"

    def initial_state(self, worker_urls: Sequence[str]) -> HashRing:
        ring: dict[int, str] = {}
        for url in worker_urls:
            for i in range(VIRTUAL_NODES_PER_WORKER):
                ring[fbi_hash(f"{url}:{i}")] = url
        points = sorted(ring)
        return HashRing(points, [ring[p] for p in points])

    @staticmethod
    def key(req: AnchorRequest) -> str:
        if req.session_id:
            return f"header:x-session-id:{req.session_id}"
        return f"request:{req.request_id}"

    def route(
        self, req: AnchorRequest, workers: Sequence[AnchorWorker], state: HashRing
    ) -> AnchorDecision:
        i = bisect.bisect_left(state.points, fbi_hash(self.key(req)))
        url = state.urls[i % len(state.urls)]
        target = next((w for w in workers if w.url == url), None)
        if target is not None and target.healthy:
            return AnchorDecision(target.index, f"ring owner of {self.key(req)}")
        return AnchorDecision(healthy_workers(workers)[0].index, "ring owner unavailable")
