"""Releasing a session's KV from the console: asked first, from the Sessions table or a
session's detail."""

from __future__ import annotations

from tui import format as fmt
from tui.screens.base import StateScreen
from tui.screens.dialogs import ConfirmScreen
from tui.state import SessionState


def confirm_release(screen: StateScreen, session: SessionState) -> None:
    """Ask, then release: the app sends the request and shows the appliance's answer."""
    question = (
        f"Release the KV cache held by session {session.id} "
        f"(tenant {session.tenant}, {fmt.tokens(session.resident_tokens.gpu)} tokens / "
        f"{fmt.size(session.resident_bytes.gpu)} on GPU)?\n\n"
        "Its next turn will prefill its context again."
    )

    def answered(yes: bool | None) -> None:
        if yes:
            screen.console.release_session(session.id, session.tenant)

    screen.app.push_screen(ConfirmScreen(question, confirm="Release"), answered)
