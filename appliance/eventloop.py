"""The event loop every long-running appliance process runs on: uvloop where it is
installed (a dependency on Linux and macOS), else asyncio's own. uvicorn only picks uvloop
when it creates the loop itself; the appliance creates its loops, so it asks here."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the loop above."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
