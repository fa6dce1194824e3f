"""Releasing a session's KV from the console: asked first, from the Sessions table or a
session's detail. The dialog's figure is the snapshot's (the session's prefix on a GPU, the
KV index's), the one the appliance's answer reports too."""

from __future__ import annotations

from appliance.api.admin.schemas import SessionStateView
from tui import format as fmt
from tui.screens.base import StateScreen
from tui.screens.dialogs import ConfirmScreen


def confirm_release(screen: StateScreen, session: SessionStateView) -> None:
    """Ask, then release: the app sends the request and shows the appliance's answer."""
    tiers = session.resident_tokens
    held = (
        f", {fmt.num(tiers.gpu_held)} of them held until {fmt.clock(session.held_until)}"
        if tiers.gpu_held
        else ""
    )
    question = (
        f"Release the KV cache held by session {session.id} "
        f"(tenant {session.tenant}, {fmt.num(tiers.gpu)} tokens / "
        f"{fmt.size(session.resident_bytes.gpu)} on GPU{held})?\n\n"
        "Its next turn will prefill its context again."
    )

    def answered(yes: bool | None) -> None:
        if yes:
            screen.console.release_session(session.id, session.tenant)

    screen.app.push_screen(ConfirmScreen(question, confirm="Release"), answered)
