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

The policies: `lru` (vLLM's prefix cache as shipped) and `ttl-pin` (Continuum's
time-to-live pin, with a fixed TTL), each reproducing a system (cited in its docstring),
and `reaper` (`appliance.policy.reaper`), the appliance's own: it weighs the expected tool
wait against the re-prefill it saves and what the bytes are worth to others now, and
learns the waits from the returns and abandonments its caller reports. Every decision
carries a `kind` from a fixed set (metric labels) beside its sentence (the ledger, the
console), and the reaper's the figures behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

DEFAULT_PIN_TTL_S = 60.0
"""The TTL of `ttl-pin` when its name gives none (`ttl-pin:SECONDS` sets it)."""
DEFAULT_TENANT = "default"
"""The tenant of a session whose caller names none (the appliance's first tenant)."""


class ResidencyAction(StrEnum):
    RELEASE = "release"
    HOLD = "hold"
    DEMOTE = "demote"
    EVICT = "evict"


class ResidencyKind(StrEnum):
    """Why a decision was taken, as one of a fixed set (metric labels, counts)."""

    LRU = "lru"
    TTL_PIN = "ttl_pin"
    LAST_STEP = "last_step"
    """The turn did not end in a tool call: the session is not coming back."""
    MAX_RESIDENCY = "max_residency"
    NO_SIGNAL = "no_signal"
    """Nothing said how the turn ended, nor what it waits on, and a host tier backs the
    engine's LRU: released to them."""
    NOT_RETURNING = "not_returning"
    """Unlikely to be back before the maximum residency."""
    POOL_FREE = "pool_free"
    """HBM has room: holding costs nothing now."""
    HOLD_CHEAPEST = "hold_cheapest"
    DEMOTE_CHEAPEST = "demote_cheapest"
    RELEASE_CHEAPEST = "release_cheapest"
    TENANT_CAP = "tenant_cap"
    """Holding was cheapest, but the tenant's held bytes would pass its cap."""
    WITHIN_MARGIN = "within_margin"
    """Another action is cheaper, by less than the margin: the standing one stays."""
    BRANCH_QUOTA = "branch_quota"
    """A branch's own KV is over its quota: released (`appliance.policy.branches`)."""


@dataclass(frozen=True, slots=True)
class HostTierReading:
    """The worker's host-memory KV tier as it stands when the decision is taken."""

    free_bytes: int
    """Room for this session's KV (counting its own copy, if it has one there already)."""
    usage: float = 0.0
    """Share of the tier in use, 0..1: its pressure, as `kv_usage` is HBM's."""
    value: float | None = None
    """What a byte-second of the tier is worth at full pressure (see `hbm_value`)."""
    turnover: float = 1.0
    """The tier's size over the GPU KV pool's (1: unknown). The tier is an LRU cache that
    takes what the pool takes: k times larger, it keeps what it takes k times longer, so
    what it displaces when full is k times further from use (see `appliance.policy.reaper`)."""


