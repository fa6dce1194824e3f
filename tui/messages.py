"""Messages of the console: the poll worker posts them to the app; widgets post theirs up.

A newer snapshot supersedes an older one still in the queue (`can_replace`), so a console
that falls behind skips to the latest state instead of drawing every stale one.
"""

from __future__ import annotations

from textual.message import Message

from appliance.api.admin.schemas import AdminStateView
from tui.client import Lost


class StateUpdated(Message):
    """A fresh snapshot of the appliance."""

    def __init__(self, state: AdminStateView) -> None:
        super().__init__()
        self.state = state

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StateUpdated)


class ConnectionLost(Message):
    """The appliance did not answer; the poll worker keeps retrying."""

    def __init__(self, lost: Lost) -> None:
        super().__init__()
        self.lost = lost

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ConnectionLost)


class ConnectionRestored(Message):
    """The appliance answers again after an outage."""


class ReleaseFinished(Message):
    """The appliance's answer to a release: `ok`, and the words to show."""

    def __init__(self, session_id: str, ok: bool, text: str) -> None:
        super().__init__()
        self.session_id = session_id
        self.ok = ok
        self.text = text
