"""How a vLLM worker is started: settings in, command line and environment out (pure).

Model of the world: worker i is one `python -m vllm.entrypoints.openai.api_server` (the
`vllm` CLI fails on the CPU build) listening on base_port + i, publishing KV events to
tcp://127.0.0.1:(kv_events_base_port + i), a socket the appliance binds (vLLM connects to a
plain tcp endpoint), and loading the appliance's retention connector, whose control channel
connects to tcp://127.0.0.1:(retention base port + i), bound by the appliance too
(appliance/engines/retention/plugin.py: what it adds to the command and the PYTHONPATH;
with `engine.kv_host_bytes`, composed with vLLM's host tier: appliance/engines/offload/plan.py).
With a long prefill threshold, the same plugin directory gives it the appliance's scheduler
(`--scheduler-cls`, appliance/engines/scheduling/: one prompt a step, the first in the
queue's order, while two or more are in flight).
Every worker gets the same block size, hash algorithm and PYTHONHASHSEED as the router, so
the router can recompute the hashes it sees in events. GPU build: worker i sees its own
GPUs through CUDA_VISIBLE_DEVICES (PCI bus order, so the indices are NVML's) and shards the
model over them with tensor parallelism. CPU build: each worker gets its own slice of the
cores (affinity set before exec, OMP_NUM_THREADS = slice size, one engine process:
VLLM_ENABLE_V1_MULTIPROCESSING=0); two unpinned workers on the same cores run ten times
slower. Its KV cache is sized by --kv-cache-memory-bytes: the configured size, or else
`cpu_build.cpu_kv_cache_bytes` of the memory free when the workers start (vLLM's own default there,
0.9 of the memory node, refuses to start on any host that is doing something else).

`exec_argv` wraps the command in a tiny Python trampoline that, before exec'ing vLLM, pins
the cores and asks the kernel to SIGTERM the worker if the appliance dies (PR_SET_PDEATHSIG),
so that no worker outlives the appliance even when it is killed with SIGKILL.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePath
from typing import Any

from appliance.config.settings import EngineSettings
from appliance.domain.errors import ConfigError
from appliance.domain.records import WorkerId
from appliance.domain.worker import WORKER_KEEPALIVE_S
from appliance.engines.offload.plan import HostTierPlan, transfer_config
from appliance.engines.retention.plugin import RetentionLaunch
from appliance.engines.supervision.cpu_build import cpu_kv_cache_bytes, split_cpus
from appliance.engines.supervision.step_budget import cpu_step_budget, scheduler_argv
from appliance.perf.agent_batching import AGENT_SCHEDULING_POLICY

ENTRYPOINT = ("-m", "vllm.entrypoints.openai.api_server")
CPU_BLOCK_MULTIPLE = 32
# The environment a worker never inherits: these would override what the plan sets.
_DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")

_TRAMPOLINE = """\
import json, os, sys
c = json.loads(sys.argv[1])
if c.get("pdeathsig") and sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, c["pdeathsig"], 0, 0, 0)
    if os.getppid() != c["ppid"]:
        os._exit(70)
if c.get("cpus"):
    os.sched_setaffinity(0, c["cpus"])
