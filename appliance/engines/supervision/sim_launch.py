"""How the simulated workers are started: the engine settings as a LaunchSpec whose workers
run `python -m appliance.sim.entrypoints.vllm_entry` in vLLM's place (pure), so the supervisor
starts, watches, restarts, sleeps, stops and wakes them as it does vLLM's.

Model of the world: a simulated worker takes vLLM's own command line (launch.py writes it:
ports, block size, hash, KV events, the retention connector's --kv-transfer-config, the KV
pool as --kv-cache-memory-bytes) and the simulator's knobs behind it: the time scale, the GPU
profile, and the wake times of that profile (`wake_s`: sleep levels 1 and 2, stopped). The
host tier (`engine.kv_host_bytes`) goes as vLLM's --kv-offloading-size (GiB). It always runs
with sleep mode (dev mode on: `WorkerHandle.can_sleep`), as vLLM's CUDA build with
`engine.sleep_mode` does, and carries the GPU ids `engine.gpus` shares out, without a CUDA
environment.

A start that wakes a STOPPED worker models the profile's stopped wake time: the simulated
load (`--sim-startup-s`) is that time less `SIM_PROCESS_START_S`, what the simulated
process itself takes here to answer /health, both stretched by the time scale. The
appliance's own start and the restart after a crash load nothing modelled (they take the
real process start, 1-2 s), so `appliance up --engine sim` stays quick: the bundled
profile's stopped figure is ~43 s.
"""

from __future__ import annotations

import sys

from appliance.config.settings import EngineSettings
from appliance.engines.retention.plugin import RetentionLaunch
from appliance.engines.supervision.launch import (
    Device,
    LaunchSpec,
    default_served_name,
    engine_launch_fields,
)
from appliance.perf.profile import GpuProfile, bundled_profile, load_profile

SIM_ENTRYPOINT = ("-m", "appliance.sim.entrypoints.vllm_entry")
SIM_MAX_MODEL_LEN = 32768
"""A simulated worker's context limit when `engine.max_model_len` is unset."""
SIM_PROCESS_START_S = 1.5
"""Estimate: a simulated worker's own process start until /health (Python imports, the
server's bind) on this kind of host; taken off the profile's stopped wake time."""


def sim_served_name(engine: EngineSettings) -> str:
    """What clients call the simulated model: the configured name, the model's, or `sim`."""
    if engine.served_model_name:
        return engine.served_model_name
    return default_served_name(engine.model) if engine.model else "sim"


def sim_args(engine: EngineSettings, profile: GpuProfile) -> tuple[str, ...]:
    """The simulator's own flags (and vLLM's host tier) behind vLLM's command line."""
    wake = profile.wake
    assert wake is not None  # parse_profile always fills the wake times in
    args = ["--sim-time-scale", str(engine.sim_time_scale)]
    args += ["--sim-wake-s", f"{wake.asleep_1.seconds:.6g},{wake.asleep_2.seconds:.6g}"]
    if engine.gpu_profile:
        args += ["--sim-gpu-profile", str(engine.gpu_profile)]
    if engine.kv_host_bytes:
        args += ["--kv-offloading-size", repr(engine.kv_host_bytes / 2**30)]
    return tuple(args)


def stopped_wake_args(profile: GpuProfile) -> tuple[str, ...]:
    """What a start that wakes a stopped worker adds: the profile's stopped wake time less
    the real process start (`SIM_PROCESS_START_S`), as the simulated load."""
    return ("--sim-startup-s", f"{_stopped_load_s(profile):.6g}")


def _stopped_load_s(profile: GpuProfile) -> float:
    """The modelled load of a stopped worker's wake: the profile's figure less the process
    start that happens for real."""
    assert profile.wake is not None
    return max(0.0, profile.wake.stopped.seconds - SIM_PROCESS_START_S)


def sim_wake_seconds(engine: EngineSettings) -> tuple[float, float, float]:
    """Real seconds a simulated worker takes to wake from asleep-1, asleep-2 and stopped: its
    profile's times stretched by the time scale, the process start of a stopped one not."""
    profile, scale = sim_profile(engine), engine.sim_time_scale
    assert profile.wake is not None
    w = profile.wake
    stopped = min(w.stopped.seconds, SIM_PROCESS_START_S) + _stopped_load_s(profile) * scale
    return (w.asleep_1.seconds * scale, w.asleep_2.seconds * scale, stopped)


def sim_profile(engine: EngineSettings) -> GpuProfile:
    """The GPU profile the simulated workers model: `engine.gpu_profile`, else the bundled."""
    return load_profile(engine.gpu_profile) if engine.gpu_profile else bundled_profile()


def sim_spec(engine: EngineSettings) -> LaunchSpec:
    """The simulated workers' launch spec: one `appliance.sim.entrypoints.vllm_entry` process each,
    on consecutive ports, with the settings `appliance up --engine sim` runs them under."""
    profile = sim_profile(engine)
    retention = None
    if engine.kv_retention:
        retention = RetentionLaunch(engine.port_base("kv_retention_base_port"))
    return LaunchSpec(
        model=engine.model or "sim",
        served_model_name=sim_served_name(engine),
        python=sys.executable,
        device=Device.SIM,
        **engine_launch_fields(engine, engine.max_model_len or SIM_MAX_MODEL_LEN),
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        extra_args=sim_args(engine, profile),
        gpu_ids=tuple(engine.gpus) if engine.gpus is not None else None,
        entrypoint=SIM_ENTRYPOINT,
        retention=retention,
        # the sim's calls are hermes-style whatever the parser; launch.py writes
        # --enable-auto-tool-choice only with a parser
        tool_call_parser=engine.tool_call_parser
        or ("hermes" if engine.enable_auto_tool_choice else None),
        enable_auto_tool_choice=engine.enable_auto_tool_choice,
        sleep_mode=True,
        wake_args=stopped_wake_args(profile),
    )
