"""The simulated host tier (`appliance.sim.kv.host_tier.HostTier`) against vLLM 0.32's own
`CPUOffloadingManager` with its default LRU policy, driven the way the OffloadingConnector
drives it and the sim's prefix cache drives the tier (`appliance.sim.kv.cache_offload`):
requests offer their prompt chunks as they compute them (several requests in flight) and
the tier's recency changes when a request ends. The same random runs through both evict the
same chunks at every offer and leave the same chunks held. No server: about 10 s."""

from __future__ import annotations

import random

import pytest

from appliance.sim.kv.host_tier import HostTier
from tests.vllm_server import run_in_vllm

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import json, sys
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

def run(size, ops):
    manager = CPUOffloadingManager(size, cache_policy="lru")
    contexts, evicted = {}, []
    for op in ops:
        if op[0] == "offer":
            _, req, keys = op
            if req not in contexts:
                contexts[req] = ReqContext(req_id=req)
                manager.on_new_request(contexts[req])
            keys = [OffloadKey(bytes.fromhex(k)) for k in keys]
            out = manager.prepare_store(keys, contexts[req])
            if out is None:
                evicted.append(None)
                continue
            manager.complete_store(out.keys_to_store, contexts[req])
            evicted.append(sorted(k.hex() for k in out.evicted_keys))
        else:
            manager.on_request_finished(contexts.pop(op[1]))
    return {"evicted": evicted, "held": sorted(k.hex() for k in manager._policy.chunks)}

size, runs = json.loads(sys.stdin.read())
print(json.dumps([run(size, ops) for ops in runs]))
"""


def _run(seed: int) -> list[list[object]]:
    """Sessions whose prompts grow turn by turn, up to three requests in flight, each offering
    its prompt's chunks in one to three pieces and ending later."""
    rng = random.Random(seed)
    prompts = {s: [f"{s:02x}{i:06x}" for i in range(rng.randrange(2, 8))] for s in range(6)}
    ops: list[list[object]] = []
    flying: dict[str, list[list[str]]] = {}
    for turn in range(60):
        if len(flying) < 3 and (not flying or rng.random() < 0.6):
            session = rng.randrange(6)
            prompt = prompts[session]
            prompt += [f"{session:02x}{len(prompt) + i:06x}" for i in range(rng.randrange(1, 5))]
            cuts = sorted(rng.sample(range(1, len(prompt)), min(2, len(prompt) - 1)))
            pieces = [prompt[a:b] for a, b in zip([0, *cuts], [*cuts, len(prompt)], strict=True)]
            flying[f"r{turn}"] = pieces
        req = rng.choice(sorted(flying))
        if flying[req]:
            ops.append(["offer", req, flying[req].pop(0)])
        else:
            ops.append(["finish", req])
            del flying[req]
    return ops


def _sim(size: int, ops: list[list[object]]) -> dict[str, object]:
    """The sim's tier through the same run: a store per offer, a touch of everything the
    request offered when it ends."""
    tier = HostTier(size)
    offered: dict[str, list[bytes]] = {}
    evicted: list[list[str] | None] = []
    for op in ops:
        req = str(op[1])
        if op[0] == "offer":
            keys = [bytes.fromhex(str(k)) for k in op[2]]  # type: ignore[union-attr]
            offered.setdefault(req, []).extend(keys)
            before = set(tier.hashes())
            stored = tier.store(keys)
            gone = before - set(tier.hashes())
            evicted.append(None if stored is None else sorted(k.hex() for k in gone))
        else:
            tier.touch(list(dict.fromkeys(offered.pop(req))))
    return {"evicted": evicted, "held": sorted(k.hex() for k in tier.hashes())}


def test_the_sim_host_tier_evicts_what_vllms_offloading_manager_evicts(vllm_python: str) -> None:
    size = 12
    runs = [_run(seed) for seed in range(8)]
    theirs = run_in_vllm(vllm_python, SCRIPT, [size, runs], timeout=300)
    for seed, (ops, vllm) in enumerate(zip(runs, theirs, strict=True)):
        assert sum(1 for e in vllm["evicted"] if e) > 3, seed  # the run makes the tier evict
        assert _sim(size, ops) == vllm, seed
