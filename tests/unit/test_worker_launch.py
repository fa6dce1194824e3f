"""Settings -> each worker's vLLM command line and environment (a pure function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from appliance.config.settings import EngineSettings
from appliance.domain.errors import ConfigError
from appliance.engines.retention.plugin import RetentionLaunch
from appliance.engines.scheduling import SCHEDULER_CLS
from appliance.engines.supervision.cpu_build import cpu_kv_cache_bytes, split_cpus
from appliance.engines.supervision.launch import (
    Device,
    LaunchSpec,
    WorkerLaunch,
    default_served_name,
    plan_workers,
    spec_from_settings,
)

BASE_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/home/op",
    "CUDA_VISIBLE_DEVICES": "7",
    "VLLM_CPU_KVCACHE_SPACE": "",
    "PYTHONHASHSEED": "random",
}
GPU = LaunchSpec(
    model="/models/llama",
    served_model_name="llama",
    python="/venv/bin/python",
    device=Device.CUDA,
    workers=2,
    gpus_per_worker=2,
    base_port=8100,
    kv_events_base_port=5557,
    block_size=16,
    python_hash_seed="42",
)
CPU = replace(
    GPU,
    device=Device.CPU,
    gpus_per_worker=1,
    block_size=32,
    enforce_eager=True,
    cpu_ids=(0, 1, 2, 3),
    kv_cache_memory_bytes=4 << 20,
    max_model_len=2048,
)


def flag(argv: tuple[str, ...], name: str) -> str | None:
    """The value after `name`, or "" for a flag without value, or None if absent."""
    if name not in argv:
        return None
    i = argv.index(name)
    nxt = argv[i + 1] if i + 1 < len(argv) else ""
    return "" if nxt.startswith("--") else nxt


# (case, spec, worker index, expected flags (None = absent), expected env (None = unset))
CASES = [
    (
        "gpu worker 0",
        GPU,
        0,
        {
            "--model": "/models/llama",
            "--served-model-name": "llama",
            "--host": "127.0.0.1",
            "--port": "8100",
            "--enable-prefix-caching": "",
            "--block-size": "16",
            "--prefix-caching-hash-algo": "sha256_cbor",
            "--enable-prompt-tokens-details": "",
            "--gpu-memory-utilization": "0.9",
            "--kv-cache-memory-bytes": None,
            "--tensor-parallel-size": "2",
            "--max-model-len": None,
            "--enforce-eager": None,
        },
        {
            "CUDA_VISIBLE_DEVICES": "0,1",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "PYTHONHASHSEED": "42",
            "VLLM_ENABLE_V1_MULTIPROCESSING": None,
            "OMP_NUM_THREADS": None,
            "VLLM_CPU_KVCACHE_SPACE": None,
            "PATH": "/usr/bin",
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "300",  # a turn after a tool wait reuses its connection
        },
    ),
    (
        "gpu worker 1 gets the next GPUs and ports",
        GPU,
        1,
        {"--port": "8101", "--tensor-parallel-size": "2"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ),
    (
        "one GPU per worker: no tensor parallelism",
        replace(GPU, gpus_per_worker=1),
        1,
        {"--tensor-parallel-size": None},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ),
    (
        "the appliance's visible GPUs are shared out",
        replace(GPU, gpu_ids=(4, 5, 6, 7)),
        1,
        {},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ),
    (
        "kv cache bytes win over utilisation, max len and extra args pass through",
        replace(GPU, kv_cache_memory_bytes=1 << 30, max_model_len=8192, extra_args=("--x", "1")),
        0,
        {
            "--kv-cache-memory-bytes": str(1 << 30),
            "--gpu-memory-utilization": None,
            "--max-model-len": "8192",
            "--x": "1",
        },
        {},
    ),
    (
        "cpu worker 1: its own cores, one engine process, no CUDA",
        CPU,
        1,
        {
            "--port": "8101",
            "--block-size": "32",
            "--kv-cache-memory-bytes": str(4 << 20),
            "--max-model-len": "2048",
            "--enforce-eager": "",
            "--tensor-parallel-size": None,
        },
        {
            "OMP_NUM_THREADS": "2",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "CUDA_VISIBLE_DEVICES": None,
            "VLLM_CPU_KVCACHE_SPACE": None,
            "PYTHONHASHSEED": "42",
        },
    ),
    (
        "cpu without known cores: OMP left alone",
        replace(CPU, cpu_ids=()),
        0,
        {},
        {"OMP_NUM_THREADS": None},
    ),
    (
        "extra env is applied last",
        replace(CPU, extra_env={"OMP_NUM_THREADS": "9", "VLLM_LOGGING_LEVEL": "DEBUG"}),
        0,
        {},
        {"OMP_NUM_THREADS": "9", "VLLM_LOGGING_LEVEL": "DEBUG"},
    ),
]


@pytest.mark.parametrize(
    ("spec", "index", "flags", "env"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_launch_table(spec: LaunchSpec, index: int, flags: dict, env: dict) -> None:
    launch = plan_workers(spec, BASE_ENV)[index]
    assert launch.argv[:3] == (spec.python, "-m", "vllm.entrypoints.openai.api_server")
    for name, value in flags.items():
        assert flag(launch.argv, name) == value, name
    for name, value in env.items():
        assert launch.env.get(name) == value, name


def test_kv_events_config_and_addresses() -> None:
    launches = plan_workers(GPU, BASE_ENV)
    assert [w.worker for w in launches] == ["w0", "w1"]
    assert [w.url for w in launches] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert [w.kv_events_endpoint for w in launches] == [
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    ]
    config = json.loads(flag(launches[1].argv, "--kv-events-config") or "")
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5558",
        "topic": "kv@w1@llama",
    }


def test_every_worker_loads_the_retention_connector_on_its_own_port() -> None:
    spec = replace(GPU, retention=RetentionLaunch(5657, python_path="/run/plugin"))
    launches = plan_workers(spec, {**BASE_ENV, "PYTHONPATH": "/site/extra"})
    configs = [json.loads(flag(w.argv, "--kv-transfer-config") or "") for w in launches]
    assert configs[1] == {
        "kv_connector": "RetentionConnector",
        "kv_connector_module_path": "appliance.engines.retention.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "control_endpoint": "tcp://127.0.0.1:5658",
            "max_held_fraction": 0.8,
            "reserve_fraction": 0.05,
            "report_interval_s": 5.0,
        },
    }
    assert configs[0]["kv_connector_extra_config"]["control_endpoint"] == "tcp://127.0.0.1:5657"
    assert {w.env["PYTHONPATH"] for w in launches} == {
        os.pathsep.join(["/run/plugin", "/site/extra"])
    }
    plain = plan_workers(GPU, BASE_ENV)[0]
    assert flag(plain.argv, "--kv-transfer-config") is None and "PYTHONPATH" not in plain.env


@pytest.mark.parametrize(("on", "loaded"), [(True, True), (False, False)])
def test_the_retention_connector_is_on_unless_turned_off(on: bool, loaded: bool) -> None:
    engine = EngineSettings(model="/m/tiny", kv_retention=on, kv_retention_base_port=6000)
    spec = spec_from_settings(engine, python="/p", device=Device.CPU)
    assert (spec.retention == RetentionLaunch(6000)) if loaded else spec.retention is None
    argv = plan_workers(spec, {})[0].argv
    assert (flag(argv, "--kv-transfer-config") is not None) == loaded


def test_wildcard_host_is_reached_on_loopback() -> None:
    assert plan_workers(replace(GPU, host="0.0.0.0"), {})[0].url == "http://127.0.0.1:8100"


def test_same_inputs_same_plan() -> None:
    assert plan_workers(CPU, BASE_ENV) == plan_workers(CPU, dict(BASE_ENV))


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [
        ((0, 1), 2, ((0,), (1,))),
        ((0, 1, 2, 3, 4), 2, ((0, 1, 2), (3, 4))),
        ((3, 1, 2, 0), 2, ((0, 1), (2, 3))),
        ((0,), 2, ((0,), (0,))),
        ((0, 1), 3, ((0,), (1,), (0,))),
        ((), 2, ((), ())),
    ],
)
def test_split_cpus(cpus, workers, expected) -> None:
    assert split_cpus(cpus, workers) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (replace(CPU, block_size=16), "engine.block_size=16: the vLLM CPU build needs"),
        (replace(GPU, gpu_ids=(0, 1, 2)), "needs 4 GPUs but only 3 are given"),
    ],
)
def test_settings_vllm_would_reject(spec: LaunchSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_workers(spec, {})


def test_spec_from_settings() -> None:
    engine = EngineSettings(
        model="/m/Qwen3-8B/", workers=2, block_size=32, extra_args=["--seed", "1"]
    )
    spec = spec_from_settings(engine, python="/p", device=Device.CPU, cpu_ids=(0, 1), base_env={})
    assert spec.served_model_name == "Qwen3-8B"
    assert spec.enforce_eager and spec.cpu_ids == (0, 1) and spec.extra_args == ("--seed", "1")
    gpu = spec_from_settings(
        engine, python="/p", device=Device.CUDA, base_env={"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    assert gpu.gpu_ids == (2, 3) and not gpu.enforce_eager
    uuids = spec_from_settings(
        engine, python="/p", device=Device.CUDA, base_env={"CUDA_VISIBLE_DEVICES": "GPU-ab"}
    )
    assert uuids.gpu_ids is None
    with pytest.raises(ConfigError, match=r"engine\.model is not set"):
        spec_from_settings(EngineSettings(), python="/p", device=Device.CPU)


def test_workers_get_the_agent_batching_budget_capped_at_the_window() -> None:
    engine = EngineSettings(model="/m/Qwen3-8B")
    argv = plan_workers(spec_from_settings(engine, python="/p", device=Device.CUDA), {})[0].argv
    assert flag(argv, "--max-num-batched-tokens") == "16384"
    assert flag(argv, "--long-prefill-token-threshold") == "4096"
    assert flag(argv, "--scheduler-cls") == SCHEDULER_CLS  # the cap only beside a prefill
    # Without the retention plugin's directory the worker could not import it: vLLM's own.
    bare = engine.model_copy(update={"kv_retention": False})
    argv = plan_workers(spec_from_settings(bare, python="/p", device=Device.CUDA), {})[0].argv
    assert flag(argv, "--long-prefill-token-threshold") == "4096"
    assert flag(argv, "--scheduler-cls") is None
    short = engine.model_copy(update={"max_model_len": 2048})
    argv = plan_workers(spec_from_settings(short, python="/p", device=Device.CUDA), {})[0].argv
    assert flag(argv, "--long-prefill-token-threshold") == "2048"
    argv = plan_workers(spec_from_settings(engine, python="/p", device=Device.CPU), {})[0].argv
    assert flag(argv, "--max-num-batched-tokens") is None  # the CPU build keeps vLLM's own
    assert flag(argv, "--long-prefill-token-threshold") is None
    assert flag(argv, "--scheduler-cls") is None
    off = engine.model_copy(
        update={"max_num_batched_tokens": None, "long_prefill_token_threshold": 0}
    )
    argv = plan_workers(spec_from_settings(off, python="/p", device=Device.CUDA), {})[0].argv
    assert flag(argv, "--max-num-batched-tokens") is None
    assert flag(argv, "--long-prefill-token-threshold") is None


def test_engine_gpus_win_over_the_environment_and_each_worker_sees_its_own() -> None:
    """`up --gpus 4,5,6,7` with two GPUs per worker: worker i gets the i-th pair through
    CUDA_VISIBLE_DEVICES, whatever the appliance's own CUDA_VISIBLE_DEVICES says; no
    workers given: one per pair."""
    engine = EngineSettings(model="/m/Qwen3-8B", gpus=[4, 5, 6, 7], gpus_per_worker=2)
    assert engine.workers == 2
    spec = spec_from_settings(
        engine, python="/p", device=Device.CUDA, base_env={"CUDA_VISIBLE_DEVICES": "0"}
    )
    plans = plan_workers(spec, BASE_ENV)
    assert [p.gpus for p in plans] == [(4, 5), (6, 7)]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5", "6,7"]
    assert all("--tensor-parallel-size" in p.argv for p in plans)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpus": [0, 1], "workers": 3}, "needs 3 GPUs but engine.gpus lists 2"),
        ({"gpus": [0, 0]}, "list each GPU index"),
        ({"gpus": []}, "needs 1 GPUs but engine.gpus lists 0"),
    ],
)
def test_engine_gpus_that_cannot_serve_the_workers_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineSettings(**fields)


GIB = 2**30


@pytest.mark.parametrize(
    ("free", "workers", "expected"),
    [
        (8 * GIB, 1, int(8 * GIB * 0.4) // 2**20 * 2**20),  # 40 % of what is free
        (8 * GIB, 2, int(8 * GIB * 0.4) // 2 // 2**20 * 2**20),  # shared by the workers
        (100 * GIB, 1, 4 * GIB),  # at most 4 GiB a worker
        (100 * GIB, 2, 4 * GIB),
        (2**20, 4, 2**20),  # never below 1 MiB
    ],
)
def test_cpu_kv_cache_bytes(free: int, workers: int, expected: int) -> None:
    assert cpu_kv_cache_bytes(free, workers) == expected


def test_the_cpu_build_sizes_its_kv_from_free_memory_unless_configured() -> None:
    """vLLM's own CPU default (0.9 of the memory node) refuses to start on a busy host."""
    engine = EngineSettings(model="/m/tiny", workers=2)
    cpu = spec_from_settings(engine, python="/p", device=Device.CPU, free_memory_bytes=8 * GIB)
    argv = plan_workers(cpu, {})[1].argv
    assert flag(argv, "--kv-cache-memory-bytes") == str(cpu_kv_cache_bytes(8 * GIB, 2))
    assert flag(argv, "--gpu-memory-utilization") is None
    configured = spec_from_settings(
        engine,
        python="/p",
        device=Device.CPU,
        kv_cache_memory_bytes=5 << 20,
        free_memory_bytes=8 * GIB,
    )
    assert configured.kv_cache_memory_bytes == 5 << 20
    gpu = spec_from_settings(engine, python="/p", device=Device.CUDA, free_memory_bytes=8 * GIB)
    assert gpu.kv_cache_memory_bytes is None
    assert flag(plan_workers(gpu, {})[0].argv, "--gpu-memory-utilization") == "0.9"


@pytest.mark.parametrize(
    ("model", "name"),
    [("/m/llama/", "llama"), ("Qwen/Qwen3-8B", "Qwen3-8B"), ("tiny", "tiny")],
)
def test_default_served_name(model: str, name: str) -> None:
    assert default_served_name(model) == name


def test_trampoline_pins_cores_and_execs() -> None:
    """The wrapper really runs: the exec'd command sees the affinity and its own argv."""
    cpu = min(os.sched_getaffinity(0))
    probe = "import os, sys; print(sorted(os.sched_getaffinity(0)), sys.argv[1:])"
    launch = WorkerLaunch(
        worker=plan_workers(CPU, {})[0].worker,
        index=0,
        argv=(sys.executable, "-c", probe, "--port", "1"),
        env={},
        port=1,
        url="",
        kv_events_endpoint="",
        gpus=(),
        cpus=(cpu,),
    )
    out = subprocess.run(
        launch.exec_argv(os.getpid()), capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.strip() == f"[{cpu}] ['--port', '1']"
