"""The holds the live reaper loop (`reaper_loop.py`) has sent, and what its residency policy
makes of them (through `residency_driver.ResidencyDriver`): each one's priority, the value
of a worker's room (the lowest priority among its other holds) and a tenant's held bytes
there, its own hold not counted (the bytes of its other sessions the loop last asked that
worker to hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from appliance.domain.records import WorkerId
from appliance.policy.residency import IdleSession
from appliance.services.residency.prefix_watch import WaitingSession
from appliance.services.residency.residency_driver import ResidencyDriver


class LiveHolds:
    """The sessions the loop has asked a worker to hold (`on`: key -> worker), among the
    waiting sessions it follows (`waiting`), and what the policy makes of them."""

    def __init__(self, driver: ResidencyDriver, waiting: Mapping[str, WaitingSession]) -> None:
        self._driver = driver
        self._waiting = waiting
        self.on: dict[str, WorkerId] = {}

    def seen_from(self, worker: WorkerId, key: str, idle: IdleSession, now: float) -> IdleSession:
        """`idle` with what the other holds on its worker make of it: the value of the room
        a hold takes (`hbm_value`) and its tenant's held bytes (`tenant_held_bytes`)."""
        return replace(
            idle,
            hbm_value=self.hbm_value(worker, key, idle.kv_usage, now),
            tenant_held_bytes=self.tenant_held_bytes(worker, idle),
        )

    def hbm_value(self, worker: WorkerId, key: str, usage: float, now: float) -> float | None:
        """The value of the space a hold takes (`ResidencyDriver.hbm_value`)."""
        return self._driver.hbm_value(
            usage,
            lambda: (self.priority(k, w, now) for k, w in self.held_on(worker) if k != key),
        )

    def tenant_held_bytes(self, worker: WorkerId, idle: IdleSession) -> int:
        """Bytes the tenant's other sessions hold on the worker."""
        return self._driver.tenant_held_bytes(
            idle, lambda: ((k, w.idle.kv_bytes or 0) for k, w in self.held_on(worker))
        )

    def held_on(self, worker: WorkerId) -> list[tuple[str, WaitingSession]]:
        return [
            (k, w)
            for k, on in self.on.items()
            if on == worker and (w := self._waiting.get(k)) is not None
        ]

    def priority(self, key: str, w: WaitingSession, now: float) -> float:
        held = self._driver.held(key, w.idle.resident_tokens, w.idle.finished_at_s, w.due_s)
        return self._driver.priority(held, now)

    def priorities(self, now: float) -> dict[WorkerId, dict[str, float]]:
        """Each worker's holds, by key, with their priorities now."""
        by_worker: dict[WorkerId, dict[str, float]] = {}
        for key, worker in self.on.items():
            w = self._waiting.get(key)
            if w is not None:
                by_worker.setdefault(worker, {})[key] = self.priority(key, w, now)
        return by_worker
