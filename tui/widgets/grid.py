"""A virtual table for many rows: sorts and filters the rows it holds, renders only the lines
on screen.

Textual's DataTable builds a row object and measures every cell when rows are added, about
2 s for 10,000 sessions; the console replaces all rows twice a second. Grid keeps the rows
as they came, sorts and filters them with plain Python keys, and formats cells only for the
lines it draws. Columns that do not fit the width are left out, lowest priority first; a
`flex` column takes the width that is left. The cursor follows its row's key across updates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Column(Generic[R]):
    key: str
    label: str
    width: int
    cell: Callable[[R], str]
    sort_key: Callable[[R], Any] | None = None
    """None: the column cannot be sorted by. Never returns None (10,000 rows are sorted twice
    a second; a missing value sorts by a stand-in such as "" or -1)."""
    align: Literal["left", "right"] = "left"
    priority: int = 0
    """Columns with the lowest priority are dropped first when the width is short."""
    flex: bool = False
    """Takes the width the other columns leave."""


@dataclass(frozen=True, slots=True)
class SortOrder:
    """The column a grid sorts by at first, and in which direction."""

    column: str
    reverse: bool = False


def fit(text: str, width: int, align: str = "left") -> str:
    """`text` in exactly `width` cells: padded, or cut with an ellipsis."""
    if width <= 0:
        return ""
    length = len(text) if text.isascii() else cell_len(text)
    if length > width:
        return set_cell_size(text, width - 1) + "…" if width > 1 else "…"
    pad = " " * (width - length)
    return pad + text if align == "right" else text + pad


class Grid(ScrollView, Generic[R], can_focus=True):
    """Rows of type R under a one-line header; the row under the cursor is `selected`."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor_up", "Up", show=False),
        Binding("down,j", "cursor_down", "Down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home,g", "first", "First", show=False),
        Binding("end,G", "last", "Last", show=False),
        Binding("enter", "select", "Open", show=False),
    ]
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "grid--header",
        "grid--sorted",
        "grid--cursor",
        "grid--empty",
    }
    DEFAULT_CSS = """
    Grid { height: 1fr; overflow-x: hidden; }
    Grid > .grid--header { text-style: bold; }
    Grid > .grid--sorted { text-style: bold underline; }
    Grid > .grid--cursor { background: $accent 40%; }
    Grid:focus > .grid--cursor { background: $accent; color: $text; }
    Grid > .grid--empty { color: $text-muted; }
    """

    cursor = reactive(0, always_update=True, repaint=True)

    class Selected(Message):
        """Enter (or a click on the cursor's row) on a row."""

        def __init__(self, grid: Grid[Any], key: str) -> None:
            super().__init__()
            self.grid = grid
            self.key = key

        @property
        def control(self) -> Grid[Any]:
            return self.grid

    class SortChanged(Message):
        def __init__(self, grid: Grid[Any], column: str, reverse: bool) -> None:
            super().__init__()
            self.grid = grid
            self.column = column
            self.reverse = reverse

        @property
        def control(self) -> Grid[Any]:
            return self.grid

    def __init__(
        self,
        columns: Sequence[Column[R]],
        *,
        row_key: Callable[[R], str],
        search_text: Callable[[R], str] | None = None,
        sort: SortOrder | None = None,
        empty: str = "nothing to show",
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.columns = list(columns)
        self._row_key = row_key
        self._search_text = search_text
        self.sort_column = sort.column if sort is not None else None
        self.sort_reverse = sort.reverse if sort is not None else False
        self.empty_text = empty
        self.filter_text = ""
        self._rows: Sequence[R] = ()
        self._view: list[R] = []
        self._selected_key: str | None = None
        self._layout: list[tuple[Column[R], int]] = []
        self._layout_width = -1

    # -- data ---------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self._rows)

    @property
    def shown(self) -> int:
        return len(self._view)

    @property
    def view(self) -> Sequence[R]:
        return self._view

    @property
    def selected(self) -> R | None:
        return self._view[self.cursor] if 0 <= self.cursor < len(self._view) else None

    def set_rows(self, rows: Sequence[R]) -> None:
        self._rows = rows
        self._rebuild()

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip().lower()
        self._rebuild()

    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        col = self._column(column)
        if col.sort_key is None:
            return
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column, self.sort_reverse = column, reverse
        self._rebuild()
        self.post_message(self.SortChanged(self, column, reverse))

    def cycle_sort(self, step: int = 1) -> None:
        """Sort by the next sortable column (keeps the direction)."""
        keys = [c.key for c in self.columns if c.sort_key is not None]
        if not keys:
            return
        at = keys.index(self.sort_column) if self.sort_column in keys else -step
        self.sort_by(keys[(at + step) % len(keys)], self.sort_reverse)

    def reverse_sort(self) -> None:
        if self.sort_column is not None:
            self.sort_by(self.sort_column, not self.sort_reverse)

    def _column(self, key: str) -> Column[R]:
        for c in self.columns:
            if c.key == key:
                return c
        raise KeyError(key)

    def _rebuild(self) -> None:
        rows: list[R] | Sequence[R] = self._rows
        if self.filter_text and self._search_text is not None:
            needle, text = self.filter_text, self._search_text
            rows = [r for r in rows if needle in text(r)]
        if self.sort_column is not None:
            key = self._column(self.sort_column).sort_key
            if key is not None:
                rows = sorted(rows, key=key, reverse=self.sort_reverse)
        self._view = list(rows)
        self._restore_cursor()
        self.virtual_size = Size(self.size.width, len(self._view) + 1)
        self.refresh()

    def _restore_cursor(self) -> None:
        at = 0
        if self._selected_key is not None:
            key = self._row_key
            wanted = self._selected_key
            for i, row in enumerate(self._view):
                if key(row) == wanted:
                    at = i
                    break
            else:
                at = min(self.cursor, max(0, len(self._view) - 1))
        self._move(at, follow=False)

    # -- cursor ---------------------------------------------------------------------------
    def _page(self) -> int:
        return max(1, self.size.height - 1)

    def _move(self, row: int, *, follow: bool = True) -> None:
        row = max(0, min(row, len(self._view) - 1)) if self._view else 0
        self.cursor = row
        selected = self.selected
        self._selected_key = self._row_key(selected) if selected is not None else None
        if follow:
            self._scroll_to_cursor()

    def _scroll_to_cursor(self) -> None:
        top = int(self.scroll_offset.y)
        page = self._page()
        if self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + page:
            self.scroll_to(y=self.cursor - page + 1, animate=False)

    def action_cursor_up(self) -> None:
        self._move(self.cursor - 1)

    def action_cursor_down(self) -> None:
        self._move(self.cursor + 1)

    def action_page_up(self) -> None:
        self._move(self.cursor - self._page())

    def action_page_down(self) -> None:
        self._move(self.cursor + self._page())

    def action_first(self) -> None:
        self._move(0)

    def action_last(self) -> None:
        self._move(len(self._view) - 1)

    def action_select(self) -> None:
        selected = self.selected
        if selected is not None:
            self.post_message(self.Selected(self, self._row_key(selected)))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            x = 0
            for col, width in self._columns_for(self.size.width):
                if x <= offset.x < x + width + 1:
                    if col.sort_key is not None:
                        self.sort_by(col.key)
                    return
                x += width + 1
            return
        row = int(self.scroll_offset.y) + offset.y - 1
        if 0 <= row < len(self._view):
            again = row == self.cursor
            self._move(row)
            if again or event.chain > 1:
                self.action_select()

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(event.size.width, len(self._view) + 1)

    # -- drawing --------------------------------------------------------------------------
    def _columns_for(self, width: int) -> list[tuple[Column[R], int]]:
        if width == self._layout_width:
            return self._layout
        # A header keeps room for its sort arrow.
        widths = {c.key: max(c.width, cell_len(c.label) + 1) for c in self.columns}
        chosen = list(self.columns)
        while len(chosen) > 1 and sum(widths[c.key] + 1 for c in chosen) - 1 > width:
            chosen.remove(min(chosen, key=lambda c: c.priority))
        spare = max(0, width - (sum(widths[c.key] + 1 for c in chosen) - 1))
        flex = [c for c in chosen if c.flex]
        layout = []
        for c in chosen:
            extra = spare if flex and c is flex[-1] else 0
            layout.append((c, widths[c.key] + extra))
        self._layout, self._layout_width = layout, width
        return layout

    def _line(self, cells: list[str], style: Style, width: int) -> Strip:
        text = " ".join(cells)
        return Strip([Segment(fit(text, width), style)], width)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        layout = self._columns_for(width)
        if y == 0:
            header = base + self.get_component_rich_style("grid--header")
            sorted_style = header + self.get_component_rich_style("grid--sorted")
            segments = []
            for i, (col, w) in enumerate(layout):
                label = col.label
                if col.key == self.sort_column:
                    label = f"{label}{'▼' if self.sort_reverse else '▲'}"
                style = sorted_style if col.key == self.sort_column else header
                segments.append(Segment(fit(label, w, col.align), style))
                if i < len(layout) - 1:
                    segments.append(Segment(" ", header))
            return Strip(segments).adjust_cell_length(width, header)
        index = int(self.scroll_offset.y) + y - 1
        if not self._view:
            if y == 1:
                empty = base + self.get_component_rich_style("grid--empty")
                return Strip([Segment(fit(self.empty_text, width), empty)], width)
            return Strip.blank(width, base)
        if index >= len(self._view):
            return Strip.blank(width, base)
        row = self._view[index]
        style = (
            base + self.get_component_rich_style("grid--cursor") if index == self.cursor else base
        )
        cells = [fit(col.cell(row), w, col.align) for col, w in layout]
        return self._line(cells, style, width)
