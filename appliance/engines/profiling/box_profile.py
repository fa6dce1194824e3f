"""`appliance profile --model DIR`: this box measured with the served model, written as a GPU
profile that `engine.gpu_profile` and `appliance replay --gpu-profile` read.

Model of the world: a profile is a handful of timings on one device for one model
(appliance/perf/profile.py). The bundled one was measured on an H200 with an 8B-shaped
model; a box with another GPU, or vLLM's CPU build, or another model, plans with its own.
Here the interpreter that has vLLM (engine.python) runs box_measure.py, which times prefill,
decode and copies through vLLM's offline engine on that interpreter's device (CUDA, or the
CPU build, where a "copy" is a host buffer copy); this side plans the points from the
model's length limit and KV size, adds the model's shape (KV bytes per token from its
config at `engine.kv_cache_dtype`, parameters from its safetensors headers), checks the
result reads as a profile and writes it. The points are few (3-4 of each kind), so the
tiny test model takes about a minute on two CPU cores; an 8B model on a GPU a few.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engines.errors import ModelNotFound, WorkerStartFailed
from appliance.engines.supervision.launch import Device
from appliance.engines.supervision.preflight import (
    check_vllm_version,
    kv_cache_dtype_args,
    probe_vllm,
)
from appliance.perf.box_profile import profile_document
from appliance.perf.kv_bytes import KvBytes, model_kv_bytes
from appliance.perf.profile import GpuProfile

MEASURE_SCRIPT = Path(__file__).with_name("box_measure.py")


@dataclass(frozen=True, slots=True)
class MeasurePoints:
    """What is measured on one kind of device (each point that fits the model's limit)."""

    prefill_tokens: tuple[int, ...]
    reused_tokens: tuple[int, ...]
    """Cached contexts a prefill of `fresh_tokens` runs on."""
    fresh_tokens: int
    decode_contexts: tuple[int, ...]
    """Batch-1 decode at each; the batch sizes at the first."""
    batch_sizes: tuple[int, ...]
    decode_tokens: int
    """Output tokens that time a decode step (less one)."""
    copy_mib: tuple[int, ...]
    """Copies beside one block's."""


POINTS = {
    Device.CPU: MeasurePoints(
        (128, 512, 2048), (512, 1536), 128, (256, 1024), (1, 4, 8), 8, (4, 64)
    ),
    Device.CUDA: MeasurePoints(
        (512, 2048, 8192, 32768), (8192, 32768), 512, (4096, 16384), (1, 8, 32), 16, (64, 1024)
    ),
}
_DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)  # an empty one crashes the CPU build


def measure_plan(
    device: Device, model_len: int, block_size: int, kv: KvBytes, kv_cache_dtype: str
) -> dict[str, Any]:
    """What box_measure.py measures: the device's points that fit `model_len` (the model's
    limit), a KV pool that holds them (CPU build; vLLM sizes it on a GPU), one block's
    copy and the larger copies."""
    p = POINTS[device]
    fresh, steps = p.fresh_tokens, p.decode_tokens
    fits = [n for n in p.prefill_tokens if n < model_len] or [model_len // 2]
    reused = [c for c in p.reused_tokens if c + fresh < model_len]
    contexts = [c for c in p.decode_contexts if c + steps < model_len] or [fits[0]]
    longest = max([*fits, *(c + fresh for c in reused), *(c + steps for c in contexts)])
    pool_tokens = 2 * (longest + max(p.batch_sizes) * (contexts[0] + steps))
    copies = [block_size * kv.bytes_per_token, *(mib * 2**20 for mib in p.copy_mib)]
    return {
        "device": device.value,
        "block_size": block_size,
        "max_model_len": min(model_len, longest + block_size),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_memory_bytes": max(pool_tokens * kv.bytes_per_token, 64 * 2**20)
        if device == Device.CPU
        else None,
        "prefill_tokens": fits,
        "reused_tokens": reused,
        "fresh_tokens": fresh,
        "decode_contexts": contexts,
        "batch_sizes": list(p.batch_sizes),
        "decode_tokens": steps,
        "copy_bytes": copies,
        "reps": 3,
    }


def weights_params(model_dir: Path) -> int | None:
    """Parameters of a model's safetensors files, read from their headers (None: none)."""
    total, found = 0, False
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
                found = True
    return total if found else None


def model_len(config_path: Path) -> int:
    config = json.loads(config_path.read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else 4096


def profile_box(
    model: str,
    *,
    out: Path,
    python: str,
    kv_cache_dtype: str = "auto",
    block_size: int = 32,
    say: Callable[[str], None] = print,
) -> GpuProfile:
    """Measures the box with `model` (a model directory) through `python`'s vLLM, writes the
    profile to `out` and returns it."""
    model_dir = Path(model).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ModelNotFound(f"{model} is not a model directory with a config.json")
    install = probe_vllm(python)
    check_vllm_version(install)
    kv_cache_dtype_args(kv_cache_dtype, install.device)  # refuses what the build cannot store
    kv = model_kv_bytes(model_dir / "config.json", kv_cache_dtype)
    limit = model_len(model_dir / "config.json")
    plan = measure_plan(install.device, limit, block_size, kv, kv_cache_dtype)
    plan["model"] = str(model_dir)
    where = f"{install.device.value} with vLLM {install.version}"
    say(f"profile: measuring {model_dir.name} on {where}; KV {kv.bytes_per_token:,} B per token")
    measured = _measure(python, plan, say)
    doc, profile = profile_document(measured, kv, params=weights_params(model_dir), name=out.stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return profile


def _measure(python: str, plan: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    if plan["device"] == Device.CPU.value:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tail: deque[str] = deque(maxlen=200)
    with tempfile.TemporaryDirectory(prefix="appliance-profile-") as tmp:
        result = Path(tmp) / "measured.json"
        argv = [python, str(MEASURE_SCRIPT), json.dumps(plan), str(result)]
        pipe, both = subprocess.PIPE, subprocess.STDOUT
        with subprocess.Popen(argv, stdout=pipe, stderr=both, text=True, env=env, cwd=tmp) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip())
                if line.startswith("profile: "):
                    say(line.rstrip())
        if proc.returncode != 0 or not result.is_file():
            raise WorkerStartFailed(
                f"the measuring run ({python} {MEASURE_SCRIPT.name}) exited with "
                f"{proc.returncode}: {_cause(tail)}"
            )
        measured: dict[str, Any] = json.loads(result.read_text())
    return measured


def _cause(lines: deque[str]) -> str:
    """The last line of the run's output that looks like why it failed."""
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()
    return lines[-1].strip() if lines else "no output"
