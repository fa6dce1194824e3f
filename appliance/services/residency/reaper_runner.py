"""The idle reaper's life on the event loop: its tick every `tick_s`, its directives sent in
order, and the workers' give-backs read as they come, until cancelled. What each of those
does is `reaper_loop.ReaperLoop`'s; this module only drives it."""

from __future__ import annotations

import asyncio
import logging

from appliance.services.residency.reaper_loop import ReaperLoop

log = logging.getLogger(__name__)


async def run_reaper(loop: ReaperLoop) -> None:
    """Ticks, sends and reads the workers' give-backs until cancelled."""
    log.info("idle reaper: %s", loop.note)
    async with asyncio.TaskGroup() as group:
        group.create_task(loop.outbox.run())
        group.create_task(_returns(loop))
        while True:
            try:
                loop.tick(loop.clock.now())
            except Exception:
                log.exception("idle reaper: a tick failed")
            await asyncio.sleep(loop.tick_s)


async def _returns(loop: ReaperLoop) -> None:
    async for r in loop.retention.returned():
        try:
            loop.returned(r, loop.clock.now())
        except Exception:
            log.exception("idle reaper: a give-back could not be recorded")
