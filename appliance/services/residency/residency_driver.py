"""One residency policy driven through its protocol: the same code in the replay
(`appliance.replay.kv_residency.residency`, over the simulated engines' pins) and on the live box
(`reaper_loop.py`, over the workers' retention connectors).

What the driver owns, and nothing else does:

- the standing decision of each waiting session (`StandingDecision`: the session as the policy last
  decided on it, and that decision), kept once: the policy reads it back from the driver
  (`IdleSession.standing` when asked again about the same idle period, `HeldSession.idle`
  when it ranks a hold) and keeps no record of its own;
- each idle period's end, told exactly once to a policy that learns (`observe_return`,
  `observe_abandoned`: the reaper's wait model, MORI's idleness);
- the policy's optional parts, looked up once: `revisits_holds` (a HOLD's `until_s` is when
  to decide again, not when the hold ends), `tuning.max_residency_s`,
  `tuning.pressure_from` (from which HBM usage a hold's room has a value),
  `tuning.tenant_cap_bytes` (only then are a tenant's held bytes added up), `survival` (the
  wait model restore on lead time asks), `host_priority` (the host tier's order);
- what the other holds on a worker make of a session: the value of the room a hold takes
  (`hbm_value`: the lowest priority among them) and its tenant's held bytes there;
- a `bound` with the last word on a decision (a branch's quota), and the decisions counted
  by reason, kind, action and tool class.

Its caller says where the inputs come from (the engine and the latency model, or the KV
index and the retention reports) and carries the decisions out (pins, or directives).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyDecision,
    ResidencyPolicy,
)

DecisionBound = Callable[[IdleSession, ResidencyDecision], ResidencyDecision]
"""The last word on a decision (e.g. a branch's quota)."""
NO_TOOL = "(none)"
"""`by_tool`'s class for a turn without a hint of one."""
_NUMBERS = re.compile(r"\d[\d.,]*")


@dataclass(slots=True)
class StandingDecision:
    """A waiting session's standing decision, and the session as it was taken on."""

    idle: IdleSession
    decision: ResidencyDecision


class ResidencyDriver:
    """`policy` through its protocol, its optional parts where it has them (see the module)."""

    def __init__(self, policy: ResidencyPolicy, *, bound: DecisionBound | None = None) -> None:
        self.policy = policy
        self.bound = bound
        tuning = getattr(policy, "tuning", None)
        self.revisits = bool(getattr(policy, "revisits_holds", False))
        self.max_idle_s: float | None = getattr(tuning, "max_residency_s", None)
        """The policy's own maximum residency (None: it has none; its caller picks one)."""
        self.pressure_from: float = getattr(tuning, "pressure_from", 0.0)
        self.capped = getattr(tuning, "tenant_cap_bytes", None) is not None
        self.survival: Any = getattr(policy, "survival", None)
        self.host_ranked = getattr(policy, "host_priority", None) is not None
        self._observe_return = getattr(policy, "observe_return", None)
        self._observe_abandoned = getattr(policy, "observe_abandoned", None)
        self._standing: dict[str, StandingDecision] = {}
        self.reasons: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.by_tool: Counter[tuple[str, str]] = Counter()
        """(tool class, action) -> decisions, revisits included."""

    def decide(self, idle: IdleSession, now: float) -> StandingDecision:
        """The policy's decision on `idle` (the bound's, where it overrules), now the
        session's standing one; asked again within the same idle period, the policy is
        told the standing decision."""
        prior = self._standing.get(idle.session_id)
        if prior is not None and prior.idle.finished_at_s == idle.finished_at_s:
            idle = replace(idle, standing=prior.decision.action)
        decision = self.policy.decide(idle, now)
        if self.bound is not None:
            decision = self.bound(idle, decision)
        self.reasons[_NUMBERS.sub("N", decision.reason)] += 1
        self.actions[decision.action.value] += 1
        self.kinds[decision.kind.value if decision.kind else "unknown"] += 1
        self.by_tool[(idle.tool_class or NO_TOOL, decision.action.value)] += 1
        standing = self._standing[idle.session_id] = StandingDecision(idle, decision)
        return standing

    def standing(self, session_id: str) -> StandingDecision | None:
        """The standing decision of a session whose idle period is open (None: none)."""
        return self._standing.get(session_id)

    def returned(self, session_id: str, now: float) -> bool:
        """The session's next turn arrived: its idle period, if one is open, ends in a
        return (the policy hears of it). Whether one was open."""
        standing = self._standing.pop(session_id, None)
        if standing is None:
            return False
        if self._observe_return is not None:
            self._observe_return(standing.idle, now)
        return True

    def abandoned(self, session_id: str, now: float) -> bool:
        """The session's open idle period ends without a return (its task closed, past the
        maximum residency, no longer followed). Whether one was open."""
        standing = self._standing.pop(session_id, None)
        if standing is None:
            return False
        if self._observe_abandoned is not None:
            self._observe_abandoned(standing.idle, now)
        return True

    def held(self, session_id: str, tokens: int, since_s: float, until_s: float) -> HeldSession:
        """A hold as the policy ranks it, with the session it was decided on."""
        standing = self._standing.get(session_id)
        idle = standing.idle if standing is not None else None
        return HeldSession(session_id, tokens, since_s, until_s, idle)

    def priority(self, held: HeldSession, now: float) -> float:
        return self.policy.priority(held, now)

    def host_priority(self, held: HeldSession, now: float) -> float:
        """The host tier's order, for a policy that has one (`host_ranked`)."""
        return float(self.policy.host_priority(held, now))  # type: ignore[attr-defined]

    def hbm_value(self, kv_usage: float, others: Callable[[], Iterable[float]]) -> float | None:
        """What the room a hold takes is worth: the lowest of `others` (the priorities of the
        worker's other holds: the first a hold would push out). None: no other holds, a pool
        under the policy's `pressure_from`, where room costs nothing, or a policy that does
        not revisit its holds and so does not weigh it (`others` is then not asked)."""
        if not self.revisits or kv_usage < self.pressure_from:
            return None
        return min(others(), default=None)

    def tenant_held_bytes(
        self, idle: IdleSession, holds: Callable[[], Iterable[tuple[str, int]]]
    ) -> int:
        """Bytes the session's tenant holds among `holds` ((session, bytes) of a worker's
        holds), its own not counted: 0 unless the policy caps tenants (`holds` is then not
        asked: the sum costs a pass over them)."""
        if not self.capped:
            return 0
        return sum(
            nbytes
            for owner, nbytes in holds()
            if owner != idle.session_id and self._tenant_of(owner) == idle.tenant
        )

    def _tenant_of(self, session_id: str) -> str | None:
        standing = self._standing.get(session_id)
        return standing.idle.tenant if standing is not None else None
