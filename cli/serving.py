"""The appliance in the foreground and its signals: `up`, `stop`, `reload`."""

from __future__ import annotations

from typing import Annotated

import typer

from appliance.start import bootstrap
from cli.options import ConfigOpt, DataDirOpt


def up(
    config: ConfigOpt = None,
    engine: Annotated[str | None, typer.Option(help="auto | vllm | sim | external")] = None,
    workers: Annotated[int | None, typer.Option(help="Number of engine workers.")] = None,
    model: Annotated[str | None, typer.Option(help="Model path or name.")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            help="GPU indices the workers share out, e.g. 0,1,2,3 (engine.gpus).",
            callback=lambda text: _gpu_list(text) and text,
        ),
    ] = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Start the whole appliance in the foreground."""
    flags = {
        "data_dir": data_dir,
        "server": {"host": host, "port": port},
        "engine": {"kind": engine, "workers": workers, "model": model, "gpus": _gpu_list(gpus)},
    }
    settings = bootstrap.load_settings(config, **flags)
    bootstrap.run_appliance(settings, lambda: bootstrap.load_settings(config, **flags))


def _gpu_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise typer.BadParameter(f"{text!r}: give GPU indices separated by commas, e.g. 0,1,2,3")
    return [int(p) for p in parts]


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the appliance.", min=0)
]


def stop(config: ConfigOpt = None, data_dir: DataDirOpt = None, timeout: TimeoutOpt = 120) -> None:
    """Stop the appliance running on the data dir: it drains (requests in flight finish),
    stops its workers and exits; waits until it has."""
    typer.echo(bootstrap.stop_appliance(config, data_dir=data_dir, timeout_s=timeout))


def reload(config: ConfigOpt = None, data_dir: DataDirOpt = None, timeout: TimeoutOpt = 30) -> None:
    """Make the appliance running on the data dir read its API keys and its config again:
    applies log_level, costs and admission at once, names what needs a restart."""
    typer.echo(bootstrap.reload_appliance(config, data_dir=data_dir, timeout_s=timeout))
