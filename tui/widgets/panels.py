"""The Overview's panels: GPUs with HBM bars, workers, and the admission/routing summary.

Each panel holds the latest snapshot and draws it at its own width; `update_state` is cheap
(a few dozen lines at most), so the Overview redraws whole panels on every snapshot.
"""

from __future__ import annotations

from collections import Counter

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget

from appliance.api.admin.schemas import AdminStateView, GpuStateView, WorkerStateView
from tui import format as fmt
from tui.widgets.bars import FREE, FULL, PART, fill_bar, hbm_bar


class Panel(Widget):
    DEFAULT_CSS = """
    Panel { height: auto; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.state: AdminStateView | None = None

    def update_state(self, state: AdminStateView) -> None:
        self.state = state
        self.clear_cached_dimensions()  # the height follows the number of GPUs and workers
        self.refresh(layout=True)


class GpuPanel(Panel):
    """One line per GPU: an HBM bar (KV, other used, free), used of total, util, temp, power."""

    def render(self) -> RenderResult:
        state = self.state
        if state is None:
            return Text("waiting for the first snapshot …", style="dim")
        if not state.gpus:
            return Text(
                "No NVIDIA GPU reported: NVML sees none on this host. "
                "Workers run without one (simulated or CPU engine).",
                style="dim",
            )
        width = self.size.width
        lines = [self._line(g, width) for g in state.gpus]
        kv_known = any(g.kv_bytes is not None for g in state.gpus)
        legend = Text(style="dim")
        legend.append(FULL, style="magenta")
        legend.append(" KV  " if kv_known else " KV (not reported)  ")
        legend.append(PART, style="yellow")
        legend.append(" used  ")
        legend.append(FREE, style="dim green")
        legend.append(" free")
        if is_simulated(state.gpu_driver):
            legend.append("  · simulated by the sim engine's GPU model, not measured", "italic")
        return Group(*lines, legend)

    @staticmethod
    def _line(g: GpuStateView, width: int) -> Text:
        head = f"GPU{g.index} {g.name.removeprefix('NVIDIA ')[:10]:<10} "
        used = f" {fmt.gib(g.mem_used_bytes):>5}/{fmt.gib(g.mem_total_bytes)} GiB"
        kv = f" KV {fmt.gib(g.kv_bytes)}" if g.kv_bytes is not None else " KV -"
        util = f"  util {fmt.pct(g.util):>4}"
        temp = f" {g.temp_c:.0f}°C" if g.temp_c is not None else " -°C"
        power = f" {g.power_w:.0f} W" if g.power_w is not None else " - W"
        tail = used + kv + util + temp + power
        bar_width = max(8, width - len(head) - len(tail))
        line = Text(head, style="bold", no_wrap=True, overflow="ellipsis")
        line.append_text(hbm_bar(bar_width, g.mem_total_bytes, g.mem_used_bytes, g.kv_bytes))
        line.append(tail)
        return line


def is_simulated(gpu_driver: str | None) -> bool:
    """The appliance runs the simulated engine: its GPU readings are a model."""
    return gpu_driver is not None and gpu_driver.startswith("simulated")


STATE_STYLES = {
    "awake": "green",
    "draining": "yellow",
    "down": "bold red",
    "failed": "bold red",
    "waking": "bold yellow",
    "asleep": "dim",
    "stopped": "dim red",
}
"""A worker's state word (tui.format.worker_state) by its first word. Only a fault is bold
red (an awake worker failing its /health, a crashed one, one the supervisor gave up on):
asleep and stopped are the appliance's own choice, shown muted."""


def worker_state_cell(w: WorkerStateView, *, wide: bool = True) -> Text:
    """Its state word, styled; the sleep level only when `wide` (80 columns fit the rest)."""
    level = w.sleep_level if wide else None
    label = fmt.worker_state(w.state, w.healthy, w.draining, level, w.lifecycle)
    return Text(label, style=STATE_STYLES.get(label.split()[0], ""))


