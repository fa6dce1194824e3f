"""Cost per successful task worked out by hand from a ledger file's rows, with the box's
overhead: the way docs/ledger.md states it, written again here without the product's code
(plain SQL and arithmetic), so that `appliance costs` and the console can be checked
against it."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Group:
    tasks: int = 0
    succeeded: int = 0
    cost: float = 0.0
    gpu_s: float = 0.0
    overhead: float = 0.0

    @property
    def per_success(self) -> float | None:
        return (self.cost + self.overhead) / self.succeeded if self.succeeded else None


@dataclass
class Overhead:
    idle: float = 0.0
    energy: float = 0.0
    box: float = 0.0
    idle_gpu_s: float = 0.0
    periods: list[tuple[float, float]] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.idle + self.energy + self.box


def rows(ledger: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        return db.execute(sql, params).fetchall()


def overhead(ledger: Path, through: float | None = None) -> Overhead:
    """The usage periods (ending by `through`) priced from their quantities: idle awake
    GPU-seconds at gpu_second, joules at energy_per_kwh, the period's seconds at
    box_per_hour, at the one price version the run had (gpu_seconds mode)."""
    ((mode, gpu_second, per_kwh, per_hour),) = rows(
        ledger, "SELECT mode, gpu_second, energy_per_kwh, box_per_hour FROM prices"
    )
    assert mode == "gpu_seconds"
    out = Overhead()
    end = float("inf") if through is None else through
    for period_id, start, stop in rows(
        ledger,
        "SELECT period_id, started_at, ended_at FROM usage_periods WHERE ended_at <= ? "
        "ORDER BY started_at",
        end,
    ):
        out.periods.append((start, stop))
        out.box += (stop - start) / 3600 * per_hour
        for awake, busy, joules in rows(
            ledger,
            "SELECT awake_s, busy_s, energy_j FROM worker_usage WHERE period_id = ?",
            period_id,
        ):
            out.idle_gpu_s += max(0.0, awake - busy)
            out.idle += max(0.0, awake - busy) * gpu_second
            out.energy += (joules or 0.0) / 3_600_000 * per_kwh
    return out


def groups(ledger: Path, spread: float) -> dict[tuple[str | None, str], Group]:
    """Per (task class, tenant) of the root task: its trees' tasks, verified successes,
    turn and tool costs and GPU-seconds, and its share of `spread` by GPU-seconds."""
    parent = {t: p for t, p in rows(ledger, "SELECT task_id, parent_task_id FROM tasks")}

    def root(task: str) -> str:
        while parent.get(task) in parent:
            task = parent[task]
        return task

    key = {}
    out: dict[tuple[str | None, str], Group] = {}
    for task, tenant, cls, status, verified in rows(
        ledger, "SELECT task_id, tenant, task_class, status, verified FROM tasks"
    ):
        if root(task) != task:
            continue
        key[task] = (cls, tenant)
        g = out.setdefault((cls, tenant), Group())
        g.tasks += 1
        g.succeeded += status == "succeeded" and verified == 1
    for task, cost, gpu_s in rows(ledger, "SELECT task_id, cost, gpu_s FROM turns"):
        g = out[key[root(task)]]
        g.cost += cost
        g.gpu_s += gpu_s
    for task, cost in rows(ledger, "SELECT task_id, cost FROM task_events WHERE cost > 0"):
        out[key[root(task)]].cost += cost
    basis = sum(g.gpu_s for g in out.values())
    for g in out.values():
        g.overhead = spread * g.gpu_s / basis
    return out
