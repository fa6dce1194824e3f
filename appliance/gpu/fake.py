"""A probe with scripted readings: the GPU's twin for tests and the simulated engine."""

from __future__ import annotations

import time
from collections.abc import Sequence

from appliance.domain.gpu import GpuReading, GpuSnapshot
from appliance.gpu.host import read_host


class FakeProbe:
    """Returns the scripted ticks in order, then keeps returning the last one."""

    def __init__(self, ticks: Sequence[Sequence[GpuReading]], driver: str = "fake") -> None:
        if not ticks:
            raise ValueError("FakeProbe needs at least one scripted tick")
        self._ticks = [tuple(t) for t in ticks]
        self._driver = driver
        self._next = 0

    def snapshot(self) -> GpuSnapshot:
        gpus = self._ticks[min(self._next, len(self._ticks) - 1)]
        self._next += 1
        return GpuSnapshot(time.time(), self._driver, gpus, read_host(), None)

    def close(self) -> None:
        pass
