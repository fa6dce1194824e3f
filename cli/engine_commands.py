"""The engines on their own: `sim` runs simulated vLLM workers alone, `profile` measures
this box with a model through vLLM."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from appliance.start import bootstrap
from cli.options import ConfigOpt


class SimScheduling(StrEnum):
    """vLLM's --scheduling-policy, for simulated workers run alone."""

    FCFS = "fcfs"
    PRIORITY = "priority"


def sim(
    port: Annotated[int, typer.Option(help="HTTP port of worker 0; worker i uses port+i.")] = 8100,
    workers: Annotated[int, typer.Option(help="Number of simulated workers.")] = 1,
    gpu_profile: Annotated[
        Path | None, typer.Option(help="GPU profile JSON (default: the bundled H200).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model directory whose tokenizer to use.")
    ] = None,
    served_model_name: Annotated[str, typer.Option(help="Model name clients use.")] = "sim",
    block_size: Annotated[int, typer.Option(help="KV block size in tokens.")] = 32,
    max_model_len: Annotated[int, typer.Option(help="Longest prompt + output.")] = 32768,
    kv_events_endpoint: Annotated[
        str | None, typer.Option(help="ZMQ endpoint of worker 0's KV events; worker i: port+i.")
    ] = None,
    hash_algo: Annotated[str, typer.Option(help="sha256 or sha256_cbor.")] = "sha256_cbor",
    python_hash_seed: Annotated[str, typer.Option(help="The engines' PYTHONHASHSEED.")] = "0",
    time_scale: Annotated[float, typer.Option(help="2.0 runs twice as slow as the GPU.")] = 1.0,
    scheduling_policy: Annotated[
        SimScheduling, typer.Option(help="fcfs, or priority (the lowest value first).")
    ] = SimScheduling.FCFS,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="KV blocks, the null block included (default: the GPU's).")
    ] = None,
    retention_endpoint: Annotated[
        str | None,
        typer.Option(help="ZMQ endpoint of worker 0's KV retention control; worker i: port+i."),
    ] = None,
    num_host_blocks: Annotated[
        int, typer.Option(help="Host-memory KV blocks per worker (0: no host tier).", min=0)
    ] = 0,
    enable_auto_tool_choice: Annotated[
        bool, typer.Option(help="Accept every tool_choice and answer with tool calls.")
    ] = False,
) -> None:
    """Run simulated vLLM workers alone (vLLM's HTTP, metrics, KV-event and KV retention
    protocols)."""
    bootstrap.run_sim(
        workers=workers,
        port=port,
        gpu_profile=gpu_profile,
        model=model,
        served_model_name=served_model_name,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_events_endpoint=kv_events_endpoint,
        hash_algo=hash_algo,
        python_hash_seed=python_hash_seed,
        time_scale=time_scale,
        scheduling_policy=scheduling_policy.value,
        num_gpu_blocks=num_gpu_blocks_override,
        retention_endpoint=retention_endpoint,
        num_host_blocks=num_host_blocks,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )


def profile(
    model: Annotated[str, typer.Option(help="Model directory (a Hugging Face one) to measure.")],
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the profile JSON (default: ./profile-MODEL.json)."),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Measure this box with MODEL through vLLM on its own device (a GPU, or the CPU build):
    prefill at a few lengths, decode at a few batch sizes, host-device copies; write a GPU
    profile for engine.gpu_profile and `appliance replay --gpu-profile`."""
    typer.echo(bootstrap.write_box_profile(model, out=out, config=config))
