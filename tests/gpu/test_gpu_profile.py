"""`appliance profile` on vLLM's CUDA build: this GPU measured with the tiny model, its copies
between pinned host memory and the device. Run by scripts/gpu_check.sh; skipped elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.perf.profile import load_profile
from tests.cli.test_profile_cli import run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def test_profile_measures_the_gpu(tiny_model_dir: Path, vllm_python: str, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    python = {"APPLIANCE_ENGINE__PYTHON": vllm_python}
    r = run(
        "profile", "--model", str(tiny_model_dir), "--out", str(out), data_dir=tmp_path, **python
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cuda" and doc["copy_kind"].startswith("pinned host memory")
    profile = load_profile(out)
    assert profile.memory_bytes is not None and profile.memory_bytes > 8 * 2**30
    assert profile.kv_bytes_per_token == 1024
    big = max(profile.copies, key=lambda c: c.nbytes)  # 1 GiB over PCIe: gigabytes a second
    assert big.nbytes / big.h2d_s > 1e9 and big.nbytes / big.d2h_s > 1e9
