"""Our block hashes equal vLLM 0.32's own, computed by vLLM's code in a subprocess.

The subprocess runs the real-vLLM interpreter (the `vllm_python` fixture of
tests/conftest.py: $APPLIANCE_VLLM_PYTHON, else this one if it can import vllm; finding
neither fails the test). It builds real `vllm.v1.request.Request` objects with vLLM's block
hasher (`get_request_block_hasher` after `init_none_hash`, PYTHONHASHSEED set or unset per
case), appends output tokens the way the engine does, and reports `request.block_hashes`,
the event form (`maybe_convert_block_hash`) and the event extra keys.
"""

from __future__ import annotations

import os
import random
import subprocess
from typing import Any

import pytest

from appliance.domain.block_hash import (
    BlockHasher,
    HashAlgo,
    LoraKey,
    RequestKeys,
    event_block_hash,
    event_extra_keys,
)
from tests.vllm_server import run_in_vllm

pytestmark = pytest.mark.vllm

_PROBE = r"""
import json, os, sys
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

out = []
for i, case in enumerate(json.load(sys.stdin)):
    if case["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    hash_fn = get_hash_fn_by_name(case["algo"])
    kcu.init_none_hash(hash_fn)
    lora = case["lora"]
    req = Request(
        request_id=f"r{i}",
        prompt_token_ids=case["prompt"],
        sampling_params=SamplingParams(max_tokens=len(case["outputs"]) + 1),
        pooling_params=None,
        cache_salt=case["salt"],
        lora_request=LoRARequest(lora[0], 7, lora[1]) if lora else None,
        block_hasher=kcu.get_request_block_hasher(case["block_size"], hash_fn),
    )
    for tok in case["outputs"]:
        req.append_output_token_ids(tok)
    extra = [
        kcu.generate_block_hash_extra_keys(
            req, b * case["block_size"], (b + 1) * case["block_size"], 0
        )[0]
        for b in range(len(req.block_hashes))
    ]
    out.append({
        "none_hash": kcu.NONE_HASH.hex(),
        "hashes": [h.hex() for h in req.block_hashes],
        "event_hashes": [kcu.maybe_convert_block_hash(h) for h in req.block_hashes],
        "event_extra_keys": kcu.to_event_extra_keys(extra),
    })
json.dump(out, sys.stdout)
"""


def _run_vllm(python: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    result: list[dict[str, Any]] = run_in_vllm(python, _PROBE, cases, env=env)
    return result


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20260501)
    cases: list[dict[str, Any]] = []
    for algo in HashAlgo:
        for seed in (None, "0", "12345", ""):
            for salt in (None, "tenant-a"):
                for block_size in (16, 32):
                    n_prompt = rng.randrange(0, 8 * block_size)
                    cases.append(
                        {
                            "algo": algo.value,
                            "seed": seed,
                            "salt": salt,
                            "lora": None,
                            "block_size": block_size,
                            "prompt": [rng.randrange(0, 200_000) for _ in range(n_prompt)],
                            "outputs": [
                                rng.randrange(0, 200_000) for _ in range(rng.randrange(40))
                            ],
                        }
                    )
    # LoRA keys (every block) with and without a salt; token ids of every CBOR width.
    for algo in HashAlgo:
        for salt in (None, "s"):
            cases.append(
                {
                    "algo": algo.value,
                    "seed": None,
                    "salt": salt,
                    "lora": ["adapter-x", "/models/adapter-x"],
                    "block_size": 16,
                    "prompt": [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40] * 7,
                    "outputs": [1, 2, 3],
                }
            )
    return cases


def test_block_hashes_match_vllm(vllm_python: str) -> None:
    cases = _cases()
    expected = _run_vllm(vllm_python, cases)
    assert len(expected) == len(cases)
    for case, want in zip(cases, expected, strict=True):
        hasher = BlockHasher.for_engine(case["algo"], case["block_size"], case["seed"])
        lora = LoraKey(*case["lora"]) if case["lora"] else None
        keys = RequestKeys(cache_salt=case["salt"], lora=lora)
        label = {k: case[k] for k in ("algo", "seed", "salt", "block_size")}

        assert hasher.none_hash.hex() == want["none_hash"], label
        # All at once, from the full sequence ...
        tokens = case["prompt"] + case["outputs"]
        whole = hasher.hash_blocks(tokens, keys=keys)
        assert [h.hex() for h in whole] == want["hashes"], label
        # ... and incrementally: the prompt, then one generated token at a time.
        chain = hasher.chain(case["prompt"], keys=keys)
        for tok in case["outputs"]:
            chain = hasher.extend(chain, [tok])
        assert [h.hex() for h in chain.hashes] == want["hashes"], label
        assert [event_block_hash(h) for h in whole] == want["event_hashes"], label
        ours_extra = [event_extra_keys(keys.for_block(b)) for b in range(len(whole))]
        theirs = want["event_extra_keys"] or []
        assert [list(k) if k else None for k in ours_extra] == theirs, label


def test_finds_real_vllm(vllm_python: str) -> None:
    """The interpreter we compare against is really vLLM 0.32."""
    r = subprocess.run(
        [vllm_python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith("0.32"), r.stdout
