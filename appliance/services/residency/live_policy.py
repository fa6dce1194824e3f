"""A residency policy (`appliance.policy.residency`) as the live loop (`reaper_loop.py`) drives
it: through the protocol (`decide`, `priority`), and the optional parts only where the policy
has them, as the replay does (`appliance.replay.kv_residency.residency`):

- `revisits_holds`: a HOLD's `until_s` is when to decide again (the reaper, mori), not when
  the hold ends (ttl-pin: its pin lapses then, and the loop sends it until then exactly);
- `observe_return` / `observe_abandoned`: a policy that learns (the reaper's wait model,
  mori's idleness) hears how each idle period ended, exactly once;
- `tuning.max_residency_s`: how long a session is followed idle before it ends unreturned
  (else `FOLLOW_S`, the settings' default); `tuning.pressure_from`: from which HBM usage a
  hold's room has a value (`hbm_value`, asked only of a policy that revisits its holds);
  `tuning.tenant_cap_bytes`: whether the policy caps a tenant's held bytes (only then does
  the loop add up what the tenant holds, `tenant_held_bytes`);
- `survival`: the wait model restore on lead time asks the return times of (the reaper's).

`LiveHolds`: the holds the loop has sent, and what the policy makes of them: each one's
priority, the value of a worker's room (the lowest priority among its other holds) and a
tenant's held bytes there, its own hold not counted (the bytes of its other sessions the
loop last asked that worker to hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from appliance.domain.records import WorkerId
from appliance.policy.residency import HeldSession, IdleSession, ResidencyPolicy
from appliance.services.residency.prefix_watch import WaitingSession

FOLLOW_S = 1800.0
"""Seconds a session is followed idle under a policy with no maximum residency of its own
(`residency.max_residency_s`'s default)."""


class LivePolicy:
    """`policy` with its optional parts looked up once (see the module)."""

    def __init__(self, policy: ResidencyPolicy) -> None:
        self.policy = policy
        tuning = getattr(policy, "tuning", None)
        self.revisits = bool(getattr(policy, "revisits_holds", False))
        self.max_idle_s: float = getattr(tuning, "max_residency_s", None) or FOLLOW_S
        self.own_max_idle = getattr(tuning, "max_residency_s", None) is not None
        """Whether the policy itself ends a session past `max_idle_s` (a decision of its
        kind `max_residency`); else the loop ends it without asking."""
        self.pressure_from: float = getattr(tuning, "pressure_from", 0.0)
        self.capped = getattr(tuning, "tenant_cap_bytes", None) is not None
        self.survival: Any = getattr(policy, "survival", None)

    def observe_return(self, key: str, now: float) -> None:
        observe = getattr(self.policy, "observe_return", None)
        if observe is not None:
            observe(key, now)

    def observe_abandoned(self, key: str, now: float) -> None:
        observe = getattr(self.policy, "observe_abandoned", None)
        if observe is not None:
            observe(key, now)


class LiveHolds:
    """The sessions the loop has asked a worker to hold (`on`: key -> worker), among the
    waiting sessions it follows (`waiting`), and what the policy makes of them."""

    def __init__(self, policy: LivePolicy, waiting: Mapping[str, WaitingSession]) -> None:
        self._policy = policy
        self._waiting = waiting
        self.on: dict[str, WorkerId] = {}

    def seen_from(self, worker: WorkerId, key: str, idle: IdleSession, now: float) -> IdleSession:
        """`idle` with what the other holds on its worker make of it: the value of the room
        a hold takes (`hbm_value`) and its tenant's held bytes (`tenant_held_bytes`)."""
        return replace(
            idle,
            hbm_value=self.hbm_value(worker, key, idle.kv_usage, now),
            tenant_held_bytes=self.tenant_held_bytes(worker, key, idle.tenant),
        )

    def hbm_value(self, worker: WorkerId, key: str, usage: float, now: float) -> float | None:
        """The value of the space a hold takes: the lowest priority among the worker's other
        holds (None: under the policy's `pressure_from`, none there, or a policy that does
        not revisit its holds and so does not weigh it)."""
        if not self._policy.revisits or usage < self._policy.pressure_from:
            return None
        values = [self.priority(k, w, now) for k, w in self.held_on(worker) if k != key]
        return min(values) if values else None

    def tenant_held_bytes(self, worker: WorkerId, key: str, tenant: str) -> int:
        """Bytes the tenant's other sessions hold on the worker (0 unless the policy caps
        tenants: the sum costs a pass over the worker's holds)."""
        if not self._policy.capped:
            return 0
        return sum(
            w.idle.kv_bytes or 0
            for k, w in self.held_on(worker)
            if k != key and w.session.tenant == tenant
        )

    def held_on(self, worker: WorkerId) -> list[tuple[str, WaitingSession]]:
        return [
            (k, w)
            for k, on in self.on.items()
            if on == worker and (w := self._waiting.get(k)) is not None
        ]

    def priority(self, key: str, w: WaitingSession, now: float) -> float:
        held = HeldSession(key, w.idle.resident_tokens, w.idle.finished_at_s, w.due_s)
        return self._policy.policy.priority(held, now)

    def priorities(self, now: float) -> dict[WorkerId, dict[str, float]]:
        """Each worker's holds, by key, with their priorities now."""
        by_worker: dict[WorkerId, dict[str, float]] = {}
        for key, worker in self.on.items():
            w = self._waiting.get(key)
            if w is not None:
                by_worker.setdefault(worker, {})[key] = self.priority(key, w, now)
        return by_worker
