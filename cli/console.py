"""The running appliance's state as the console shows it, in the terminal: `status`,
`top`, `sessions`, `tasks`, `events`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cli.options import DEFAULT_URL, DataDirOpt, JsonOpt, UrlOpt

KeyOpt = Annotated[
    str | None,
    typer.Option("--key", help="Operator key (default: the first admin key in the data dir)."),
]


def _view(
    view: str, url: str, key: str | None, data_dir: Path | None, as_json: bool, **kw: bool
) -> None:
    from tui import client, tables  # the console's renderers; loaded only for these commands

    api_key, source = client.console_key(key, data_dir) or (None, None)
    try:
        state = client.fetch_state(url, api_key, key_source=source)
    except client.ConsoleError as exc:
        print(f"appliance: {exc.message}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(tables.json_view(state, view))  # type: ignore[arg-type]
        return
    render = {
        "status": tables.render_status,
        "sessions": tables.render_sessions,
        "tasks": lambda s: tables.render_tasks(s, tree=kw.get("tree", False)),
        "events": tables.render_events,
    }[view]
    typer.echo(render(state))


def status(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Workers, sessions and tasks in a few lines; exit 1 if the appliance is not reachable."""
    _view("status", url, key, data_dir, as_json)


def top(url: UrlOpt = DEFAULT_URL, key: KeyOpt = None, data_dir: DataDirOpt = None) -> None:
    """The operator console."""
    from tui.app import run_console

    run_console(url, key, data_dir)


def sessions(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Agent sessions of the running appliance."""
    _view("sessions", url, key, data_dir, as_json)


def tasks(
    url: UrlOpt = DEFAULT_URL,
    tree: Annotated[bool, typer.Option("--tree", help="Show fan-out trees.")] = False,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Tasks of the running appliance."""
    _view("tasks", url, key, data_dir, as_json, tree=tree)


def events(
    url: UrlOpt = DEFAULT_URL,
    key: KeyOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Recent events of the running appliance (restarts, releases, cancellations), newest
    first."""
    _view("events", url, key, data_dir, as_json)
