"""A session's end drops its copies from vLLM 0.32's own host tier: the hold book over vLLM's
BlockPool and its `CPUOffloadingManager` (LRU, events on), through `VllmKvPool` and
`OffloadedHostTier`, run by the vLLM interpreter with the connector's PYTHONPATH as a worker
runs them. `RetentionEvictFirst(drop_host=True)` takes the key's blocks past `keep_blocks`
out of the tier (a removal event each, their slots free for the next store) and leaves a
chunk being loaded, and other sessions' chunks, where they are. No server: ~10 s."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.engines.retention.plugin import plugin_path
from tests.vllm_server import run_in_vllm

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, time
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from appliance.engines.offload.host_view import OffloadedHostTier
from appliance.engines.retention.holds import HoldBook
from appliance.engines.retention.protocol import RetentionEvictFirst
from appliance.engines.retention.vllm_pool import VllmKvPool

BS, NOW = 4, time.time()
out = {}
pool = BlockPool(num_gpu_blocks=17, enable_caching=True, hash_block_size=BS)
manager = CPUOffloadingManager(8, cache_policy="lru", enable_events=True)
tier = OffloadedHostTier(manager)
kv = VllmKvPool(pool, tier)
book = HoldBook(kv, [BS])
ctx = ReqContext(req_id="r")
manager.on_new_request(ctx)

def run(n, tag):
    # A request that fills n blocks, caches them, stores them in the host tier, finishes.
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        key = make_block_hash_with_group_id(BlockHash(f"{tag}{i}".encode()), 0)
        pool._insert_block_hash(key, b, None)
    keys = [OffloadKey(b.block_hash) for b in blocks]
    stored = manager.prepare_store(keys, ctx)
    manager.complete_store(stored.keys_to_store, ctx)
    entries = kv.cached_entries([[b.block_id for b in blocks]], n * BS, [BS])
    pool.free_blocks(reversed(blocks))
    return keys, entries

def there(keys):
    return [manager.lookup(k, ctx) == LookupResult.HIT for k in keys]

a, entries = run(4, "a")
b, _ = run(3, "b")
list(manager.take_events())
loading = manager.prepare_load([a[3]], ctx)  # a's last chunk is being copied back
out["free_before"] = manager._get_num_free_chunks()
book.finished("t/a", entries)
book.apply(RetentionEvictFirst("t/a", keep_blocks=1, drop_host=True), NOW)
out["a_there"] = there(a)
out["b_there"] = there(b)
out["free_after"] = manager._get_num_free_chunks()
events = list(manager.take_events())
out["removed"] = [e.removed for e in events]
out["removed_keys"] = sorted(k.hex() for e in events for k in e.keys)
out["dropped_keys"] = sorted(k.hex() for k in a[1:3])
manager.complete_load([a[3]], ctx)
new = [OffloadKey(make_block_hash_with_group_id(BlockHash(f"c{i}".encode()), 0)) for i in range(2)]
store = manager.prepare_store(new, ctx)
out["evicted_for_new"] = [k.hex() for k in store.evicted_keys]
out["dropped_again"] = tier.drop([k for k in a[1:3]])
print(json.dumps(out))
"""


def test_a_sessions_end_drops_its_copies_from_vllms_host_tier(
    vllm_python: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_path(tmp_path / "plugin"))}
    out = run_in_vllm(vllm_python, SCRIPT, None, env=env, timeout=180)
    assert out["free_before"] == 1  # 7 of 8 chunks stored
    # Its first block kept (keep_blocks), the next two dropped, the last one being loaded.
    assert out["a_there"] == [True, False, False, True]
    assert out["b_there"] == [True, True, True]
    assert out["free_after"] == 3
    assert out["removed"] == [True] and out["removed_keys"] == out["dropped_keys"]
    assert out["evicted_for_new"] == []  # the dropped chunks' slots took the new ones
    assert out["dropped_again"] == 0
