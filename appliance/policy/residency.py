"""Residency: what happens to a session's KV blocks while it waits between turns, and in which
order held sessions give their blocks back.

Model of the world: when a turn finishes, its session goes idle (a tool runs, a person
types) and its prompt's KV blocks stay in HBM until something needs the room. A residency
policy answers two questions and nothing else:

1. `decide(session, now)`: for a session whose turn just finished, one of
   - RELEASE: the blocks become ordinary free blocks in the engine's own eviction order
     (vLLM: the free queue, least recently used first); they stay findable until evicted.
   - HOLD until `until_s`: the blocks are pinned, so no eviction takes them; at `until_s`
     the hold lapses and they become ordinary free blocks (RELEASE at that time).
   - DEMOTE: copy the blocks to a slower tier (host memory) and free HBM.
   - EVICT: the blocks go first in the eviction order (their session is not coming back).
2. `priority(held, now)`: the eviction order among HELD sessions, one number per session,
   lowest given back first (SGLang `mem_cache/evict_policy.py`: a strategy is one
   `get_priority(node)` method; the cache owns the heap). The mechanism consults it only
   when it must take back held blocks before their time (an allocation that would
   otherwise fail).

A held session never makes an allocation fail: the mechanism gives held blocks back, in
`priority` order, before the engine would preempt a running request or refuse to admit a
waiting one; and a session with a request in flight is protected by the mechanism whatever
a policy says (its blocks are the request's). Policies are pure: no clock (the caller
passes `now`), no I/O; a decision carries its `reason`.

The policies, each reproducing a system (cited in its docstring): `lru` (vLLM's prefix
cache as shipped) and `ttl-pin` (Continuum's time-to-live pin, with a fixed TTL). An idle
reaper that weighs the expected tool wait against the recompute cost and HBM pressure
plugs in here: `IdleSession` already carries those three figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

DEFAULT_PIN_TTL_S = 60.0
"""The TTL of `ttl-pin` when its name gives none (`ttl-pin:SECONDS` sets it)."""


class Residency(StrEnum):
    RELEASE = "release"
    HOLD = "hold"
    DEMOTE = "demote"
    EVICT = "evict"


@dataclass(frozen=True, slots=True)
class IdleSession:
    """A session whose turn has just finished, as the policy sees it."""

    session_id: str
    resident_tokens: int
    """Tokens of its KV the worker still holds (whole cached blocks)."""
    finished_at_s: float
    ends_in_tool_call: bool | None = None
    """Whether the turn ended in a tool call (the agent will be back): None when unknown
    (a trace without tool markers)."""
    tool_class: str | None = None
    expected_wait_s: float | None = None
    """The client's hint of how long it will be away (`X-Expected-Tool-Wait-S`)."""
    recompute_s: float | None = None
    """Seconds of prefill it would take to rebuild `resident_tokens` from scratch."""
    kv_usage: float = 0.0
    """Its worker's HBM pressure: share of KV blocks held by requests and holds, 0..1."""


@dataclass(frozen=True, slots=True)
class HeldSession:
    """A session whose blocks are held, as the eviction order sees it."""

    session_id: str
    resident_tokens: int
    held_since_s: float
    until_s: float
    """When the hold lapses on its own."""


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    action: Residency
    reason: str
    until_s: float | None = None
    """HOLD only: when the hold lapses."""

    def __post_init__(self) -> None:
        if (self.action is Residency.HOLD) != (self.until_s is not None):
            raise ValueError("a HOLD, and only a HOLD, carries until_s")


class ResidencyPolicy(Protocol):
    """A residency policy: one decision per finished turn, one priority per held session."""

    @property
    def name(self) -> str: ...

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision: ...

    def priority(self, held: HeldSession, now: float) -> float:
        """Eviction order among held sessions: the lowest is given back first."""
        ...


@dataclass(frozen=True, slots=True)
class Lru:
    """vLLM's prefix cache as shipped (`v1/core/kv_cache_utils.py` FreeKVCacheBlockQueue,
    `block_pool.py`): a finished request's cached blocks are appended to the free queue's
    tail and the head is evicted first, so the least recently released block goes first;
    nothing is ever held. `priority` is the same order stated SGLang's way (`LRUStrategy`:
    the last access time), for the held sessions this policy never creates."""

    name: str = "lru"

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        return ResidencyDecision(Residency.RELEASE, "least recently used goes first")

    def priority(self, held: HeldSession, now: float) -> float:
        return held.held_since_s


@dataclass(frozen=True, slots=True)
class TtlPin:
    """Continuum (Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent
    Scheduling with KV Cache Time-to-Live", arXiv:2511.02230; code: Hanchenli/vllm-continuum,
    `Scheduler.pin_request` / `unpin_requests_regular` /
    `pop_running_request_based_on_last_step`): when a request of a multi-turn program ends
    in a tool call, its KV stays pinned in GPU memory for a time-to-live; when the TTL
    expires the request is freed and its blocks fall back to vLLM's LRU; the program's next
    turn resumes from the pinned blocks. Continuum derives the TTL from the tool's duration
    distribution; this baseline fixes it (`ttl_s`). A turn known not to end in a tool call
    (the program's last step) is not pinned; when that is unknown every turn is.

    Under pressure Continuum releases "the longest retained KV" first, the pin with the
    latest expiry, so `priority` is minus `until_s`. Continuum lets a pin stand while it
    preempts a running request (when more than one runs) or keeps a new request waiting;
    here the mechanism gives pins back before either (a pin never makes an allocation
    fail), in this same order."""

    ttl_s: float = DEFAULT_PIN_TTL_S
    name: str = "ttl-pin"

    def __post_init__(self) -> None:
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl-pin needs a positive, finite TTL, got {self.ttl_s}")

    def decide(self, session: IdleSession, now: float) -> ResidencyDecision:
        if session.ends_in_tool_call is False:
            return ResidencyDecision(Residency.RELEASE, "last step: nothing to pin for")
        return ResidencyDecision(
            Residency.HOLD, f"pinned for the {self.ttl_s:g} s TTL", until_s=now + self.ttl_s
        )

    def priority(self, held: HeldSession, now: float) -> float:
        return -held.until_s


RESIDENCY_NAMES = ("lru", "ttl-pin")


def residency_policy(name: str) -> ResidencyPolicy:
    """`lru`, `ttl-pin` (TTL `DEFAULT_PIN_TTL_S`) or `ttl-pin:SECONDS`; ValueError else."""
    base, sep, arg = name.partition(":")
    if base == "lru" and not sep:
        return Lru()
    if base == "ttl-pin":
        if not sep:
            return TtlPin()
        try:
            ttl_s = float(arg)
        except ValueError:
            raise ValueError(f"ttl-pin:SECONDS needs a number of seconds, got {arg!r}") from None
        return TtlPin(ttl_s, name=f"ttl-pin:{ttl_s:g}")
    raise ValueError(f"unknown residency policy {name!r}; known: lru, ttl-pin, ttl-pin:SECONDS")
