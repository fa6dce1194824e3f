"""One session: what it holds where, its task and tool wait, the reaper's decision, its turns.

The fields come from each snapshot; its residency per worker and its turns from
`GET /admin/v1/sessions/{id}?tenant=T`, fetched when the screen opens, on `t` and after a
release. The residency follows the snapshots: when the session's figures in a snapshot
differ from those the residency was read with (a release, a hold that lapsed, a turn), it is
read again, so the table never contradicts the fields above it. An appliance without that
route says so in place.
"""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.api.admin.schemas import (
    AdminStateView,
    SessionDetail,
    SessionResidency,
    SessionStateView,
    TiersView,
)
from tui import format as fmt
from tui.client import ConsoleError
from tui.screens.base import StateScreen
from tui.screens.release import confirm_release


def session_fields(s: SessionStateView, tasks: dict[str, str]) -> Table:
    table = Table(box=None, show_header=False, padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    rows = [
        ("session", s.id),
        ("tenant", s.tenant),
        ("task", f"{fmt.text(s.task_id)}  ({tasks.get(s.task_id or '', 'not in the state')})"),
        ("worker", fmt.text(s.worker)),
        (
            "resident GPU",
            f"{fmt.num(s.resident_tokens.gpu)} tokens · {fmt.size(s.resident_bytes.gpu)}",
        ),
        (
            "held on GPU",
            f"{fmt.num(s.resident_tokens.gpu_held)} tokens until {fmt.clock(s.held_until)}",
        ),
        (
            "resident host",
            f"{fmt.num(s.resident_tokens.host)} tokens · {fmt.size(s.resident_bytes.host)}",
        ),
        ("gone", f"{fmt.num(s.resident_tokens.gone)} tokens"),
        ("idle", fmt.seconds(s.idle_s)),
        ("turns", str(s.turns)),
        ("tool", f"{fmt.text(s.tool_class)} · expected wait {fmt.seconds(s.expected_wait_s)}"),
        ("decision", fmt.text(s.decision)),
        ("reason", fmt.text(s.reason)),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def turns_table(detail: SessionDetail) -> RenderableType:
    if not detail.turns:
        return Text("no turns recorded", style="dim")
    table = Table(box=None, padding=(0, 1), collapse_padding=True, header_style="bold")
    # The turn id gives way first on a narrow screen (cut with an ellipsis).
    table.add_column("turn", no_wrap=False, min_width=8)
    for name, justify in (
        ("started", "left"),
        ("worker", "left"),
        ("prompt", "right"),
        ("cached", "right"),
        ("output", "right"),
        ("TTFT", "right"),
        ("e2e", "right"),
        ("cost", "right"),
        ("outcome", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for t in detail.turns:
        table.add_row(
            Text(t.turn_id, no_wrap=True, overflow="ellipsis"),
            fmt.clock(t.started_at),
            fmt.text(t.worker),
            fmt.num(t.prompt_tokens),
            fmt.num(t.cached_tokens),
            fmt.num(t.output_tokens),
            fmt.seconds(t.ttft_s),
            fmt.seconds(t.e2e_s),
            fmt.money(t.cost),
            fmt.text(t.outcome),
        )
    return table


def residency_table(residency: list[SessionResidency]) -> RenderableType:
    if not residency:
        return Text("no worker holds a prefix of this session", style="dim")
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("worker", no_wrap=True)
    table.add_column("tier", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("held until", no_wrap=True)
    for r in residency:
        until = fmt.clock(r.held_until) if r.tier == "gpu_held" else ""
        table.add_row(r.worker, r.tier, fmt.num(r.tokens), fmt.size(r.bytes), until)
    return table


class SessionDetailScreen(StateScreen):
    TAB = "sessions"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace", "back", "Back"),
        Binding("x", "release", "Release KV"),
        Binding("t", "turns", "Reload turns"),
    ]

    def __init__(self, session_id: str, tenant: str | None = None) -> None:
        super().__init__()
        self.session_id = session_id
        self.tenant = tenant
        """None: the one tenant that has a session of this id."""
        self.session: SessionStateView | None = None
        self._read_at: TiersView | None = None
        """The session's figures the residency table was read with."""

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="detail"):
            yield Static(Text(f"Session {self.session_id}", style="bold"), classes="section")
            yield Static(id="fields")
            yield Static("Residency", classes="section")
            yield Static(Text("loading …", style="dim"), id="residency")
            yield Static("Turns", classes="section")
            yield Static(Text("loading …", style="dim"), id="turns")

    def on_mount(self) -> None:
        self.load_turns()

    def update_body(self, state: AdminStateView) -> None:
        found = next(
            (
                s
                for s in state.sessions
                if s.id == self.session_id and self.tenant in (None, s.tenant)
            ),
            None,
        )
        self.session = found
        fields = self.query_one("#fields", Static)
        if found is None:
            fields.update(
                Text("This session is no longer in the appliance's state.", style="yellow")
            )
            return
        task_status = {t.id: t.status for t in state.tasks}
        fields.update(session_fields(found, task_status))
        if self._read_at is not None and found.resident_tokens != self._read_at:
            self._read_at = None  # read once more, until the answer is in
            self.load_residency()

    def session_released(self, session_id: str) -> None:
        if session_id == self.session_id:
            self.load_turns()

    def _read(self, detail: SessionDetail | None) -> None:
        """The residency was read (None: could not be): with the figures it says, else
        with the snapshot's."""
        shown = self.session.resident_tokens if self.session is not None else TiersView()
        said = detail.session if detail is not None else None
        self._read_at = said.resident_tokens if said else shown

    @work(exclusive=True, group="residency")
    async def load_residency(self) -> None:
        """The residency again (with the fewest turns the route gives)."""
        try:
            detail = await self.console.client.session_detail(self.session_id, self.tenant, 1)
        except ConsoleError:
            self._read(None)
            return
        self._read(detail)
        self.query_one("#residency", Static).update(residency_table(detail.residency))

    @work(exclusive=True, group="turns")
    async def load_turns(self) -> None:
        target = self.query_one("#turns", Static)
        residency = self.query_one("#residency", Static)
        try:
            detail = await self.console.client.session_detail(self.session_id, self.tenant)
        except ConsoleError as exc:
            self._read(None)
            residency.update(Text("-", style="dim"))
            lines = [
                Text("The appliance did not give this session's turns:", style="dim"),
                Text(exc.message, style="yellow"),
            ]
            if exc.status == 404:
                lines.append(
                    Text(
                        "(it has no GET /admin/v1/sessions/{id} route, or the session is gone)",
                        style="dim",
                    )
                )
            target.update(Group(*lines))
            return
        self._read(detail)
        residency.update(residency_table(detail.residency))
        target.update(turns_table(detail))

    def action_back(self) -> None:
        self.dismiss()

    def action_turns(self) -> None:
        self.load_turns()

    def action_release(self) -> None:
        if self.session is not None:
            confirm_release(self, self.session)
