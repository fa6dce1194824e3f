"""How long a replay of recorded sessions runs and what of it counts (`session_loop.py`
runs it): the window, the sessions one pass starts, and when a capacity step's p95 is sure
to miss its target."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.domain.percentile import percentile_rank
from appliance.workload.agent_traces import AgentSessionTrace

PASS_STARTS_PER_USER = 2
"""The fewest session starts per user in one pass (see the module). 2 keeps the recorded
sessions here (471) one pass of the list up to 235 users, past every capacity measured."""


@dataclass(frozen=True, slots=True)
class RunWindow:
    """How long a run lasts and what of it counts, in virtual seconds."""

    duration_s: float = math.inf
    """inf: until every recorded session has started once (one pass over the list)."""
    warmup_s: float = 600.0
    give_up_over_p95_s: float | None = None
    """A capacity step's SLO: in one pass, the window ends as soon as so many counted turns
    took longer than this that the p95 is over it whatever follows (the pass can count no
    more turns than the sessions hold). None: the run goes on."""

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(
                f"the warm-up ({self.warmup_s:g} s) must be shorter than the run "
                f"({self.duration_s:g} s)"
            )


def misses_over_p95(sessions: Sequence[AgentSessionTrace], starts: int, max_model_len: int) -> int:
    """Turns over a p95 target that put the p95 over it at any count up to every turn the
    first `starts` sessions of the cycled list can send (the p95 of n is the value at
    `percentile_rank(0.95, n)`, the rank `nearest_rank` takes)."""
    per_session = [_turns_that_fit(s, max_model_len) for s in sessions]
    n = sum(per_session[i % len(sessions)] for i in range(starts)) if sessions else 0
    return n - percentile_rank(0.95, n)


def _turns_that_fit(session: AgentSessionTrace, max_model_len: int) -> int:
    """The session's requests that fit the window, its sub-agents' included."""
    requests = list(session.own_requests())
    requests += [r for g in session.subagent_steps() for a in g.agents for r in a.requests]
    return sum(r.fits(max_model_len) for r in requests)
