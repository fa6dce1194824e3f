"""The contracts between a simulated engine and what decides where a session's KV stays:
a residency policy (the replay's), told when a request finishes or a pin comes due, whose
answer the engine carries out (`pin_keeper.py`); and the retention connector's twin
(`retention.py`), called where vLLM's scheduler calls its KV connector.

Residency (`residency=`, default none: vLLM as `sim/core/engine.py` models it; `pin_keeper.py`
carries it out): when a request finishes (not aborted),
`residency.after_turn(TurnEnd(...))` says what becomes of its cached blocks (`AfterTurn`):
"release" (vLLM's free), "hold" until a time (pinned, `PrefixCache.pin`, owner: its
session, else its id), "evict" (freed to the head of the eviction order) or "demote"
(copied to the host tier, then freed and forgotten on the GPU; ValueError without a host
tier). Pins due by a step's `now` are released at the start of that step, except those of
sessions whose next request is already waiting; a session's pin is released when its next
request is admitted (that request then holds what it reuses); and under pressure the cache
gives pins back in `residency.pin_priority` order before the scheduler would preempt or
stop admitting. `demote(session_id)` and `evict(session_id)` do the same to a held
session's pin at any time between steps. A hook with `revisit(PinDue)` is asked again about
each pin as it comes due (before it would lapse) and the engine extends it, demotes or
evicts it, or lets it lapse, as the answer says; a hook with `turn_arrived(req, now)` is
told of each request as it is added. A running request is never preempted for its own
session's pin (only a request adopting a hit spares it: it may hold those very blocks).

Retention (`retention=`, a `RetentionHook`, default none; the live worker's
`retention.SimRetention`, the retention connector's twin): called where vLLM's scheduler
calls its KV connector: at the start of each step, for each waiting request just before
its allocation (holds are given back until its prompt fits), when a running request is
short of blocks (holds given back: it is not scheduled this step and nobody is
preempted, as vLLM does on `has_pending_block_frees`), and before a finished or aborted
request's blocks are freed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from appliance.domain.retention import HostTierSize
from appliance.sim.engine_io import SimRequest
from appliance.sim.kv.block_pool import BlockPool
from appliance.sim.kv.cache_request import CacheHit, CacheRequest
from appliance.sim.kv.pins import Pin

KvAction = Literal["release", "hold", "evict", "demote"]


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """A request that has just finished, as a residency hook sees it."""

    request: SimRequest
    resident_tokens: int
    """Tokens in the request's cached (pinnable) blocks."""
    kv_usage: float
    now_s: float
    host: HostTierSize | None = None
    """The worker's host tier (None: it has none)."""
    pins: tuple[Pin, ...] = ()
    """The worker's standing pins."""


@dataclass(frozen=True, slots=True)
class PinDue:
    """A held session whose pin has come due, as a residency hook that revisits sees it."""

    pin: Pin
    kv_usage: float
    now_s: float
    host: HostTierSize | None = None
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True, slots=True)
class AfterTurn:
    """What becomes of a finished request's cached blocks."""

    action: KvAction = "release"
    until_s: float | None = None
    """"hold" only: when the pin lapses."""


class ResidencyHook(Protocol):
    """What the engine asks about a finished request's blocks, and the order in which pins
    are given back under pressure (lowest first). A hook may also have
    `revisit(due: PinDue) -> AfterTurn` (asked for each pin as it comes due: "hold"
    extends it, "demote" or "evict" end it so, "release" lets it lapse) and
    `turn_arrived(req: SimRequest, now: float) -> None` (told of every request as it
    arrives: a session's next turn)."""

    def after_turn(self, end: TurnEnd) -> AfterTurn: ...

    def pin_priority(self, pin: Pin, now: float) -> float: ...


class RetentionHook(Protocol):
    """Where the engine calls the retention connector's twin (`retention.SimRetention`),
    at the points vLLM's scheduler calls a KV connector."""

    def bind(self, pool: BlockPool, host: Any = None) -> None:
        """The engine's block pool, once built (vLLM's `bind_gpu_block_pool`), and its
        prefix cache when that has a host tier (`PrefixCache.copy_to_host`)."""
        ...

    def step_begins(self) -> None:
        """A step starts: directives and expiries, before anything is admitted."""
        ...

    def admitting(self, request: CacheRequest, hit: CacheHit) -> bool:
        """A waiting request is about to be allocated: make room for its prompt; False:
        admit nothing more in this step (a running request's room comes first)."""
        ...

    def relieve(self) -> bool:
        """A running request is short of blocks: True when holds were given back (the
        engine retries next step instead of preempting)."""
        ...

    def finished(self, request: CacheRequest, block_ids: Sequence[int]) -> None:
        """A request finished or was aborted; its blocks are freed next."""
        ...