os.execv(sys.argv[2], sys.argv[2:])
"""


class Device(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"
    SIM = "sim"
    """The simulated engine started as vLLM is (`appliance.sim.entrypoints.vllm_entry`): it carries
    the GPU ids it was given, but no CUDA environment, tensor parallelism or core slices."""


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything that decides the workers' command lines; plain values, no settings object."""

    model: str
    served_model_name: str
    python: str
    """The interpreter that has vLLM."""
    device: Device
    workers: int = 1
    gpus_per_worker: int = 1
    host: str = "127.0.0.1"
    base_port: int = 8100
    kv_events_base_port: int = 5557
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    python_hash_seed: str = "0"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    """Per worker; when set it wins over gpu_memory_utilization."""
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    """--max-num-batched-tokens; None: vLLM's default for the hardware."""
    long_prefill_token_threshold: int = 0
    """--long-prefill-token-threshold; 0: vLLM's default, no cap."""
    enforce_eager: bool = False
    """Skip torch.compile: faster starts; the default on the CPU build."""
    extra_args: tuple[str, ...] = ()
    """Appended last, so they override the flags above."""
    gpu_ids: tuple[int, ...] | None = None
    """The GPUs the workers share out, in order; None: 0 .. workers*gpus_per_worker-1."""
    cpu_ids: tuple[int, ...] = ()
    """CPU build: the cores the workers share out; () leaves scheduling to the OS."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    entrypoint: tuple[str, ...] = ENTRYPOINT
    """What follows the interpreter: the module to run (tests put a stand-in here)."""
    retention: RetentionLaunch | None = None
    """The retention connector every worker loads, with its control port; None: none."""
    host_tier: HostTierPlan | None = None
    """Each worker's host tier (vLLM's offloading connector); None: none."""
    tool_call_parser: str | None = None
    """--tool-call-parser; None: none (tool_choice "none" only)."""
    enable_auto_tool_choice: bool = False
    """--enable-auto-tool-choice (needs tool_call_parser)."""
    structured_outputs: Mapping[str, object] = field(default_factory=dict)
    """--structured-outputs-config (backend, disable_any_whitespace); empty: vLLM's defaults."""
    sleep_mode: bool = False
    """--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (its /sleep and /wake_up): the workers
    can be put to sleep. vLLM accepts it on CUDA (and ROCm, XPU) only."""
    wake_args: tuple[str, ...] = ()
    """Appended to the command of a start that wakes a STOPPED worker (the simulated
    worker's modelled load time there); () for vLLM."""

    def port(self, index: int) -> int:
        return self.base_port + index

    def kv_events_endpoint(self, index: int) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_base_port + index}"

    def needed_gpus(self) -> tuple[int, ...]:
        n = self.workers * self.gpus_per_worker
        if self.device == Device.SIM:  # the configured ids only: a simulated GPU needs none
            return tuple(self.gpu_ids[:n]) if self.gpu_ids is not None else ()
        if self.device != Device.CUDA:
            return ()
        return tuple(self.gpu_ids[:n]) if self.gpu_ids is not None else tuple(range(n))


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """One worker's start: the vLLM command, its complete environment, its addresses."""

    worker: WorkerId
    index: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    port: int
    url: str
    kv_events_endpoint: str
    gpus: tuple[int, ...]
    cpus: tuple[int, ...]
    wake_args: tuple[str, ...] = ()
    """Appended to `argv` when the start wakes a stopped worker (`LaunchSpec.wake_args`)."""

    def exec_argv(
        self, parent_pid: int, *, pdeathsig: int = signal.SIGTERM, waking: bool = False
    ) -> tuple[str, ...]:
        """`argv` (and, `waking`, the wake's arguments) behind the trampoline that pins cores
        and ties the worker to `parent_pid`."""
        config = {"ppid": parent_pid, "pdeathsig": int(pdeathsig), "cpus": list(self.cpus)}
        argv = (*self.argv, *self.wake_args) if waking else self.argv
        return (argv[0], "-c", _TRAMPOLINE, json.dumps(config), *argv)


def default_served_name(model: str) -> str:
    """The last path component of a model directory or hub name: `/m/Llama-3-8B/` -> Llama-3-8B."""
    return PurePath(model.rstrip("/")).name or model


