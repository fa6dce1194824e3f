"""What every tab of the console shares: the tab line, the connection banner, the footer,
and being handed each new snapshot by the app (`show_state`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ClassVar, Protocol, cast

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from appliance.api.admin.schemas import AdminStateView
from tui.client import StateClient
from tui.widgets.chrome import Banner, TopBar


class Console(Protocol):
    """What the screens use of the console app (tui/app.py `ConsoleApp`), named here so the
    screens need not import the app that imports them."""

    client: StateClient
    url: str
    label: str
    state: AdminStateView | None

    def release_session(self, session_id: str, tenant: str | None = None) -> Awaitable[None]: ...


class StateScreen(Screen[None]):
    """A screen drawn from the latest snapshot. The app calls `show_state` on every screen of
    the current stack when a snapshot arrives; a screen that comes back into view draws the
    latest one it missed."""

    TAB: ClassVar[str] = "overview"

    @property
    def console(self) -> Console:
        return cast(Console, self.app)

    def compose(self) -> ComposeResult:
        yield TopBar(self.TAB, self.console.label, id="topbar")
        yield Banner(self.console.url, id="banner")
        yield from self.compose_body()
        yield Footer(show_command_palette=False)

    def compose_body(self) -> ComposeResult:
        yield from ()

    ready = False
    """True once composed and mounted: from then on the app hands it every snapshot."""

    def on_mount(self) -> None:
        self.ready = True
        state = self.console.state
        if state is not None:
            self.show_state(state)

    def on_screen_resume(self) -> None:
        state = self.console.state
        if state is not None and state is not self._shown:
            self.show_state(state)

    _shown: AdminStateView | None = None

    def show_state(self, state: AdminStateView) -> None:
        self._shown = state
        self.query_one(TopBar).set_time(state.time, state.version)
        self.update_body(state)

    def update_body(self, state: AdminStateView) -> None:
        """Draw `state`; subclasses fill their widgets."""

    def session_released(self, session_id: str) -> None:
        """The appliance released this session's KV; a screen that shows more of it than
        the snapshot reads it again."""
