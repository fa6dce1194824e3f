"""Sessions: one row per agent session, sortable and filterable; Enter opens a session, `x`
releases the KV it holds (after a confirmation)."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Input, Static

from appliance.api.admin.schemas import AdminStateView, SessionStateView
from tui import format as fmt
from tui.screens.base import StateScreen
from tui.screens.release import confirm_release
from tui.screens.session_detail import SessionDetailScreen
from tui.widgets.grid import Column, Grid, SortOrder


def _search_text(s: SessionStateView) -> str:
    return " ".join(
        (s.id, s.tenant, s.task_id or "", s.worker or "", s.tool_class or "", s.decision or "")
    ).lower()


def session_key(s: SessionStateView) -> str:
    """Session ids are per tenant: the row key is tenant/id (unique)."""
    return f"{s.tenant}/{s.id}"


SESSION_COLUMNS: list[Column[SessionStateView]] = [
    Column("id", "session", 14, lambda s: s.id, lambda s: s.id, priority=100),
    Column("tenant", "tenant", 8, lambda s: s.tenant, lambda s: s.tenant, priority=90),
    Column(
        "task", "task", 12, lambda s: fmt.text(s.task_id), lambda s: s.task_id or "", priority=60
    ),
    Column(
        "worker", "worker", 6, lambda s: fmt.text(s.worker), lambda s: s.worker or "", priority=80
    ),
    Column(
        "gpu_tokens",
        "GPU tok",
        8,
        lambda s: fmt.tokens(s.resident_tokens.gpu),
        lambda s: s.resident_tokens.gpu,
        align="right",
        priority=95,
    ),
    Column(
        "host_tokens",
        "host tok",
        8,
        lambda s: fmt.tokens(s.resident_tokens.host),
        lambda s: s.resident_tokens.host,
        align="right",
        priority=50,
    ),
    Column(
        "held_tokens",
        "held tok",
        8,
        lambda s: fmt.tokens(s.resident_tokens.gpu_held),
        lambda s: s.resident_tokens.gpu_held,
        align="right",
        priority=35,
    ),
    Column(
        "gpu_bytes",
        "GPU bytes",
        9,
        lambda s: fmt.size(s.resident_bytes.gpu),
        lambda s: s.resident_bytes.gpu,
        align="right",
        priority=70,
    ),
    Column(
        "host_bytes",
        "host bytes",
        10,
        lambda s: fmt.size(s.resident_bytes.host),
        lambda s: s.resident_bytes.host,
        align="right",
        priority=30,
    ),
    Column(
        "idle",
        "idle",
        6,
        lambda s: fmt.seconds(s.idle_s),
        lambda s: s.idle_s,
        align="right",
        priority=85,
    ),
    Column("turns", "turns", 5, lambda s: str(s.turns), lambda s: s.turns, "right", 20),
    Column(
        "tool",
        "tool",
        8,
        lambda s: fmt.text(s.tool_class),
        lambda s: s.tool_class or "",
        priority=55,
    ),
    Column(
        "wait",
        "wait",
        6,
        lambda s: fmt.seconds(s.expected_wait_s),
        lambda s: -1.0 if s.expected_wait_s is None else s.expected_wait_s,
        align="right",
        priority=45,
    ),
    Column(
        "decision",
        "decision",
        8,
        lambda s: fmt.text(s.decision),
        lambda s: s.decision or "",
        priority=65,
    ),
    Column(
        "reason",
        "reason",
        16,
        lambda s: fmt.text(s.reason),
        lambda s: s.reason or "",
        "left",
        40,
        True,
    ),
]


class SessionGrid(Grid[SessionStateView]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select", "Detail"),
    ]


class SessionsScreen(StateScreen):
    TAB = "sessions"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse"),
        Binding("x", "release", "Release KV"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def compose_body(self) -> ComposeResult:
        yield Input(placeholder="filter: session, tenant, task, worker, tool …  (/)", id="filter")
        yield SessionGrid(
            SESSION_COLUMNS,
            row_key=session_key,
            search_text=_search_text,
            sort=SortOrder("gpu_tokens", reverse=True),
            empty="no sessions",
            id="sessions",
        )
        yield Static(id="sessions-status", classes="status")

    def on_mount(self) -> None:
        self.query_one(Input).cursor_blink = False
        self.query_one(SessionGrid).focus()

    @property
    def grid(self) -> SessionGrid:
        return self.query_one(SessionGrid)

    def update_body(self, state: AdminStateView) -> None:
        self.grid.set_rows(state.sessions)
        self._status(state)

    def _status(self, state: AdminStateView | None = None) -> None:
        grid = self.grid
        parts = [f"{grid.total:,} sessions"]
        if grid.filter_text:
            parts.append(f"{grid.shown:,} match “{grid.filter_text}”")
        if grid.sort_column is not None:
            label = next(c.label for c in grid.columns if c.key == grid.sort_column)
            parts.append(f"sorted by {label} {'▼' if grid.sort_reverse else '▲'}")
        state = state or self.console.state
        if state is not None and state.sessions and all(s.decision is None for s in state.sessions):
            reasons = Counter(s.reason for s in state.sessions if s.reason)
            if len(reasons) == 1:
                parts.append(f"decisions: {next(iter(reasons))}")
        self.query_one("#sessions-status", Static).update(" · ".join(parts), layout=False)

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.grid.set_filter(event.value)
        self._status()

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.grid.focus()

    @on(Grid.SortChanged)
    def _sorted(self) -> None:
        self._status()

    @on(Grid.Selected, "#sessions")
    def _open(self, event: Grid.Selected) -> None:
        session = self.grid.selected
        if session is not None and session_key(session) == event.key:
            self.app.push_screen(SessionDetailScreen(session.id, session.tenant))

    def action_filter(self) -> None:
        self.query_one(Input).focus()

    def action_clear_filter(self) -> None:
        filter_input = self.query_one(Input)
        if filter_input.value:
            filter_input.value = ""
        self.grid.focus()

    def action_sort(self) -> None:
        self.grid.cycle_sort()

    def action_reverse(self) -> None:
        self.grid.reverse_sort()

    def action_release(self) -> None:
        session = self.grid.selected
        if session is not None:
            confirm_release(self, session)
