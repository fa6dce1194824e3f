"""One JSON reading of a GPU host, for the device checks: what `appliance doctor` looks at
(Python, the vLLM build, NVML, the GPUs the workers would get) plus one NVML probe snapshot.

Usage: python scripts/gpu_probe.py [--python PATH] [--workers N] [--gpus-per-worker G]
Prints JSON on stdout; exits 0 even when something is missing (the JSON says what).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.domain.errors import ApplianceError
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.preflight import check_gpus, probe_vllm
from appliance.gpu.nvml import NvmlProbe

_TORCH = (
    "import json, torch; print(json.dumps({'cuda': torch.version.cuda, "
    "'available': torch.cuda.is_available(), 'count': torch.cuda.device_count(), "
    "'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"
)


def _torch_view(python: str) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [python, "-c", _TORCH], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode:
            return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return {"error": str(exc)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter that has vLLM")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--gpus-per-worker", type=int, default=1)
    args = parser.parse_args()

    started = time.monotonic()
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        install = probe_vllm(args.python)
        out["vllm"] = dataclasses.asdict(install)
    except ApplianceError as exc:
        install = None
        out["vllm"] = {"error": exc.message}
    out["torch"] = _torch_view(args.python)

    probe = NvmlProbe()
    snapshot = probe.snapshot()
    probe.close()
    out["nvml"] = dataclasses.asdict(snapshot)

    spec = LaunchSpec(
        model="-",
        served_model_name="-",
        python=args.python,
        device=install.device if install else Device.CUDA,
        workers=args.workers,
        gpus_per_worker=args.gpus_per_worker,
    )
    try:
        check_gpus(spec.needed_gpus(), snapshot)
        out["gpu_check"] = {"ok": True, "needed": list(spec.needed_gpus())}
    except ApplianceError as exc:
        out["gpu_check"] = {"ok": False, "error": exc.message}
    out["took_s"] = round(time.monotonic() - started, 3)
    json.dump(out, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
