"""What only a real NVIDIA GPU can show: NVML's readings of the device agree with
nvidia-smi, and `appliance up` starts a worker on vLLM's CUDA build that NVML sees holding
the GPU's memory. Run by scripts/gpu_check.sh on a GPU host; skipped (and said so) elsewhere."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.gpu.nvml import NvmlProbe
from tests.running import add_key, appliance_process

pytestmark = pytest.mark.gpu


def nvidia_smi() -> list[dict[str, str]]:
    fields = ["index", "uuid", "name", "memory.total"]
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [
        dict(zip(fields, (v.strip() for v in row), strict=True))
        for row in csv.reader(out.strip().splitlines())
    ]


def test_nvml_reads_every_device_nvidia_smi_lists() -> None:
    probe = NvmlProbe()
    snap = probe.snapshot()
    probe.close()
    listed = nvidia_smi()
    assert snap.error is None and snap.driver
    assert [g.uuid for g in snap.gpus] == [d["uuid"] for d in listed]
    for g, d in zip(snap.gpus, listed, strict=True):
        assert g.name == d["name"]
        assert g.mem_total_bytes // 2**20 == pytest.approx(int(d["memory.total"]), abs=1)
        assert 0 < g.mem_used_bytes <= g.mem_total_bytes
        assert g.mem_used_bytes + g.mem_free_bytes <= g.mem_total_bytes
        assert g.util is not None and 0.0 <= g.util <= 1.0
        assert g.power_w is not None and g.power_w > 0


def test_appliance_up_starts_a_cuda_worker_nvml_sees(
    tiny_model_dir: Path, vllm_python: str, tmp_path: Path
) -> None:
    key = add_key(tmp_path, "gpu")
    env = {} if vllm_python == sys.executable else {"APPLIANCE_ENGINE__PYTHON": vllm_python}
    with appliance_process(
        tmp_path, engine="vllm", workers=None, env=env, args=["--model", str(tiny_model_dir)]
    ) as up:
        answer = httpx.post(
            f"{up.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "X-Session-ID": "gpu"},
            json={
                "model": tiny_model_dir.name,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello"}],
            },
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        family = {up.proc.pid} | {p.pid for p in psutil.Process(up.proc.pid).children(True)}
        probe = NvmlProbe()
        gpu0 = probe.snapshot().gpus[0]
        probe.close()
        held = [p for p in gpu0.processes if p.pid in family]
        # gVisor and containers may hide other namespaces' pids: then the memory says it.
        assert held or gpu0.mem_used_bytes > gpu0.mem_total_bytes // 2, gpu0
