"""Bars drawn with block characters: an HBM bar (KV, other used, free) and a small fill bar."""

from __future__ import annotations

from rich.text import Text

FULL, PART, FREE = "█", "▓", "░"


def hbm_bar(width: int, total: int, used: int, kv: int | None, *, warn_at: float = 0.9) -> Text:
    """`width` cells: KV (when known), the rest of the used memory, then free memory.

    The used part turns red from `warn_at` of the total: the edge an operator watches.
    """
    bar = Text()
    if width <= 0:
        return bar
    if total <= 0:
        return Text(FREE * width, style="dim")
    used = max(0, min(used, total))
    kv_part = max(0, min(kv or 0, used))
    used_cells = round(width * used / total)
    kv_cells = min(used_cells, round(width * kv_part / total))
    hot = used / total >= warn_at
    bar.append(FULL * kv_cells, style="magenta")
    bar.append(PART * (used_cells - kv_cells), style="bold red" if hot else "yellow")
    bar.append(FREE * (width - used_cells), style="dim green")
    return bar


def fill_bar(width: int, fraction: float | None, *, warn_at: float = 0.9) -> Text:
    """A gauge for a fraction 0..1; blank (dim) when the reading is missing."""
    if width <= 0:
        return Text()
    if fraction is None:
        return Text(" " * width)
    fraction = max(0.0, min(1.0, fraction))
    cells = round(width * fraction)
    style = "bold red" if fraction >= warn_at else "cyan"
    return Text(FULL * cells, style=style) + Text(FREE * (width - cells), style="dim")
