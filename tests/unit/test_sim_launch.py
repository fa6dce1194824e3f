"""`appliance up --engine sim`'s workers as the supervisor launches them: the engine settings
through sim_launch.py and launch.py to vLLM's command line, read back by the simulated
worker's entry point as the worker those settings describe."""

from __future__ import annotations

import os

import pytest

from appliance.config.settings import Settings
from appliance.engines.supervision.launch import Device, plan_workers
from appliance.engines.supervision.sim_launch import (
    SIM_MAX_MODEL_LEN,
    SIM_PROCESS_START_S,
    sim_spec,
    sim_wake_seconds,
)
from appliance.perf.agent_batching import AGENT_BATCH_TOKENS, AGENT_PREFILL_CAP_TOKENS
from appliance.perf.profile import bundled_profile
from appliance.sim.entrypoints.vllm_entry import retention_tuning, worker_config

PROFILE = bundled_profile()
PER_BLOCK = 32 * PROFILE.kv_bytes_per_token


def _engine(**fields: object) -> Settings:
    base = {
        "kind": "sim",
        "workers": 2,
        "base_port": 9100,
        "kv_events_base_port": 9200,
        "kv_retention_base_port": 9300,
        "block_size": 32,
    }
    return Settings(engine={**base, **fields})


def test_each_simulated_worker_reads_the_settings_from_vllms_command_line() -> None:
    settings = _engine(
        kv_cache_memory_bytes=100 * PER_BLOCK,
        kv_host_bytes=800 * PER_BLOCK,
        gpus=[3, 4],
        sim_time_scale=0.5,
        enable_auto_tool_choice=True,
    )
    spec = sim_spec(settings.engine)
    assert (spec.device, spec.sleep_mode) == (Device.SIM, True)
    w1 = plan_workers(spec, {"CUDA_VISIBLE_DEVICES": "7"})[1]
    assert (w1.gpus, w1.url) == ((4,), "http://127.0.0.1:9101")
    assert "CUDA_VISIBLE_DEVICES" not in w1.env
    config = worker_config(w1.argv[1:], dict(w1.env))
    assert (config.port, config.block_size, config.served_model_name) == (9101, 32, "sim")
    assert (config.max_model_len, config.scheduling_policy) == (SIM_MAX_MODEL_LEN, "priority")
    assert (config.num_gpu_blocks, config.num_host_blocks) == (100, 800)
    assert config.kv_events_endpoint == "tcp://127.0.0.1:9201"
    assert (config.time_scale, config.enable_auto_tool_choice) == (0.5, True)
    assert config.dev_mode, "a simulated worker can always be put to sleep"
    wake = PROFILE.wake
    assert wake is not None
    assert config.wake_s == (round(wake.asleep_1.seconds, 6), round(wake.asleep_2.seconds, 6))
    tuning = retention_tuning(w1.argv[1:])
    assert tuning is not None and tuning.control_endpoint == "tcp://127.0.0.1:9301"
    # The scheduler budget the appliance gives its workers (perf/agent_batching.py).
    budget = (config.max_num_batched_tokens, config.long_prefill_token_threshold)
    assert budget == (AGENT_BATCH_TOKENS, AGENT_PREFILL_CAP_TOKENS)
    assert config.prompt_a_step, "the appliance's scheduler, as a real worker's"


def test_the_prefill_cap_stays_within_the_window_and_none_leaves_vllms_defaults() -> None:
    small = sim_spec(_engine(max_model_len=2048).engine)
    config = worker_config(plan_workers(small, {})[0].argv[1:], {})
    assert (config.max_model_len, config.long_prefill_token_threshold) == (2048, 2048)
    plain = sim_spec(_engine(max_num_batched_tokens=None, long_prefill_token_threshold=0).engine)
    argv = plan_workers(plain, {})[0].argv
    assert "--max-num-batched-tokens" not in argv
    assert "--long-prefill-token-threshold" not in argv
    config = worker_config(argv[1:], {})
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (8192, 0)
    assert not config.prompt_a_step


def test_a_simulated_worker_refuses_a_scheduler_it_does_not_model() -> None:
    argv = [*plan_workers(sim_spec(_engine().engine), {})[0].argv[1:], "--scheduler-cls", "x.Y"]
    with pytest.raises(SystemExit, match="--scheduler-cls"):
        worker_config(argv, {})


def test_only_a_start_that_wakes_a_stopped_worker_models_its_load() -> None:
    w0 = plan_workers(sim_spec(_engine().engine), os.environ)[0]
    assert worker_config(w0.argv[1:], dict(w0.env)).startup_s == 0.0
    woken = w0.exec_argv(1, waking=True)[5:]  # behind the trampoline and the interpreter
    wake = PROFILE.wake
    assert wake is not None
    load_s = worker_config(woken, dict(w0.env)).startup_s
    assert abs(load_s - (wake.stopped.seconds - SIM_PROCESS_START_S)) < 1e-3


def test_a_simulated_wake_takes_the_profiles_time_stretched_by_the_time_scale() -> None:
    wake = PROFILE.wake
    assert wake is not None
    one, two, stopped = sim_wake_seconds(_engine(sim_time_scale=0.1).engine)
    assert (one, two) == (wake.asleep_1.seconds * 0.1, wake.asleep_2.seconds * 0.1)
    # The process start is real time; only the modelled load is stretched.
    load_s = wake.stopped.seconds - SIM_PROCESS_START_S
    assert stopped == SIM_PROCESS_START_S + load_s * 0.1
    assert sim_wake_seconds(_engine().engine) == (
        wake.asleep_1.seconds,
        wake.asleep_2.seconds,
        wake.stopped.seconds,
    )


def test_without_retention_or_host_tier_the_worker_has_neither() -> None:
    w0 = plan_workers(sim_spec(_engine(kv_retention=False).engine), os.environ)[0]
    assert retention_tuning(w0.argv[1:]) is None
    config = worker_config(w0.argv[1:], dict(w0.env))
    assert (config.num_host_blocks, config.num_gpu_blocks, w0.gpus) == (0, None, ())
