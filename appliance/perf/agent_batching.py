"""The scheduler settings the appliance gives the vLLM workers it starts, for agent turns.

An agent's turn appends a little to a long cached prefix, so most prefills are short, but a
first turn or a miss computes 100k tokens or more. Under vLLM's defaults on an H200 (8192
tokens a step, no cap per request) such a prefill takes the whole budget of every step it
runs in, and each short turn that reaches its worker meanwhile waits for all of it. With
these, vLLM cuts a long prefill to `AGENT_PREFILL_CAP_TOKENS` tokens a step while others
run or wait, and the rest of a larger step goes to them. Measured on the recorded Claude
Code sessions (docs/benchmarks.md): TTFT p95 at 160 users on eight simulated H200s 1.72 ->
1.41 s. The cap is a quarter of the step, not the best of the caps tried (3584 to 8192
tokens gave 1.36 to 1.51 s, in no order: the spread of one run's p95). Where the workers
load the appliance's scheduler (engines/scheduling/: one prompt a step, the shortest first)
the cap is never applied; it stands where they do not.
"""

from __future__ import annotations

from typing import Final

AGENT_BATCH_TOKENS = 16384
"""vLLM's --max-num-batched-tokens (its default on an H200: 8192)."""
AGENT_PREFILL_CAP_TOKENS = 4096
"""vLLM's --long-prefill-token-threshold (its default: 0, no cap)."""
AGENT_SCHEDULING_POLICY: Final = "priority"
"""vLLM's --scheduling-policy (its default: fcfs): each turn carries the priority admission
grants it, its tenant's ceiling applied, then the shortest estimated prefill
(`policy/routing/turn_order.py`); turns of equal rank run in arrival order, as under fcfs."""
