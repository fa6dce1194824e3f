"""vLLM's sleep mode on the CUDA build, through the supervisor's `power` (what the worker
reaper calls): at level 1 and at level 2 a worker frees most of its GPU memory while
asleep, wakes, and then answers a greedy request exactly as before it slept (level 2 with
its weights reloaded from the model). Run by scripts/gpu_check.sh on a GPU host; skipped,
and said so, elsewhere (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from appliance.domain.worker import WorkerEvent, WorkerEventKind, WorkerState
from appliance.engines.clients.workers import KvIndexFeed
from appliance.engines.supervision.launch import Device, LaunchSpec
from appliance.engines.supervision.preflight import probe_vllm
from appliance.engines.supervision.supervisor import Supervisor, SupervisorTimings
from appliance.gpu.nvml import NvmlProbe
from tests.ports import free_port_block

pytestmark = pytest.mark.gpu


def gpu0_used_bytes() -> int:
    probe = NvmlProbe()
    used = probe.snapshot().gpus[0].mem_used_bytes
    probe.close()
    return used


async def sleep_and_wake(sup: Supervisor, level: int) -> tuple[int, int, float, str, str]:
    """(memory used awake, asleep, the wake's seconds, the answer before, after)."""
    w = sup.workers[0]
    body = {"model": "tiny", "prompt": "The sky is", "max_tokens": 8, "temperature": 0.0}
    before = (await w.client.completions(body))["choices"][0]["text"]
    awake = gpu0_used_bytes()
    await sup.power.sleep(w.id, level)
    assert w.state == WorkerState.ASLEEP and await w.client.is_sleeping()
    asleep = gpu0_used_bytes()
    woken = await sup.power.wake(w.id)
    assert w.state == WorkerState.HEALTHY and not await w.client.is_sleeping()
    after = (await w.client.completions(body))["choices"][0]["text"]
    return awake, asleep, woken.duration_s, before, after


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_worker_frees_its_gpu_and_wakes_to_the_same_answers(
    level: int, tiny_model_dir: Path, vllm_python: str, tmp_path: Path
) -> None:
    install = probe_vllm(vllm_python)
    assert install.device == Device.CUDA, "the GPU checks need vLLM's CUDA build"
    spec = LaunchSpec(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        python=vllm_python,
        device=Device.CUDA,
        base_port=free_port_block(1),
        kv_events_base_port=free_port_block(1),
        block_size=32,
        gpu_memory_utilization=0.3,
        max_model_len=2048,
        enforce_eager=True,
        sleep_mode=True,
        extra_env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    events: list[WorkerEvent] = []
    feed = KvIndexFeed()

    async def go() -> tuple[int, int, float, str, str]:
        sup = Supervisor(
            spec,
            log_dir=tmp_path / "logs",
            on_event=events.append,
            on_kv_batch=feed.on_batch,
            on_kv_reset=feed.on_reset,
            timings=SupervisorTimings(startup_timeout_s=600, poll_s=0.2),
        )
        async with sup:
            assert sup.workers[0].can_sleep
            return await sleep_and_wake(sup, level)

    started = time.monotonic()
    awake, asleep, wake_s, before, after = asyncio.run(go())
    print(
        f"level {level}: {awake / 2**30:.1f} GiB awake, {asleep / 2**30:.1f} GiB asleep, "
        f"woken in {wake_s:.2f} s ({time.monotonic() - started:.0f} s in all)"
    )
    assert asleep < awake / 2  # the KV cache (30 % of the GPU) and the weights are gone
    assert after == before  # greedy: the same weights give the same tokens
    kinds = [e.kind for e in events]
    assert kinds.index(WorkerEventKind.SLEPT) < kinds.index(WorkerEventKind.WOKEN)
    assert any(why == f"put to sleep (level {level})" for _, why in feed.resets)
