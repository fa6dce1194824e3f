"""Events: worker restarts and outages, rejections, evictions, releases and cancelled tasks,
newest first (the appliance keeps the newest hundred in its state)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from appliance.api.admin.schemas import AdminStateView, EventView
from tui import format as fmt
from tui.screens.base import StateScreen
from tui.widgets.grid import Column, Grid, SortOrder

NOT_REPORTED = "this appliance does not report events in its state yet"


def _event_key(e: EventView) -> str:
    return f"{e.at}/{e.kind}/{e.subject}/{e.tenant}"


def _event_text(e: EventView) -> str:
    return " ".join((e.kind, e.subject, e.tenant or "", e.detail)).lower()


EVENT_COLUMNS: list[Column[EventView]] = [
    Column("time", "time", 9, lambda e: fmt.clock(e.at), lambda e: e.at, priority=100),
    Column("kind", "kind", 14, lambda e: e.kind, lambda e: e.kind, priority=90),
    Column("subject", "subject", 16, lambda e: e.subject, lambda e: e.subject, priority=70),
    Column(
        "tenant", "tenant", 8, lambda e: fmt.text(e.tenant), lambda e: e.tenant or "", priority=30
    ),
    Column("detail", "detail", 20, lambda e: e.detail, None, priority=80, flex=True),
]


class EventsScreen(StateScreen):
    TAB = "events"

    def compose_body(self) -> ComposeResult:
        yield Grid(
            EVENT_COLUMNS,
            row_key=_event_key,
            search_text=_event_text,
            sort=SortOrder("time", reverse=True),
            empty="no events yet",
            id="events",
        )
        yield Static(id="events-status", classes="status")

    def on_mount(self) -> None:
        self.query_one(Grid).focus()

    def update_body(self, state: AdminStateView) -> None:
        grid: Grid[EventView] = self.query_one(Grid)
        status = self.query_one("#events-status", Static)
        if state.events is None:
            grid.empty_text = NOT_REPORTED
            grid.set_rows([])
            status.update(NOT_REPORTED)
            return
        grid.empty_text = "no events yet"
        grid.set_rows(state.events)
        kinds: dict[str, int] = {}
        for e in state.events:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        status.update(
            f"{len(state.events):,} events"
            + "".join(f" · {n:,} {kind}" for kind, n in sorted(kinds.items()))
        )
