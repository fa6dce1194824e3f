"""Where an agent turn runs: filters -> weighted scorers -> picker.

Model of the world. A turn re-sends its session's growing prefix. On the worker that still
holds that prefix in its KV cache only the appended tokens are prefilled; anywhere else the
whole prompt is. So each candidate worker is judged by the time the turn would wait for its
first token there: queue wait (prefill work already routed there and not yet started) plus
the prefill it would do (fresh tokens over the resident prefix), in the cost model's
seconds times the worker's measured slowdown (a worker slower than the GPU profile takes
longer for the same tokens). Scores are those seconds normalised by one scale per decision
(the larger of the turn's cold prefill on the slowest worker and the longest queue), so with
equal weights the picker would minimise the turn's own estimated time to first token:
  reuse  = prefill seconds saved against that slowest cold prefill / scale
           (with workers alike: what the resident prefix saves)
  queue  = 1 - queue wait / scale
The default weighs reuse twice: a turn moved off its prefix prefills it again, and every
turn queued behind it at the new worker waits for that prefill too (and the prefix now
takes KV on two workers). Judged by its own wait alone, a move pays off on any queue
difference larger than the prefill; under load, when both workers' queues are long and
noisy, such moves re-prefill whole sessions for a few percent and make the busy worker
busier (measured: benchmarks/router_overhead.py at 200 sessions). So a session stays on its
worker until that worker's queue costs more than twice the saving (then it moves, and the
decision says why). Three smaller scorers
break ties and guard known failure modes: kv_pressure (prefer room, so a move does not evict
someone else's hot prefix), affinity (the session's last worker, bounded: worth nothing once
that worker carries more than `max_share` of all queued work, so heavy sessions cannot pin
a hot spot), failures (recent errors). A stale index only costs a miss: the engine reports
the cached tokens it really found, and the ledger keeps predicted beside actual.
Policies are pure: no clock, no I/O; the caller passes every reading in.
"""

from appliance.policy.routing.core import (
    Candidate,
    PrefillCost,
    RouteDecision,
    RouteKind,
    RouteRequest,
    RoutingProfile,
    WorkerView,
    route,
)

__all__ = [
    "Candidate",
    "PrefillCost",
    "RouteDecision",
    "RouteKind",
    "RouteRequest",
    "RoutingProfile",
    "WorkerView",
    "route",
]
