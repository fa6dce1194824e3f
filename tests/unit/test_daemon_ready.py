"""systemd hears READY=1 once every worker came up, counting one the worker reaper already
put to rest: a worker that sleeps before a slower one has started must not hold the
service in `activating` until systemd gives up on it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from appliance.domain.worker import WorkerState
from appliance.start.daemon import _ready
from appliance.start.sdnotify import Notifier


def ready_within(timeout_s: float, *states: WorkerState) -> bool:
    engines = SimpleNamespace(workers=[SimpleNamespace(state=s, draining=False) for s in states])
    ledger = SimpleNamespace(failing=None)

    async def attempt() -> bool:
        try:
            await asyncio.wait_for(_ready(engines, ledger, Notifier(None), "u"), timeout_s)  # type: ignore[arg-type]
        except TimeoutError:
            return False
        return True

    return asyncio.run(attempt())


@pytest.mark.parametrize(
    ("states", "ready"),
    [
        ((WorkerState.HEALTHY, WorkerState.HEALTHY), True),
        ((WorkerState.ASLEEP, WorkerState.HEALTHY), True),
        ((WorkerState.STOPPED, WorkerState.WAKING), True),
        ((WorkerState.ASLEEP, WorkerState.STARTING), False),
        ((WorkerState.HEALTHY, WorkerState.UNHEALTHY), False),
    ],
)
def test_ready_once_every_worker_came_up_or_rests(
    states: tuple[WorkerState, ...], ready: bool
) -> None:
    assert ready_within(0.3, *states) is ready