def _connect_host(host: str) -> str:
    """Where to reach a server listening on `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def worker_id(index: int) -> WorkerId:
    return WorkerId(f"w{index}")


def validate(spec: LaunchSpec) -> None:
    """Settings vLLM would only reject after a long start; one line naming the fix."""
    if spec.device == Device.CPU and spec.block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(
            f"engine.block_size={spec.block_size}: the vLLM CPU build needs a multiple of "
            f"{CPU_BLOCK_MULTIPLE}; set engine.block_size: {CPU_BLOCK_MULTIPLE}"
        )
    if spec.gpu_ids is not None and spec.device == Device.CUDA:
        need = spec.workers * spec.gpus_per_worker
        if len(spec.gpu_ids) < need:
            raise ConfigError(
                f"engine.workers={spec.workers} x engine.gpus_per_worker={spec.gpus_per_worker}"
                f" needs {need} GPUs but only {len(spec.gpu_ids)} are given; lower one of them"
            )


def _argv(spec: LaunchSpec, index: int) -> tuple[str, ...]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": spec.kv_events_endpoint(index),
        "topic": f"kv@{worker_id(index)}@{spec.served_model_name}",
    }
    args = [
        spec.python,
        *spec.entrypoint,
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.port(index)),
        "--enable-prefix-caching",
        "--block-size",
        str(spec.block_size),
        "--prefix-caching-hash-algo",
        spec.hash_algo,
        "--enable-prompt-tokens-details",
        "--scheduling-policy",
        AGENT_SCHEDULING_POLICY,  # each turn: its clipped X-Priority, then its prefill rank
        "--kv-events-config",
        json.dumps(kv_events, separators=(",", ":")),
    ]
    if spec.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    else:
        args += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:.4g}"]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    args += scheduler_argv(
        spec.max_num_batched_tokens,
        spec.long_prefill_token_threshold,
        plugins=spec.retention is not None,
    )
    if spec.device == Device.CUDA and spec.gpus_per_worker > 1:
        args += ["--tensor-parallel-size", str(spec.gpus_per_worker)]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.tool_call_parser:
        args += ["--tool-call-parser", spec.tool_call_parser]
        if spec.enable_auto_tool_choice:
            args.append("--enable-auto-tool-choice")
    if spec.structured_outputs:
        config = json.dumps(dict(spec.structured_outputs), separators=(",", ":"))
        args += ["--structured-outputs-config", config]
    if spec.sleep_mode:
        args.append("--enable-sleep-mode")
    retention = spec.retention.kv_transfer_config(index) if spec.retention else None
    if config := transfer_config(retention, spec.host_tier):
        args += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return (*args, *spec.extra_args)


def _env(
    spec: LaunchSpec, gpus: tuple[int, ...], cpus: tuple[int, ...], base_env: Mapping[str, str]
) -> dict[str, str]:
    env = {k: v for k, v in base_env.items() if k not in _DROPPED_ENV}
    env.update(
        PYTHONHASHSEED=spec.python_hash_seed,
        VLLM_NO_USAGE_STATS="1",
        VLLM_ENABLE_RESPONSES_API_STORE="1",  # `previous_response_id` chaining (vLLM's default off)
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(WORKER_KEEPALIVE_S),
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if spec.device == Device.CUDA:
        env.update(
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            CUDA_VISIBLE_DEVICES=",".join(str(g) for g in gpus),
        )
    elif spec.device == Device.CPU:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cpus:
            env["OMP_NUM_THREADS"] = str(len(cpus))
    if spec.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.retention is not None and (path := spec.retention.pythonpath(env.get("PYTHONPATH"))):
        env["PYTHONPATH"] = path
    env.update(spec.extra_env)
    return env


def plan_workers(spec: LaunchSpec, base_env: Mapping[str, str]) -> tuple[WorkerLaunch, ...]:
    """Every worker's launch, in index order. Raises ConfigError for settings vLLM rejects."""
    validate(spec)
    gpus = spec.needed_gpus()
    g = spec.gpus_per_worker
    cpu_slices = split_cpus(spec.cpu_ids if spec.device == Device.CPU else (), spec.workers)
    plans = []
    for i in range(spec.workers):
        worker_gpus = gpus[i * g : (i + 1) * g]  # () on the CPU build
        plans.append(
            WorkerLaunch(
                worker=worker_id(i),
                index=i,
                argv=_argv(spec, i),
                env=_env(spec, worker_gpus, cpu_slices[i], base_env),
                port=spec.port(i),
                url=f"http://{_connect_host(spec.host)}:{spec.port(i)}",
                kv_events_endpoint=spec.kv_events_endpoint(i),
                gpus=worker_gpus,
                cpus=cpu_slices[i],
                wake_args=spec.wake_args,
            )
        )
    return tuple(plans)