@dataclass(frozen=True, slots=True)
class IdleSession:
    """A session whose turn has just finished, as the policy sees it. A caller that knows
    more than the first fields fills more in; the policy assumes for what it leaves out."""

    session_id: str
    resident_tokens: int
    """Tokens of its KV the worker still holds (whole cached blocks)."""
    finished_at_s: float
    ends_in_tool_call: bool | None = None
    """Whether the turn ended in a tool call (the agent will be back): None when unknown
    (a trace without tool markers)."""
    tool_class: str | None = None
    turns: int | None = None
    """The session's turns so far, this one included; None when unknown."""
    expected_wait_s: float | None = None
    """The client's hint of how long it will be away (`X-Expected-Tool-Wait-S`)."""
    recompute_s: float | None = None
    """Seconds of prefill it would take to rebuild `resident_tokens` from scratch, at the
    worker's measured speed."""
    kv_usage: float = 0.0
    """Its worker's HBM pressure: share of KV blocks held by requests and holds, 0..1
    (cached blocks no one holds count as free, as vLLM's `kv_cache_usage` counts them)."""
    tenant: str = DEFAULT_TENANT
    kv_bytes: int | None = None
    """Bytes of its resident KV; None: `resident_tokens` at the policy's bytes per token."""
    hbm_value: float | None = None
    """Seconds of prefill a byte-second of this worker's HBM saves whatever a hold would
    push out, at full pressure (the value of the space): e.g. the lowest `Reaper.priority`
    among the worker's holds. None: the policy's default."""
    tenant_held_bytes: int = 0
    """Bytes the tenant holds in HBM already, this session's own hold not counted."""
    host: HostTierReading | None = None
    """None: the worker has no host tier (nothing can be demoted)."""
    promote_s: float | None = None
    """Seconds to copy its KV from the host tier back to HBM at the measured bandwidth;
    None: `kv_bytes` at the policy's default bandwidth."""
    standing: ResidencyAction | None = None
    """The decision standing for this idle period, when the policy is asked again about it
    (the caller keeps it: `appliance.services.residency.residency_driver`); None: a new
    period."""


@dataclass(frozen=True, slots=True)
class HeldSession:
    """A session whose blocks are held, as the eviction order sees it."""

    session_id: str
    resident_tokens: int
    held_since_s: float
    until_s: float
    """When the hold lapses on its own."""
    idle: IdleSession | None = None
    """The session as the policy last decided on it (None: unknown, a new one)."""


@dataclass(frozen=True, slots=True)
class ResidencyFigures:
    """The numbers behind a decision that weighed costs. Costs are in seconds of prefill
    (times the policy's value of a second), per idle period, from now on."""

    p_return: float
    """P(the next turn arrives within `horizon_s`)."""
    expected_wait_s: float
    """E[min(remaining wait, horizon_s)]: how long a hold would last."""
    horizon_s: float
    """Seconds left of the maximum residency."""
    v_hbm: float
    """Cost of a byte-second of HBM now (0: the pool has room)."""
    c_hold: float
    """v_hbm x bytes x E[W]."""
    c_release: float
    """P(return) x re-prefill."""
    v_host: float | None = None
    """Cost of a byte-second of the host tier now; None: no host tier."""
    c_demote: float | None = None
    """v_host x bytes x E[W] + P(return) x promotion; None: no host tier."""


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    action: ResidencyAction
    reason: str
    """Why, as a sentence with its figures (the ledger, the console)."""
    until_s: float | None = None
    """HOLD only: when the hold lapses."""
    kind: ResidencyKind | None = None
    """Why, as one of a fixed set (metric labels); every policy here sets it."""
    figures: ResidencyFigures | None = None

    def __post_init__(self) -> None:
        if (self.action is ResidencyAction.HOLD) != (self.until_s is not None):
            raise ValueError("a HOLD, and only a HOLD, carries until_s")


class ResidencyPolicy(Protocol):
    """A residency policy: one decision per finished turn, one priority per held session.
    A policy keeps no record of its decisions: the caller passes the standing one back
    (`IdleSession.standing`, `HeldSession.idle`). One that learns from how idle periods end
    has `observe_return(session, now)` and `observe_abandoned(session, now)`, told once per
    period with the session as last decided on."""

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
        return ResidencyDecision(
            ResidencyAction.RELEASE, "least recently used goes first", kind=ResidencyKind.LRU
        )

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
            return ResidencyDecision(
                ResidencyAction.RELEASE,
                "last step: nothing to pin for",
                kind=ResidencyKind.LAST_STEP,
            )
        return ResidencyDecision(
            ResidencyAction.HOLD,
            f"pinned for the {self.ttl_s:g} s TTL",
            until_s=now + self.ttl_s,
            kind=ResidencyKind.TTL_PIN,
        )

    def priority(self, held: HeldSession, now: float) -> float:
        return -held.until_s
