"""Costs: cost per successful task by task class and tenant (direct cost, the share of the
box's overhead, their total), the workers' GPU-seconds and the overhead recorded, and a chart
of cost per success over time with its scale (tui/widgets/chart.py)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.api.admin.schemas import AdminStateView, CostsView, OverheadView, WorkerStateView
from tui import format as fmt
from tui.screens.base import StateScreen
from tui.widgets.chart import CostChart

NOT_REPORTED = (
    "This appliance does not report costs in its state yet. "
    "`appliance costs` reads them from the ledger."
)


def cost_table(costs: CostsView) -> Table | Text:
    if costs.groups is None:
        return Text(NOT_REPORTED, style="dim")
    if not costs.groups:
        return Text("No tasks have finished yet.", style="dim")
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("task class", no_wrap=True)
    table.add_column("tenant", no_wrap=True)
    table.add_column("tasks", justify="right")
    table.add_column("succeeded", justify="right")
    table.add_column("attempts", justify="right")
    table.add_column("cost", justify="right")
    table.add_column("overhead", justify="right")
    table.add_column("total", justify="right")
    table.add_column("per success", justify="right", style="bold")
    for g in costs.groups:
        currency = g.currency or costs.currency
        table.add_row(
            fmt.text(g.task_class),
            fmt.text(g.tenant),
            fmt.num(g.tasks),
            fmt.num(g.succeeded),
            fmt.num(g.attempts)
            + (f" ({g.unpriced_attempts} unpriced)" if g.unpriced_attempts else ""),
            fmt.money(g.cost, currency),
            fmt.money(g.overhead, currency),
            fmt.money(g.total_cost, currency),
            fmt.money(g.cost_per_success, currency),
        )
    return table


def gpu_time_line(workers: list[WorkerStateView]) -> Text:
    """The workers' GPU-seconds now: busy (what the turns' gpu_s add up to) and idle (the
    overhead the tasks share, as the ledger records it period by period)."""
    metered = [w for w in workers if w.gpu_busy_s is not None and w.gpu_idle_s is not None]
    if not metered:
        return Text("not reported", style="dim")
    busy = sum(w.gpu_busy_s or 0.0 for w in metered)
    idle = sum(w.gpu_idle_s or 0.0 for w in metered)
    share = f" ({idle / (busy + idle):.0%} of awake time)" if busy + idle > 0 else ""
    return Text(f"busy {busy:,.1f} · idle {idle:,.1f}{share}")


def overhead_line(overhead: OverheadView | None, currency: str | None) -> Text:
    """The overhead the table's groups share: what the ledger recorded so far, in parts."""
    if overhead is None:
        return Text("not reported", style="dim")
    if overhead.through is None:
        return Text("none recorded yet (one row per worker each ledger.usage_period_s)", "dim")
    return Text(
        f"{fmt.money(overhead.total, currency)} through {fmt.clock(overhead.through)}: "
        f"idle {overhead.idle_gpu_s:,.1f} GPU-s {fmt.money(overhead.idle)} · "
        f"energy {overhead.energy_kwh:,.3f} kWh {fmt.money(overhead.energy)} · "
        f"box {overhead.box_hours:,.2f} h {fmt.money(overhead.box)}; "
        "shared by GPU-seconds"
    )


class CostsScreen(StateScreen):
    TAB = "costs"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="costs"):
            yield Static("Cost per successful task", classes="section")
            yield Static(id="cost-table")
            yield Static("GPU-seconds", classes="section")
            yield Static(id="gpu-time")
            yield Static("Overhead (in the table's cost per success)", classes="section")
            yield Static(id="overhead")
            yield Static("Over time (cost per success)", classes="section")
            yield Static(id="cost-chart-caption", classes="status")
            yield CostChart(id="cost-chart")

    def update_body(self, state: AdminStateView) -> None:
        costs = state.costs
        self.query_one("#cost-table", Static).update(cost_table(costs))
        self.query_one("#gpu-time", Static).update(gpu_time_line(state.workers))
        self.query_one("#overhead", Static).update(overhead_line(costs.overhead, costs.currency))
        series = [p.cost_per_success for p in costs.series or () if p.cost_per_success is not None]
        caption = self.query_one("#cost-chart-caption", Static)
        chart = self.query_one(CostChart)
        chart.display = bool(series)
        if not series:
            caption.update(
                Text("no history reported" if costs.series is None else "no data yet", "dim")
            )
            return
        points = costs.series or []
        caption.update(
            f"last {fmt.money(series[-1], costs.currency)} · min {fmt.money(min(series))} · "
            f"max {fmt.money(max(series))} · {len(series)} windows from "
            f"{fmt.clock(points[0].window_start)} to {fmt.clock(points[-1].window_start)}"
            f" · {points[-1].succeeded:,} successes"
        )
        chart.show(points, costs.currency)
