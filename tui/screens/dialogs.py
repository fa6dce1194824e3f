"""Modal dialogs: a yes/no confirmation and the key help (`?`)."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    """`question`; y / Enter on the confirm button: True; n / Escape: False."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, *, confirm: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.confirm = confirm

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button(f"{self.confirm} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


NAVIGATION = [
    ("↑ ↓  j k", "move the cursor"),
    ("PgUp PgDn", "move a page"),
    ("Home End  g G", "first / last row"),
    ("Enter", "open the row (Sessions), expand or collapse (Tasks)"),
    ("click a header", "sort by that column; again to reverse"),
]


class HelpScreen(ModalScreen[None]):
    """The keys of the screen below, the console's keys and the navigation keys."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "close", "Close"),
    ]

    def __init__(self, below: Screen[object]) -> None:
        super().__init__()
        self.below = below

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row(Text("This screen", style="underline"), "")
        for key, text in self._keys(self.below.BINDINGS):
            table.add_row(key, text)
        table.add_row("", "")
        table.add_row(Text("Everywhere", style="underline"), "")
        for key, text in self._keys(self.app.BINDINGS):
            table.add_row(key, text)
        table.add_row("", "")
        table.add_row(Text("Tables and trees", style="underline"), "")
        for key, text in NAVIGATION:
            table.add_row(key, text)
        with VerticalScroll(id="help") as box:
            box.border_title = "Keys"
            box.border_subtitle = "Esc or ? closes"
            yield Static(table)

    def _keys(self, bindings: list[BindingType]) -> list[tuple[str, str]]:
        rows = []
        for b in bindings:
            if isinstance(b, Binding) and b.description:
                keys = " ".join(self.app.get_key_display(Binding(k, "")) for k in b.key.split(","))
                rows.append((keys, b.tooltip or b.description))
        return rows

    def action_close(self) -> None:
        self.dismiss(None)
