"""The hold book over vLLM 0.32's own BlockPool (through `VllmKvPool`), run by the vLLM
interpreter with the connector's PYTHONPATH, as a worker runs it: references, the free
queue's order, eviction, and the prefix-cache reset a hold blocks. No server: ~10 s."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from appliance.engines.retention.plugin import plugin_path

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, time
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from appliance.engines.retention.holds import HoldBook
from appliance.engines.retention.protocol import RetentionEvictFirst, RetentionHold
from appliance.engines.retention.vllm_pool import VllmKvPool, check_block_pool

BS, NOW = 4, time.time()
out = {}
pool = BlockPool(num_gpu_blocks=17, enable_caching=True, hash_block_size=BS)
kv = VllmKvPool(pool)
book = HoldBook(kv, [BS])

def run(n, tag):
    # A request that fills n blocks, caches them and finishes, as the scheduler does it.
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        key = make_block_hash_with_group_id(BlockHash(f"{tag}{i}".encode()), 0)
        pool._insert_block_hash(key, b, None)
    ids = [b.block_id for b in blocks]
    entries = kv.cached_entries([ids], n * BS + 2, [BS])  # + a partial tail: not cached
    pool.free_blocks(reversed(blocks))
    return blocks, entries

def cached(blocks):
    return [b.block_hash is not None for b in blocks]

a, entries = run(4, "a")
book.finished("t/a", entries)
out["usable"] = kv.usable_blocks()
out["entries"] = len(entries[0])
book.apply(RetentionHold("t/a", NOW + 60), NOW)
out["refs_held"] = [b.ref_cnt for b in a]
out["free_held"] = pool.get_num_free_blocks()
out["reset_while_held"] = pool.reset_prefix_cache()
flood = pool.get_new_blocks(pool.get_num_free_blocks())  # everything else
out["cached_after_flood"] = cached(a)
pool.free_blocks(reversed(flood))
out["given_for_room"] = book.make_room(16)
out["refs_after_room"] = [b.ref_cnt for b in a]
out["free_after_room"] = pool.get_num_free_blocks()
out["tail_of_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()[-4:]]
out["a_ids"] = [b.block_id for b in a]

b, entries = run(3, "b")
book.finished("t/b", entries)
book.apply(RetentionHold("t/b", NOW + 60), NOW)
book.apply(RetentionEvictFirst("t/b"), NOW)
out["head_after_evict"] = [x.block_id for x in pool.free_block_queue.get_all_free_blocks()[:3]]
out["b_ids"] = [x.block_id for x in b]
taken = pool.get_new_blocks(3)
out["taken"] = [x.block_id for x in taken]
out["a_cached_after_evict"] = cached(a)
pool.free_blocks(reversed(taken))
out["reset_after"] = pool.reset_prefix_cache()
try:
    check_block_pool(object())
except RuntimeError as exc:
    out["check"] = str(exc)
print(json.dumps(out))
"""


def test_holds_over_vllms_block_pool(vllm_python: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_path(tmp_path / "plugin"))}
    done = subprocess.run(
        [vllm_python, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["usable"], out["entries"]) == (16, 4)
    assert out["refs_held"] == [1, 1, 1, 1] and out["free_held"] == 12
    assert out["reset_while_held"] is False  # vLLM's reset refuses while blocks are held
    assert out["cached_after_flood"] == [True] * 4  # the flood took every other block
    assert out["given_for_room"] == 1 and out["refs_after_room"] == [0, 0, 0, 0]
    assert out["free_after_room"] == 16
    assert out["tail_of_queue"] == out["a_ids"][::-1]  # released as vLLM frees: LRU tail
    assert out["head_after_evict"] == out["b_ids"][::-1]  # evict-first: at the head
    assert out["taken"] == out["b_ids"][::-1]  # the next allocation takes them first
    assert out["a_cached_after_evict"] == [True] * 4
    assert out["reset_after"] is True
    assert "does not fit this vLLM: it has no BlockPool.touch" in out["check"]
