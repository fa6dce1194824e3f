"""Errors of the engine layer: each one a single line that names the cause and the fix."""

from __future__ import annotations

from appliance.domain.errors import (
    ApplianceError,
    EngineError,
    EngineRequestError,
    EngineTimedOut,
    EngineUnavailable,
)


class VllmNotInstalled(EngineError):
    code = "vllm_not_installed"
    http_status = 503
    exit_code = 2


class VllmUnsupported(EngineError):
    """The interpreter's vLLM is another release than the one the appliance is built on."""

    code = "vllm_unsupported"
    http_status = 503
    exit_code = 2


class ModelNotFound(EngineError):
    code = "model_not_found"
    http_status = 400
    exit_code = 2


class PortInUse(EngineError):
    code = "port_in_use"
    http_status = 500
    exit_code = 2


class GpuNotFound(EngineError):
    code = "gpu_not_found"
    http_status = 500
    exit_code = 2


class WorkerStartFailed(EngineError):
    """A worker exited or did not answer /health during its start; the message carries the
    last line of its log that looks like the cause, and the log's path."""

    code = "worker_start_failed"
    http_status = 503
    exit_code = 1


class WorkerPowerRefused(EngineError):
    """A sleep, stop or wake the worker cannot take now: its state, its build (no sleep
    mode), or the supervisor shutting down. Nothing was changed."""

    code = "worker_power_refused"
    http_status = 409
    exit_code = 1


__all__ = [
    "ApplianceError",
    "EngineError",
    "EngineRequestError",
    "EngineTimedOut",
    "EngineUnavailable",
    "GpuNotFound",
    "ModelNotFound",
    "PortInUse",
    "VllmNotInstalled",
    "VllmUnsupported",
    "WorkerPowerRefused",
    "WorkerStartFailed",
]
