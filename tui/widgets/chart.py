"""The cost-per-success chart of the Costs screen: one bar per window of the series, with a
labelled scale.

The y axis starts at zero (a bar's height is its value, never exaggerated) and is labelled
at zero, half and the top (the highest value shown), in the currency the title names; the
x axis is the windows' start times (UTC), labelled at its ends and its middle, and says the
windows' length. A window with no success has no cost per success: its column stays empty.
When the series has more windows than the width has columns, the newest are shown and the
axis title says how many.
"""

from __future__ import annotations

from itertools import pairwise

from rich.console import Group
from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget

from appliance.api.admin.schemas import CostPointView
from tui import format as fmt

LEVELS = " ▁▂▃▄▅▆▇█"
PLOT_ROWS = 6
MAX_BAR = 4


def chart_lines(
    points: list[CostPointView], currency: str | None, width: int, rows: int = PLOT_ROWS
) -> list[Text]:
    """The chart drawn `width` cells wide: a title, `rows` rows of bars beside the y axis,
    the x axis, its time labels and its title."""
    values = [p.cost_per_success for p in points]
    top = max((v for v in values if v is not None), default=0.0)
    labels = {0: fmt.money(top), rows // 2: fmt.money(top / 2)}  # each at its row's top
    gutter = max(len(label) for label in labels.values()) + 1
    room = max(width - gutter - 1, 1)
    shown = points[-room:]
    bar = max(1, min(MAX_BAR, room // max(len(shown), 1)))
    unit = f", {currency}" if currency else ""
    out = [Text(f"cost per successful task{unit}", style="bold")]
    for row in range(rows):
        line = Text(f"{labels.get(row, ''):>{gutter - 1}} ", style="dim")
        line.append("┤" if row in labels else "│", style="dim")
        floor = rows - 1 - row  # whole rows below this one
        for p in shown:
            v = p.cost_per_success
            fill = 0.0 if v is None or top <= 0 else min(max(v / top * rows - floor, 0.0), 1.0)
            line.append(LEVELS[round(fill * 8)] * max(bar - 1, 1), style="cyan")
            line.append(" " if bar > 1 else "")
        out.append(line)
    span = len(shown) * bar
    out.append(Text(f"{'0':>{gutter - 1}} └" + "─" * span, style="dim"))
    out.append(_time_labels(shown, gutter + 1, span, bar))
    step = _window_s(shown)
    each = f", one bar per {fmt.seconds(step)} window" if step else ""
    cut = f", the newest {len(shown)} of {len(points)}" if len(shown) < len(points) else ""
    out.append(Text(" " * (gutter + 1) + f"window start (UTC){each}{cut}", style="dim"))
    return out


def _time_labels(shown: list[CostPointView], left: int, span: int, bar: int) -> Text:
    """The first, middle and last windows' start times: the first from the axis's start,
    the middle centred on its bar (left out where it would overlap), the last ending at the
    axis's end."""
    line = ""
    last = len(shown) - 1
    for i in dict.fromkeys([0, last // 2, last] if shown else []):
        label = fmt.clock(shown[i].window_start)
        after = len(line) + 1 if line else left  # where the previous label leaves room
        if i == last:  # ends at the axis's end, or past it when the axis is short
            at = max(left + span - len(label), after)
        else:
            at = left if i == 0 else left + i * bar + bar // 2 - len(label) // 2
        if at < after:
            continue
        line = line.ljust(at) + label
    return Text(line, style="dim")


def _window_s(points: list[CostPointView]) -> float | None:
    """The windows' length: the step between consecutive starts (None: fewer than two)."""
    steps = [b.window_start - a.window_start for a, b in pairwise(points)]
    return min(steps) if steps else None


class CostChart(Widget):
    DEFAULT_CSS = """
    CostChart { height: auto; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.points: list[CostPointView] = []
        self.currency: str | None = None

    def show(self, points: list[CostPointView], currency: str | None) -> None:
        self.points, self.currency = points, currency
        self.clear_cached_dimensions()
        self.refresh(layout=True)

    def render(self) -> RenderResult:
        return Group(*chart_lines(self.points, self.currency, self.size.width))
