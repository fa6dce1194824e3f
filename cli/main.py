"""The `appliance` command line: thin commands that each call one function. This module
builds the command tree (the commands live in the modules beside it, one per concern) and
is the entry point.

Known failures (ApplianceError) print one line and exit with their code; a traceback is
shown only with APPLIANCE_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer

from appliance import __version__
from appliance.domain.errors import ApplianceError
from cli import (
    bench_command,
    console,
    costs,
    engine_commands,
    operator_commands,
    replay_command,
    serving,
)

app = typer.Typer(
    name="appliance",
    help="A single-box serving appliance for LLM agent workloads.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion [bash|zsh|fish]
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: the rich panels showed every flag as `<bool>`
)
config_app = typer.Typer(
    help="Inspect the configuration.", no_args_is_help=True, rich_markup_mode=None
)
keys_app = typer.Typer(
    help="Manage API keys (tenants and operators).", no_args_is_help=True, rich_markup_mode=None
)
service_app = typer.Typer(
    help="The appliance as a systemd service.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(config_app, name="config")
app.add_typer(keys_app, name="keys")
app.add_typer(service_app, name="service")

# The commands, in the order `appliance --help` lists them.
app.command()(serving.up)
app.command()(serving.stop)
app.command()(serving.reload)
app.command()(console.status)
app.command()(console.top)
app.command()(console.sessions)
app.command()(console.tasks)
app.command()(console.events)
app.command()(costs.costs)
app.command("replay")(replay_command.replay_command)
app.command()(bench_command.bench)
app.command()(engine_commands.sim)
app.command()(engine_commands.profile)
app.command()(operator_commands.doctor)
config_app.command("show")(operator_commands.config_show)
keys_app.command("add")(operator_commands.keys_add)
keys_app.command("revoke")(operator_commands.keys_revoke)
keys_app.command("show")(operator_commands.keys_show)
keys_app.command("list")(operator_commands.keys_list)
service_app.command("install")(operator_commands.service_install)
service_app.command("uninstall")(operator_commands.service_uninstall)
service_app.command("status")(operator_commands.service_status)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"appliance {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """A single-box serving appliance for LLM agent workloads."""


def main() -> None:
    try:
        app()  # standalone: click prints usage errors itself and exits 2
    except ApplianceError as exc:
        if os.environ.get("APPLIANCE_DEBUG") == "1":
            traceback.print_exc()
        print(f"appliance: {exc.message}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
