"""`costs`: cost per successful task from a ledger file, as JSON or a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from appliance.start import bootstrap
from cli.options import ConfigOpt, DataDirOpt, JsonOpt


def costs(
    db: Annotated[
        Path | None,
        typer.Option("--db", help="Ledger file to read offline (default: the data dir's)."),
    ] = None,
    by: Annotated[
        str, typer.Option(help="Group by: comma-separated of task_class, tenant.")
    ] = "task_class,tenant",
    since: Annotated[float | None, typer.Option(help="Unix time: roots created from.")] = None,
    until: Annotated[float | None, typer.Option(help="Unix time: roots created before.")] = None,
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cost per successful task, read from a ledger file (read-only): per group the direct
    cost, its share of the box's overhead (gpu_seconds mode) and their total."""
    if db is None:
        db = bootstrap.load_settings(config, data_dir=data_dir).ledger_path
    groups = tuple(g.strip() for g in by.split(",") if g.strip())
    rows = bootstrap.read_cost_report(db, by=groups, since=since, until=until)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(_cost_table(rows))


_COST_HIDDEN = ("overhead_idle", "overhead_energy", "overhead_box", "direct_cost_per_success")


def _cost_table(rows: list[dict[str, object]]) -> str:
    """The report's table, and the overhead's parts below it (`--json` has them by group)."""
    shown = [{k: v for k, v in r.items() if k not in _COST_HIDDEN} for r in rows]
    parts = [sum(_number(r.get(k)) for r in rows) for k in _COST_HIDDEN[:3]]
    if not rows or not sum(parts):
        return _table(shown)
    currency = rows[0].get("currency") or ""
    return _table(shown) + (
        f"\noverhead {_fmt(sum(parts))} {currency}: idle GPU time {_fmt(parts[0])}, energy "
        f"{_fmt(parts[1])}, the box {_fmt(parts[2])}; shared by GPU-seconds"
    )


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "no tasks in the ledger for this selection"
    cols = list(rows[0])
    cells = [[_fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
