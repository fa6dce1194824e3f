"""What a set of recorded agent sessions holds (`agent_traces.py`), as the folder's
`stats.json` counts it: the replay's report states it beside its figures."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from appliance.workload.agent_traces import AgentSessionTrace


def sessions_summary(sessions: Sequence[AgentSessionTrace]) -> dict[str, object]:
    """Counts, stop reasons and input percentiles. "requests", "stops" and the percentiles
    are over the sessions' own requests, as the folder's stats.json counts them; sub-agents'
    are counted apart. A percentile is a lower rank, as stats.json's: the value at index
    floor(p * (n - 1)) of the sorted inputs."""
    own = [r for s in sessions for r in s.own_requests()]
    steps = [g for s in sessions for g in s.subagent_steps()]
    agents = [a for g in steps for a in g.agents]
    inputs = sorted(r.input_tokens for r in own)
    return {
        "sessions": len(sessions),
        "requests": len(own),
        "subagent_steps": len(steps),
        "subagent_entries": len(agents),
        "subagent_requests": sum(len(a.requests) for a in agents),
        "sessions_with_subagents": sum(1 for s in sessions if s.subagent_steps()),
        "tool_use_requests": sum(1 for r in own if r.ends_in_tool_call),
        "stops": dict(Counter(r.stop or "none" for r in own)),
        "input_tokens_p50": _lower_rank(inputs, 0.5),
        "input_tokens_p90": _lower_rank(inputs, 0.9),
        "max_input_tokens": max((s.max_input_tokens for s in sessions), default=0),
    }


def _lower_rank(ordered: Sequence[int], p: float) -> int:
    return ordered[int(p * (len(ordered) - 1))] if ordered else 0
