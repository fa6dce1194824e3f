"""The operator's commands on the box: `doctor`, `config show`, `keys ...`, `service ...`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from appliance.start import bootstrap
from cli.options import ConfigOpt, DataDirOpt


def doctor(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Check GPUs, the engine install, ports, data dir and config: one line each."""
    checks = bootstrap.run_doctor(config, data_dir=data_dir)
    width = max(len(c.name) for c in checks)
    for c in checks:
        typer.echo(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def config_show(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """Print the effective configuration (defaults, file, environment)."""
    typer.echo(bootstrap.show_config(config, data_dir=data_dir), nl=False)


def keys_add(
    name: Annotated[str, typer.Argument(help="Tenant or operator name.")],
    admin: Annotated[bool, typer.Option("--admin", help="An operator key for /admin/*.")] = False,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Add a key and print only the key on stdout."""
    typer.echo(bootstrap.add_api_key(name, admin=admin, config=config, data_dir=data_dir))


def keys_revoke(
    name: Annotated[str, typer.Argument(help="The key's name (see `appliance keys list`).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Remove a key; a running appliance refuses it within a second, no restart."""
    bootstrap.revoke_api_key(name, config=config, data_dir=data_dir)
    typer.echo(f"revoked {name}")


def keys_show(
    name: Annotated[str, typer.Argument(help="The key's name (see `appliance keys list`).")],
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Print the key called NAME, only the key (e.g. `export KEY=$(appliance keys show
    default)`); an unknown name exits 2."""
    typer.echo(bootstrap.show_api_key(name, config=config, data_dir=data_dir))


def keys_list(config: ConfigOpt = None, data_dir: DataDirOpt = None) -> None:
    """List key names and roles (never the keys)."""
    for k in bootstrap.list_api_keys(config=config, data_dir=data_dir):
        typer.echo(f"{k.name}\t{'admin' if k.admin else 'tenant'}\t{k.created_at}")


RootOpt = Annotated[
    Path,
    typer.Option("--root", help="Lay the files out under this folder as under / (packaging)."),
]


def service_install(root: RootOpt = Path("/")) -> None:
    """Write the systemd unit, its user, a config file and the data dir; print what to run
    next."""
    for line in bootstrap.install_service(root):
        typer.echo(line)


def service_uninstall(root: RootOpt = Path("/")) -> None:
    """Remove the unit and its user's entry (the config and the data dir stay)."""
    for line in bootstrap.uninstall_service(root):
        typer.echo(line)


def service_status(root: RootOpt = Path("/")) -> None:
    """Which of the service's files are installed and what systemctl says; exit 1 without
    the unit."""
    lines, installed = bootstrap.service_report(root)
    for line in lines:
        typer.echo(line)
    if not installed:
        raise typer.Exit(1)