class WorkersPanel(Panel):
    """Per worker: its state (awake, draining, down, asleep, stopped, waking), running/waiting,
    KV use (the share of its KV pool that holds KV, cached blocks included: `fmt.kv_fill`),
    the KV on its GPU in tokens (every block that holds anything, cached ones too: what the
    sessions' resident tokens add up to; when the appliance reports it), prefix hit rate,
    restarts; when wide, its measured prefill time
    against the GPU profile's, a sleeping worker's level (asleep L1 or L2), its latest wake's
    seconds, and its URL."""

    def render(self) -> RenderResult:
        state = self.state
        if state is None:
            return Text("")
        if not state.workers:
            return Text("No workers: the appliance reports none.", style="dim")
        wide = self.size.width >= 110
        table = Table(box=None, padding=(0, 1), expand=False, show_edge=False)
        table.add_column("worker", style="bold", no_wrap=True)
        table.add_column("engine", no_wrap=True)
        table.add_column("state", no_wrap=True)
        table.add_column("run", justify="right", no_wrap=True)
        table.add_column("wait", justify="right", no_wrap=True)
        table.add_column("KV use", no_wrap=True)
        kv_tokens = any(w.kv_tokens is not None for w in state.workers)
        if kv_tokens:
            table.add_column("KV tok", justify="right", no_wrap=True)
        table.add_column("prefix", justify="right", no_wrap=True)
        table.add_column("restarts", justify="right", no_wrap=True)
        table.add_column("GPUs", no_wrap=True)
        if wide:
            table.add_column("prefill", justify="right", no_wrap=True)
            table.add_column("wake", justify="right", no_wrap=True)
            table.add_column("url", style="dim", no_wrap=True)
        for w in state.workers:
            used = fmt.kv_fill(w.kv_usage, w.kv_tokens, w.kv_capacity_tokens)
            kv = fill_bar(10, used) + Text(f" {fmt.fine_pct(used):>4}")
            cells: list[RenderableType] = [
                w.id,
                fmt.text(w.engine),
                worker_state_cell(w, wide=wide),
                fmt.num(w.running),
                fmt.num(w.waiting),
                kv,
                *([fmt.tokens(w.kv_tokens)] if kv_tokens else []),
                fmt.pct(w.prefix_hit_rate),
                Text(str(w.restarts), style="bold yellow" if w.restarts else ""),
                ",".join(str(i) for i in w.gpus) or "-",
            ]
            if wide:
                cells += [
                    fmt.times(w.prefill_slowdown),
                    fmt.seconds(w.last_wake_s),
                    fmt.text(w.url),
                ]
            table.add_row(*cells)
        return table


class SummaryPanel(Panel):
    """Sessions and what they hold, tasks by status, admission, routing."""

    def render(self) -> RenderResult:
        state = self.state
        if state is None:
            return Text("")
        gpu_tokens = sum(s.resident_tokens.gpu for s in state.sessions)
        host_tokens = sum(s.resident_tokens.host for s in state.sessions)
        gpu_bytes = sum(s.resident_bytes.gpu for s in state.sessions)
        statuses = Counter(t.status for t in state.tasks)
        lines = [
            _kv(
                "sessions",
                f"{len(state.sessions):,} · resident {fmt.tokens(gpu_tokens)} tok on GPU "
                f"({fmt.size(gpu_bytes)}) · {fmt.tokens(host_tokens)} on host",
            ),
            _kv(
                "tasks",
                f"{len(state.tasks):,}"
                + "".join(f" · {n:,} {status}" for status, n in sorted(statuses.items())),
            ),
            _kv("admission", _admission(state)),
            _kv(
                "routing",
                " · ".join(f"{reason} {n:,}" for reason, n in sorted(state.routing.items()))
                or "no turns routed yet",
            ),
        ]
        return Group(*lines)


def _kv(key: str, value: str) -> Text:
    line = Text(f"{key:<10} ", style="bold", no_wrap=True, overflow="ellipsis")
    line.append(value, style="")
    return line


def _admission(state: AdminStateView) -> str:
    a = state.admission
    if a.accepted is None and a.rejected is None and a.accept_rate_per_s is None:
        return "not reported by this appliance yet"
    parts = []
    if a.accept_rate_per_s is not None or a.reject_rate_per_s is not None:
        accept = "-" if a.accept_rate_per_s is None else f"{a.accept_rate_per_s:.1f}/s"
        reject = "-" if a.reject_rate_per_s is None else f"{a.reject_rate_per_s:.1f}/s"
        parts.append(f"accept {accept} · reject {reject}")
    if a.accepted is not None or a.rejected is not None:
        parts.append(f"accepted {fmt.num(a.accepted)} · rejected {fmt.num(a.rejected)}")
    if a.by_reason:
        parts.append(", ".join(f"{r} {n:,}" for r, n in sorted(a.by_reason.items())))
    if a.in_flight_turns is not None or a.open_tasks is not None:
        parts.append(
            f"{fmt.num(a.in_flight_turns)} turns in flight · {fmt.num(a.open_tasks)} open tasks"
        )
    return " · ".join(parts)
