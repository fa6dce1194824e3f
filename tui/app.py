"""`appliance top`: the operator console.

One async poll worker reads `GET /admin/v1/state` twice a second and posts each snapshot to
the app (`StateUpdated`, which a newer one replaces while still queued). The app keeps the
latest snapshot and hands it to the screens of the current stack; a tab that comes back into
view draws the latest one it missed. A lost connection shows as a banner on every screen and
clears by itself when the appliance answers again; a refused key is said once, naming the
key and data dir used and how to fix it, and not retried until the operator presses `r`.
The one operator action, releasing a session's KV, asks first and then shows the
appliance's own answer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

from textual import on, work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.reactive import reactive

from appliance.api.admin.schemas import AdminStateView
from tui.client import ConsoleError, Lost, Poller, StateClient, console_key, default_data_dir
from tui.messages import ConnectionLost, ConnectionRestored, ReleaseFinished, StateUpdated
from tui.screens.base import StateScreen
from tui.screens.costs import CostsScreen
from tui.screens.dialogs import HelpScreen
from tui.screens.events import EventsScreen
from tui.screens.overview import OverviewScreen
from tui.screens.sessions import SessionsScreen
from tui.screens.tasks import TasksScreen

REFRESH_S = 0.5


class ConsoleApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "appliance top"
    ENABLE_COMMAND_PALETTE = False
    MODES: ClassVar[dict[str, type[StateScreen]]] = {  # type: ignore[assignment]
        "overview": OverviewScreen,
        "sessions": SessionsScreen,
        "tasks": TasksScreen,
        "costs": CostsScreen,
        "events": EventsScreen,
    }
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "switch_mode('overview')", "Overview", show=False),
        Binding("2", "switch_mode('sessions')", "Sessions", show=False),
        Binding("3", "switch_mode('tasks')", "Tasks", show=False),
        Binding("4", "switch_mode('costs')", "Costs", show=False),
        Binding("5", "switch_mode('events')", "Events", show=False),
        Binding("r", "refresh", "Refresh"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    link: reactive[Lost | str] = reactive("connecting")
    """"connecting" until the first snapshot, "ok" while the appliance answers, else Lost."""

    def __init__(
        self,
        client: StateClient,
        *,
        interval_s: float = REFRESH_S,
        label: str | None = None,
        poller: Poller | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.url = client.url
        self.label = label if label is not None else client.url.split("://", 1)[-1]
        self.poller = poller or Poller(client, interval_s=interval_s)
        self.state: AdminStateView | None = None
        self.updates = 0

    def on_mount(self) -> None:
        self.switch_mode("overview")
        self.poll()

    async def on_unmount(self) -> None:
        await self.client.aclose()

    @work(exclusive=True, group="poll")
    async def poll(self) -> None:
        await self.poller.run(
            on_state=lambda state: self.post_message(StateUpdated(state)),
            on_lost=lambda lost: self.post_message(ConnectionLost(lost)),
            on_restored=lambda: self.post_message(ConnectionRestored()),
        )

    def on_state_updated(self, message: StateUpdated) -> None:
        self.state = message.state
        self.updates += 1
        if self.link != "ok" and not isinstance(self.link, Lost):
            self.link = "ok"
        for screen in self.screen_stack:
            if isinstance(screen, StateScreen) and screen.ready:
                try:
                    screen.show_state(message.state)
                except NoMatches:  # the screen is being taken down (the app is closing)
                    continue

    def on_connection_lost(self, message: ConnectionLost) -> None:
        self.link = message.lost

    def on_connection_restored(self, message: ConnectionRestored) -> None:
        self.link = "ok"
        self.notify("The appliance answers again.", timeout=3)

    def action_refresh(self) -> None:
        self.poller.wake()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.screen))

    @work(group="release")
    async def release_session(self, session_id: str, tenant: str | None = None) -> None:
        try:
            result = await self.client.release_session(session_id, tenant)
        except ConsoleError as exc:
            self.post_message(ReleaseFinished(session_id, False, exc.message))
            return
        held = f" ({result.released_tokens:,} tokens)" if result.released_tokens is not None else ""
        self.post_message(ReleaseFinished(session_id, True, f"released{held}"))
        self.poller.wake()

    @on(ReleaseFinished)
    def _released(self, message: ReleaseFinished) -> None:
        if message.ok:
            self.notify(f"Session {message.session_id}: {message.text}.", timeout=5)
            for screen in self.screen_stack:
                if isinstance(screen, StateScreen) and screen.ready:
                    screen.session_released(message.session_id)
        else:
            self.notify(
                f"The appliance refused to release session {message.session_id}: {message.text}",
                title="Release failed",
                severity="error",
                timeout=10,
            )


def console_app(url: str, api_key: str | None, data_dir: Path | None) -> ConsoleApp:
    """The console for the appliance at `url`, with `api_key`, else the first operator key in
    `data_dir`'s api-keys.toml (`data_dir` defaults to $APPLIANCE_DATA_DIR, else
    ~/.local/share/appliance); it names that key and data dir if the appliance refuses the
    key. Exits with a one-line message when there is no key to use."""
    found = console_key(api_key, data_dir)
    if found is None:
        where = (data_dir or default_data_dir()) / "api-keys.toml"
        raise SystemExit(
            f"appliance top: no operator key in {where}; pass --data-dir of the appliance, "
            "or create one with `appliance keys add NAME --admin`"
        )
    key, source = found
    return ConsoleApp(StateClient(url, key, key_source=source))


def run_console(url: str, api_key: str | None, data_dir: Path | None) -> None:
    """Run the console (`console_app`) in this terminal until the operator quits."""
    console_app(url, api_key, data_dir).run()
    if sys.stdout.isatty():
        sys.stdout.flush()
