"""The CPU build's host-tier copies (`appliance.engines.offload.host_copy.TorchCopyWorker`)
on vLLM 0.32's own transfer specs and KV layout types, run by the vLLM interpreter as a
worker runs them: blocks stored to host chunks and loaded back into other blocks come back
byte for byte, one block a chunk and several (a run entered part way). No server: ~10 s."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from appliance.engines.retention.plugin import plugin_path

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from appliance.engines.offload.host_copy import TorchCopyWorker

def run(per_chunk, store_blocks, chunks, first, load_blocks):
    torch.manual_seed(0)
    regions = [torch.randint(-128, 127, (16, 96), dtype=torch.int8) for _ in range(2)]
    before = [r.clone() for r in regions]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(r, 96) for r in regions],
        [[CanonicalKVCacheRef(0, 96), CanonicalKVCacheRef(1, 96)]],
    )
    worker = TorchCopyWorker(caches, per_chunk, 8)
    n = len(store_blocks)
    assert worker.submit_store(1, GPULoadStoreSpec(store_blocks, [n], [first]),
                               CPULoadStoreSpec(chunks))
    for r in regions:
        r[store_blocks] = 0  # the GPU blocks reused meanwhile
    assert worker.submit_load(2, CPULoadStoreSpec(chunks),
                              GPULoadStoreSpec(load_blocks, [n], [first]))
    done = worker.get_finished()
    same = all(torch.equal(r[load_blocks], b[store_blocks]) for r, b in zip(regions, before))
    untouched = [i for i in range(16) if i not in store_blocks + load_blocks]
    kept = all(torch.equal(r[untouched], b[untouched]) for r, b in zip(regions, before))
    return {"same": same, "kept": kept, "jobs": [d.job_id for d in done],
            "bytes": [d.transfer_size for d in done], "again": len(worker.get_finished())}

print(json.dumps({
    "one": run(1, [3, 5, 9], [0, 6, 2], 0, [10, 11, 12]),
    "two": run(2, [3, 5, 9], [4, 1], 1, [10, 11, 12]),
}))
"""


def test_blocks_stored_to_the_host_tier_load_back_byte_for_byte(
    vllm_python: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_path(tmp_path / "plugin"))}
    done = subprocess.run(
        [vllm_python, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("one", "two"):  # one block a chunk; two, the run entering its first at 1
        assert out[case]["same"] and out[case]["kept"], out
        assert out[case]["jobs"] == [1, 2] and out[case]["again"] == 0
        assert out[case]["bytes"] == [3 * 2 * 96, 3 * 2 * 96]
