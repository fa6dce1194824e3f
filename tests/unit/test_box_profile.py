"""`appliance profile`'s plan and document, without vLLM (tests/cli/test_profile_cli.py runs
the whole command on the CPU build)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from appliance.domain.errors import ConfigError
from appliance.engines.profiling.box_profile import POINTS, measure_plan, weights_params
from appliance.engines.supervision.launch import Device
from appliance.perf.box_profile import profile_document
from appliance.perf.kv_bytes import KvBytes
from appliance.perf.latency import CopyDirection, LatencyModel

TINY_KV = KvBytes(1024, "2 layers x 2 KV heads x head dim 64 x 2 (K, V) x 2 B bfloat16")
MEASURED = {
    "device": "cpu",
    "gpu": "CPU (test, vLLM's CPU build)",
    "copy_kind": "host buffer -> host buffer",
    "memory_bytes": 8 * 2**30,
    "model_dtype": "torch.bfloat16",
    "full_prefill_s": {"128": 0.004, "512": 0.006, "2048": 0.024},
    "incremental_prefill_s": {"512": 0.0036, "1536": 0.0046},
    "incremental_prefill_fresh_tokens": 128,
    "decode_step_s": {"256": 0.0016, "1024": 0.0017},
    "batched_decode_step_s": {"B1_ctx256": 0.0016, "B4_ctx256": 0.0018, "B8_ctx256": 0.002},
    "copy_gbps": {
        "b32768": {"bytes": 32768, "h2d": 20.0, "d2h": 20.0},
        "b67108864": {"bytes": 67108864, "h2d": 28.0, "d2h": 14.0},
    },
}


@pytest.mark.parametrize("device", [Device.CPU, Device.CUDA])
def test_every_point_fits_the_models_limit(device: Device) -> None:
    plan = measure_plan(device, 4096, 32, TINY_KV, "auto")
    limit = plan["max_model_len"]
    assert limit <= 4096
    assert all(n < limit for n in plan["prefill_tokens"])
    assert all(c + plan["fresh_tokens"] < limit for c in plan["reused_tokens"])
    assert all(c + plan["decode_tokens"] < limit for c in plan["decode_contexts"])
    assert plan["copy_bytes"][0] == 32 * 1024  # one block of KV
    if device == Device.CPU:  # the pool holds the longest prompt and a whole decode batch
        tokens = plan["kv_cache_memory_bytes"] // 1024
        assert tokens >= max(plan["batch_sizes"]) * plan["decode_contexts"][0]
    else:
        assert plan["kv_cache_memory_bytes"] is None  # vLLM sizes it on a GPU
        assert plan["prefill_tokens"] == [512, 2048]  # 8k and 32k do not fit a 4k model


def test_a_long_model_gets_every_point() -> None:
    plan = measure_plan(Device.CUDA, 131072, 16, KvBytes(131072, "8B"), "fp8")
    assert plan["prefill_tokens"] == list(POINTS[Device.CUDA].prefill_tokens)
    assert plan["kv_cache_dtype"] == "fp8"


def test_parameters_are_read_from_safetensors_headers(tmp_path: Path) -> None:
    for name, shapes in {"a.safetensors": [[4, 8], [8]], "b.safetensors": [[2, 3, 5]]}.items():
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i, shape in enumerate(shapes):
            size = 2 * math.prod(shape)
            header[f"t{i}"] = {
                "dtype": "BF16",
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
        blob = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)
    assert weights_params(tmp_path) == 32 + 8 + 30
    assert weights_params(tmp_path / "nothing") is None


def test_the_document_reads_as_a_profile_at_the_models_bytes() -> None:
    doc, profile = profile_document(MEASURED, TINY_KV, params=1_705_216, name="tiny")
    assert doc["model"] == {
        "kv_bytes_per_token": 1024,
        "kv_bytes": TINY_KV.how,
        "params": 1_705_216,
        "dtype": "torch.bfloat16",
    }
    assert doc["copy_kind"] == "host buffer -> host buffer"
    assert profile.kv_bytes_per_token == 1024
    assert profile.memory_bytes == 8 * 2**30
    assert profile.gpu == "CPU (test, vLLM's CPU build)"
    assert profile.wake is not None and profile.wake.weights_bytes == 2 * 1_705_216
    model = LatencyModel.from_profile(profile)
    assert model.prefill_s(2048) == pytest.approx(0.024, rel=0.2)
    # 64 MiB of the tiny model's KV (65,536 tokens) crosses at the measured 28 GB/s
    assert model.kv_copy_s(65536, CopyDirection.H2D) == pytest.approx(67108864 / 28e9)


def test_a_run_without_decode_points_is_no_profile() -> None:
    broken = {k: v for k, v in MEASURED.items() if "decode" not in k}
    with pytest.raises(ConfigError, match="decode_step_s has no points"):
        profile_document(broken, TINY_KV, params=None, name="broken")
