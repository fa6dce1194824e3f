"""A residency policy (`appliance.policy.residency`) driving the simulated engines' pins.

Model of the world: the engine asks once per finished request whether to hold its blocks
(`SimEngine(residency=...)`), and ranks standing pins when it must give some back early.
This adapter builds the policy's inputs from what the engine and the workload know: the
request's session, its cached tokens, the worker's KV usage, the seconds a prefill of those
tokens would take (the latency model), and, when the workload says so (`TurnHint`), whether
the turn ended in a tool call and how long the tool is expected to take. A trace carries
no hints, so a policy sees "unknown" there. HOLD becomes a pin until `until_s`; RELEASE
leaves the blocks to vLLM's LRU; DEMOTE copies them to the worker's host tier and frees
them on the GPU (the engine refuses it when the worker has no host tier: `--host-gib`);
EVICT frees them to the head of the GPU's eviction order. Decisions are counted by reason
(`reasons`) and by action (`actions`).

Host-tier eviction order: the host tier is LRU, as vLLM's, unless the policy has a
`host_priority(held: HeldSession, now) -> float` method, which then ranks the sessions
whose blocks the host tier holds, the lowest evicted first (`resident_tokens` their host
blocks, `held_since_s` their last use, `until_s` infinite).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    Residency,
    ResidencyPolicy,
)
from appliance.policy.residency_by_name import residency_policy
from appliance.sim.engine import AfterTurn, TurnEnd
from appliance.sim.host_tier import HostPriority, HostSession
from appliance.sim.latency import LatencyModel
from appliance.sim.prefix_cache import Pin

_NUMBERS = re.compile(r"\d[\d.,]*")


@dataclass(frozen=True, slots=True)
class TurnHint:
    """What the client said about a turn (`X-Tool-Class`, `X-Expected-Tool-Wait-S`)."""

    ends_in_tool_call: bool
    tool_class: str | None = None
    expected_wait_s: float | None = None


Hints = Callable[[str], TurnHint | None]
"""Request id -> its hint, if the workload has one."""


class PolicyResidency:
    """The engines' residency hook (`appliance.sim.engine.Residency`) for one policy."""

    def __init__(
        self,
        policy: ResidencyPolicy | str,
        *,
        latency: LatencyModel,
        block_size: int,
        hints: Hints | None = None,
    ) -> None:
        self.policy = residency_policy(policy) if isinstance(policy, str) else policy
        self.latency = latency
        self.block_size = block_size
        self.hints = hints
        self.reasons: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def host_priority(self) -> HostPriority | None:
        """The policy's order for the host tier, if it has one (else the tier is LRU)."""
        rank = getattr(self.policy, "host_priority", None)
        if rank is None:
            return None
        bs = self.block_size

        def priority(s: HostSession, now: float) -> float:
            owner = s.owner if s.owner is not None else ""
            held = HeldSession(owner, s.num_blocks * bs, s.last_used_s, math.inf)
            return float(rank(held, now))

        return priority

    def after_turn(self, end: TurnEnd) -> AfterTurn:
        req = end.request
        hint = self.hints(req.request_id) if self.hints is not None else None
        n = end.resident_tokens
        session = IdleSession(
            session_id=req.session_id if req.session_id is not None else req.request_id,
            resident_tokens=n,
            finished_at_s=end.now_s,
            ends_in_tool_call=hint.ends_in_tool_call if hint else None,
            tool_class=hint.tool_class if hint else None,
            expected_wait_s=hint.expected_wait_s if hint else None,
            recompute_s=self.latency.prefill_s(n) if n else 0.0,
            kv_usage=end.kv_usage,
        )
        decision = self.policy.decide(session, end.now_s)
        self.reasons[_NUMBERS.sub("N", decision.reason)] += 1
        self.actions[decision.action.value] += 1
        if decision.action is Residency.HOLD:
            return AfterTurn("hold", decision.until_s)
        if decision.action is Residency.DEMOTE:
            return AfterTurn("demote")
        if decision.action is Residency.EVICT:
            return AfterTurn("evict")
        return AfterTurn("release")

    def pin_priority(self, pin: Pin, now: float) -> float:
        held = HeldSession(
            pin.owner, pin.num_blocks * self.block_size, pin.pinned_at_s, pin.until_s
        )
        return self.policy.priority(held, now)
