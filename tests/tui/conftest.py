"""Fixtures of the console's tests: a fake appliance on a real local port, and a console
pointed at it that polls fast and retries fast, so the tests stay quick."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from textual.app import App
from textual.pilot import Pilot

from tests.tui.fakes import ADMIN_KEY, FakeAppliance, make_state
from tui.app import ConsoleApp
from tui.client import Backoff, Poller, StateClient

FAST_S = 0.05


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (marked `anyio`) run on asyncio, Textual's loop."""
    return "asyncio"


@pytest.fixture
def fake() -> Iterator[FakeAppliance]:
    appliance = FakeAppliance(make_state()).up()
    yield appliance
    appliance.down()


def console(
    url: str, *, key: str = ADMIN_KEY, interval_s: float = 0.2, label: str = "fake"
) -> ConsoleApp:
    client = StateClient(url, key, timeout_s=2.0)
    poller = Poller(client, interval_s=interval_s, backoff=Backoff(first_s=FAST_S, max_s=0.2))
    return ConsoleApp(client, label=label, poller=poller)


def screen_text(app: App[object]) -> str:
    """What the terminal shows, as plain text (one line per row)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)


async def wait_until(
    pilot: Pilot[object], check: Callable[[], object], timeout_s: float = 5.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what or check}; screen:\n{screen_text(pilot.app)}"
            )
        await pilot.pause(0.02)


async def until_text(pilot: Pilot[object], text: str, timeout_s: float = 5.0) -> None:
    await wait_until(pilot, lambda: text in screen_text(pilot.app), timeout_s, repr(text))
