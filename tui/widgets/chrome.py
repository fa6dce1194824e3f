"""The frame around every screen: the tab line and the connection banner."""

from __future__ import annotations

from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget

from tui import format as fmt
from tui.client import Lost

TABS = (
    ("overview", "1", "Overview"),
    ("sessions", "2", "Sessions"),
    ("tasks", "3", "Tasks"),
    ("costs", "4", "Costs"),
    ("events", "5", "Events"),
)


class TopBar(Widget):
    """`1 Overview 2 Sessions ...` with the current screen lit, and on the right which
    appliance this is (its address, and its version once a snapshot says it) and the time of
    the snapshot on screen."""

    DEFAULT_CSS = """
    TopBar { height: 1; background: $panel; }
    """

    def __init__(self, current: str, label: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.current = current
        self.label = label
        self.snapshot_time: float | None = None
        self.version: str | None = None

    def set_time(self, unix_s: float, version: str | None = None) -> None:
        if unix_s != self.snapshot_time or version != self.version:
            self.snapshot_time = unix_s
            self.version = version
            self.refresh()

    def render(self) -> RenderResult:
        line = Text(no_wrap=True, overflow="ellipsis")
        for tab, key, title in TABS:
            if tab == self.current:
                line.append(f" {key} {title} ", style="bold reverse")
            else:
                line.append(f" {key}", style="bold")
                line.append(f" {title} ", style="dim")
        version = f" v{self.version}" if self.version else ""
        right = Text(f"{self.label}{version}  {fmt.clock(self.snapshot_time)} ", style="dim")
        gap = self.size.width - line.cell_len - right.cell_len
        if gap >= 1:
            line.append(" " * gap)
            line.append_text(right)
        return line


class Banner(Widget):
    """Hidden while the appliance answers; otherwise says what is wrong and when the console
    tries again (a refused key: that it does not, until `r`), and that what is on screen is
    the last snapshot it got."""

    DEFAULT_CSS = """
    Banner { height: auto; display: none; padding: 0 1; }
    Banner.-lost { display: block; background: $error; color: $text; text-style: bold; }
    Banner.-connecting { display: block; background: $panel; color: $text-muted; }
    """

    def __init__(self, url: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.url = url
        self.link: Lost | str = "connecting"
        self.last_time: float | None = None

    def on_mount(self) -> None:
        self.watch(self.app, "link", self.show_link, init=True)

    def show_link(self, link: Lost | str) -> None:
        self.link = link
        self.set_class(isinstance(link, Lost), "-lost")
        self.set_class(link == "connecting", "-connecting")
        self.clear_cached_dimensions()
        self.refresh(layout=True)

    def render(self) -> RenderResult:
        link = self.link
        if isinstance(link, Lost):
            held = getattr(self.app, "state", None)
            shown = (
                f"showing the snapshot of {fmt.clock(held.time)}"
                if held is not None
                else "no snapshot yet"
            )
            if not link.retrying:
                return Text(
                    f"⚠ key refused: {link.message} · not retrying: r tries again · {shown}"
                )
            return Text(
                f"⚠ connection lost: {link.message} · retry {link.attempt} in "
                f"{link.retry_in_s:.1f}s · {shown}"
            )
        if link == "connecting":
            return Text(f"connecting to {self.url} …")
        return Text()