def spec_from_settings(
    engine: EngineSettings,
    *,
    python: str,
    device: Device,
    cpu_ids: Sequence[int] = (),
    base_env: Mapping[str, str] | None = None,
    kv_cache_memory_bytes: int | None = None,
    free_memory_bytes: int | None = None,
) -> LaunchSpec:
    """The launch spec the settings describe. The GPUs are `engine.gpus`, else those of the
    appliance's own CUDA_VISIBLE_DEVICES when it is a list of indices, else 0, 1, ... On the
    CPU build without a configured KV size, the workers share `free_memory_bytes` (host
    memory free)."""
    if not engine.model:
        raise ConfigError("engine.model is not set; pass --model PATH_OR_NAME")
    if engine.sleep_mode and device != Device.CUDA:
        raise ConfigError(
            "engine.sleep_mode: vLLM's CPU build has no sleep mode; set it to "
            "false (idle workers can still be stopped)"
        )
    visible = (base_env or {}).get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    gpu_ids = tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None
    if engine.gpus is not None:
        gpu_ids = tuple(engine.gpus)
    if device == Device.CPU and kv_cache_memory_bytes is None and free_memory_bytes is not None:
        kv_cache_memory_bytes = cpu_kv_cache_bytes(free_memory_bytes, engine.workers)
    fields = engine_launch_fields(engine, engine.max_model_len)
    return LaunchSpec(
        model=engine.model,
        served_model_name=engine.served_model_name or default_served_name(engine.model),
        python=python,
        device=device,
        **(cpu_step_budget(fields) if device == Device.CPU else fields),
        gpu_memory_utilization=engine.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        enforce_eager=device == Device.CPU,
        extra_args=tuple(engine.extra_args),
        gpu_ids=gpu_ids,
        cpu_ids=tuple(cpu_ids),
        retention=RetentionLaunch(engine.port_base("kv_retention_base_port"))
        if engine.kv_retention
        else None,
        host_tier=HostTierPlan(engine.kv_host_bytes, native_copies=device == Device.CUDA)
        if engine.kv_host_bytes and device in (Device.CUDA, Device.CPU)
        else None,
        tool_call_parser=engine.tool_call_parser,
        enable_auto_tool_choice=engine.enable_auto_tool_choice,
        structured_outputs=_structured_outputs(engine),
        sleep_mode=engine.sleep_mode,
    )


def engine_launch_fields(engine: EngineSettings, window: int | None) -> dict[str, Any]:
    """The LaunchSpec fields every kind of worker takes from the engine settings: workers,
    ports, block hashing, the window (`window`) and the step budget, its long prefill cap
    cut to the window (vLLM refuses a larger one)."""
    cap = engine.long_prefill_token_threshold
    return {
        "workers": engine.workers,
        "gpus_per_worker": engine.gpus_per_worker,
        "base_port": engine.port_base("base_port"),
        "kv_events_base_port": engine.port_base("kv_events_base_port"),
        "block_size": engine.block_size,
        "hash_algo": engine.hash_algo,
        "python_hash_seed": engine.python_hash_seed,
        "max_model_len": window,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "long_prefill_token_threshold": cap if window is None else min(cap, window),
    }


def _structured_outputs(engine: EngineSettings) -> dict[str, object]:
    config: dict[str, object] = {}
    if engine.structured_outputs_backend != "auto":
        config["backend"] = engine.structured_outputs_backend
    if engine.compact_json:
        config["disable_any_whitespace"] = True
    return config
