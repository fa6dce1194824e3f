"""The clairvoyant bound on how many recorded agent sessions a box serves: residency
ordered by each session's true next return, restores from host memory free.

Model of the world: the session loop tells, at each turn's end, when the session truly
comes back (its recorded think time; `SessionLoop(clairvoyant=True)`), which no client can
tell. Every waiting session is held on the GPU until then; under pressure the holds give
way furthest return first, and the host tier keeps the soonest returns (Belady's order over
HBM and host memory); a session with no next request keeps nothing. Its blocks come back
from host memory at no cost (the latency model's host-to-device copies take no time), and
it is routed by the appliance's router. No residency order meets the SLO with more
sessions: the capacity this replays is the bound every stack's is measured against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from appliance.domain.block_hash import shared_prefix
from appliance.domain.percentile import nearest_rank
from appliance.perf.latency import CopyCurve, LatencyModel
from appliance.policy.residency import (
    HeldSession,
    IdleSession,
    ResidencyAction,
    ResidencyDecision,
)
from appliance.replay.sessions.session_loop import TRACE_BLOCK_TOKENS, WARM_PREFIX_SHARE
from appliance.workload.agent_traces import AgentSessionTrace, TraceRequest, TraceSubagents

BOUND_ROUTING = "appliance"


@dataclass(slots=True)
class ClairvoyantResidency:
    """Hold every session until its true return; the furthest return gives way first."""

    name: str = "clairvoyant"
    returns: dict[str, float] = field(default_factory=dict)
    """Session -> when it comes back (absent: it does not)."""

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        wait = session.expected_wait_s  # the true one: `SessionLoop(clairvoyant=True)`
        if wait is None:
            self.returns.pop(session.session_id, None)
            return ResidencyDecision(ResidencyAction.EVICT, "does not come back")
        back = session.finished_at_s + wait
        self.returns[session.session_id] = back
        return ResidencyDecision(ResidencyAction.HOLD, "held until its return", until_s=back + 1.0)

    def priority(self, held: HeldSession, now: float) -> float:
        return -self.returns.get(held.session_id, math.inf)

    def host_priority(self, held: HeldSession, now: float) -> float:
        return self.priority(held, now)


def free_restores(latency: LatencyModel) -> LatencyModel:
    """`latency` with host-to-device copies that take no time."""
    return replace(latency, h2d=CopyCurve(((1, 0.0),), math.inf))


def session_ttft_floor(
    sessions: Sequence[AgentSessionTrace], latency: LatencyModel, max_model_len: int
) -> dict[str, float | None]:
    """The TTFT no stack beats, p50 / p95 / p99 over every request that fits the window:
    each request alone on an idle worker, the longest prefix it shares with its session's
    previous request cached (a session's first, the warm prefix: `session_loop.py`), and
    the share of requests that exceed 2 s even so (their own prefill)."""
    seconds: list[float] = []
    for session in sessions:
        warm = int(WARM_PREFIX_SHARE * (session.system_tokens + session.tool_tokens)) // 64
        runs = [[s for s in session.steps if isinstance(s, TraceRequest)]]
        runs += [
            list(a.requests)
            for s in session.steps
            if isinstance(s, TraceSubagents)
            for a in s.agents
        ]
        for requests in runs:
            previous: tuple[int, ...] | None = None
            for r in requests:
                if not r.fits(max_model_len):
                    continue
                shared = shared_prefix(previous, r.hash_ids) if previous is not None else warm
                cached = min(shared * TRACE_BLOCK_TOKENS, r.input_tokens - 1)
                seconds.append(latency.prefill_s(r.input_tokens - cached, cached))
                previous = r.hash_ids
    n = len(seconds)

    def at(p: float) -> float | None:
        value = nearest_rank(seconds, p)
        return None if value is None else round(value, 4)

    over = sum(1 for s in seconds if s > 2.0) / n if n else None
    return {"p50_s": at(0.5), "p95_s": at(0.95), "p99_s": at(0.99), "over_2s_share": over}
