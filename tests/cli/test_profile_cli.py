"""`appliance profile` on vLLM's CPU build with the tiny test model writes a profile of this
box (prefill, decode and host-buffer copies measured through vLLM), and `appliance replay`
plans with it: the replay's KV pool is counted in the tiny model's bytes per token."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.perf.profile import load_profile
from tests.paths import MOONCAKE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
APPLIANCE = Path(sys.executable).parent / "appliance"


def run(*args: str, data_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    base |= {"APPLIANCE_DATA_DIR": str(data_dir), **env}
    return subprocess.run(
        [str(APPLIANCE), *args], capture_output=True, text=True, env=base, timeout=480
    )


def test_profile_then_a_replay_with_it(
    tiny_model_dir: Path, vllm_python: str, tmp_path: Path
) -> None:
    out = tmp_path / "box.json"
    python = {"APPLIANCE_ENGINE__PYTHON": vllm_python}
    r = run(
        "profile", "--model", str(tiny_model_dir), "--out", str(out), data_dir=tmp_path, **python
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"wrote {out}: CPU (") and "KV 1,024 B per token" in r.stdout
    assert "profile: prefill of 2048 tokens:" in r.stderr  # progress, line by line
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["vllm"].startswith("0.32")
    assert doc["copy_kind"].startswith("host buffer -> host buffer")
    assert doc["model"]["kv_bytes_per_token"] == 1024
    assert doc["model"]["params"] > 1_000_000
    profile = load_profile(out)
    assert {p.fresh_tokens for p in profile.prefill if p.reused_tokens == 0} == {128, 512, 2048}
    assert {p.reused_tokens for p in profile.prefill} == {0, 512, 1536}
    assert {p.batch_size for p in profile.decode} == {1, 4, 8}
    assert len(profile.copies) == 3 and all(c.h2d_s > 0 for c in profile.copies)
    full = sorted((p.fresh_tokens, p.seconds) for p in profile.prefill if p.reused_tokens == 0)
    assert full[-1][1] > full[0][1]  # 2,048 tokens take longer than 128

    report = tmp_path / "replay.json"
    replay = ["replay", str(MOONCAKE), "--limit", "60", "--workers", "2", "--hbm-gib", "1"]
    replay += ["--policy", "round-robin", "--gpu-profile", str(out), "--report", str(report)]
    r = run(*replay, data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"profile {out}" in r.stdout
    blocks = re.search(r"2 workers x 1.0 GiB KV \((\d+) blocks of (\d+)\)", r.stdout)
    assert blocks is not None, r.stdout  # 1 GiB of 1 KiB tokens, not of the H200's 128 KiB
    assert int(blocks[1]) * int(blocks[2]) * 1024 == pytest.approx(2**30, rel=0.01)
    assert json.loads(report.read_text())["policies"]["round-robin"]["ttft_p50_s"] > 0
