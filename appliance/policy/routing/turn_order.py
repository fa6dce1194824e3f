"""The order a worker takes its waiting turns in: the priority each turn goes to vLLM with.

The workers the appliance starts run vLLM's priority scheduling (`--scheduling-policy
priority`: the lowest value leaves the waiting queue first, then the earliest arrival).
A turn's value orders by the priority admission granted it first (the higher, the sooner),
and among turns of one granted priority by the prefill the router estimated for it on its
worker, in steps of `PREFILL_STEP_S`: the shortest prefill first.

Why: an agent turn mostly appends a few thousand tokens to a cached prefix, but a first turn
or a miss prefills 100k tokens or more, and its time to first token is seconds whatever the
order. When turns queue on a worker, running the short ones first saves each of them the
long prefill's wait and costs the long one only the short ones' time. Measured on the
recorded Claude Code sessions (docs/benchmarks.md): near the box's capacity (193 users,
8 simulated H200s) TTFT p95 2.03 -> 1.89 s, and the sessions served at p95 <= 2 s 187 ->
199; at 149 users, where queues are short, 1.41 -> 1.39 s. vLLM moves a turn out of the
waiting queue in this order and preempts the largest value first when KV runs out; a turn
already running keeps its share of each step (the long prefill cap,
`perf/agent_batching.py`), so no turn starves while its worker has room.
"""

from __future__ import annotations

PREFILL_STEP_S = 0.1
"""Estimated prefill seconds one rank apart: coarse enough that turns whose prefills differ
by less keep their arrival order (the estimate's own error is of that order)."""
PREFILL_RANKS = 1000
"""Ranks within one granted priority (a prefill of 100 s or more takes the last), so any
granted priority outranks every prefill rank."""


def turn_priority(granted: int, prefill_s: float) -> int:
    """vLLM's `priority` for a turn admission granted `granted` (higher: sooner) whose
    estimated prefill on its worker is `prefill_s` seconds."""
    rank = min(int(max(prefill_s, 0.0) / PREFILL_STEP_S), PREFILL_RANKS - 1)
    return -granted * PREFILL_RANKS + rank
