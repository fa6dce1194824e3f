"""Overview: GPUs with HBM bars, workers, and the summary of sessions, tasks and admission."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from appliance.api.admin.schemas import AdminStateView
from tui.screens.base import StateScreen
from tui.widgets.panels import GpuPanel, SummaryPanel, WorkersPanel


class OverviewScreen(StateScreen):
    TAB = "overview"

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="overview"):
            yield Static("GPUs", classes="section")
            yield GpuPanel(id="gpus")
            yield Static("Workers", classes="section")
            yield WorkersPanel(id="workers")
            yield Static("Appliance", classes="section")
            yield SummaryPanel(id="summary")

    def update_body(self, state: AdminStateView) -> None:
        for panel in (GpuPanel, WorkersPanel, SummaryPanel):
            self.query_one(panel).update_state(state)
